//! llmtap's local certificate authority: created on first use under `<data_dir>/ca/`, and the leaf certificates
//! it mints for intercepted hosts (one TLS server config per host, cached).
//!
//! The CA is as narrow as clients accept: a CA for server authentication only (key usage `keyCertSign` and
//! `cRLSign`, path length 0, so it cannot sign other CAs) with DNS name constraints naming the domains of the
//! intercept list as it was when the CA was made: even with its key stolen it cannot vouch for a bank. Hosts
//! outside them are tunnelled blind (logged once; `llmtap ca --rotate` makes a CA that covers the current list).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, GeneralSubtree, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, NameConstraints, PublicKeyData,
};
use rustc_hash::FxHashMap;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};

/// The CA's files under the data dir.
pub const CA_DIR: &str = "ca";
pub const CERT_FILE: &str = "llmtap-ca.pem";
pub const KEY_FILE: &str = "llmtap-ca-key.pem";
/// The permitted DNS subtrees the certificate carries, one per line (read back to decide what can be minted).
pub const NAMES_FILE: &str = "llmtap-ca-names.txt";
const LOCK_FILE: &str = ".lock";

/// Leaf certificates are valid this long; a cached one is replaced after half of it.
const LEAF_DAYS: i64 = 30;
/// Hosts whose TLS config is cached; beyond it the cache starts over (wildcard patterns can name many hosts).
const MAX_CACHED_HOSTS: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot build a certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("cannot build a TLS server config: {0}")]
    Tls(#[from] rustls::Error),
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CaError + 'a {
    move |source| CaError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// Where the CA lives and what it is, for `llmtap ca`.
#[derive(Debug, Clone)]
pub struct CaInfo {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// SHA-256 of the certificate's DER, colon-separated hex (as browsers and `openssl x509 -fingerprint` show).
    pub fingerprint: String,
    pub permitted: Vec<String>,
    pub created: bool,
}

pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    permitted: Vec<String>,
    /// One key for every leaf: minting a certificate is then a signature, not a key generation.
    leaf_key: KeyPair,
    leaves: Mutex<FxHashMap<String, (i64, Arc<ServerConfig>)>>,
    pub info: CaInfo,
}

/// Loads the CA from `<data_dir>/ca/`, creating it (with name constraints covering `permitted`) if absent, or
/// replacing it when `rotate`. A lock file keeps two processes (`llmtap run` and `serve`) from both creating one.
pub fn load_or_create(data_dir: &Path, permitted: &[String], rotate: bool) -> Result<Ca, CaError> {
    let dir = data_dir.join(CA_DIR);
    fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    restrict(&dir, 0o700)?;
    let lock_path = dir.join(LOCK_FILE);
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io("open", &lock_path))?;
    lock.lock().map_err(io("lock", &lock_path))?;
    let (cert_path, key_path, names_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE), dir.join(NAMES_FILE));
    let created = rotate || !(cert_path.exists() && key_path.exists());
    if created {
        let key = KeyPair::generate()?;
        let params = ca_params(&key, permitted);
        let cert = params.self_signed(&key)?;
        write_private(&key_path, key.serialize_pem().as_bytes())?;
        write_public(&names_path, permitted.join("\n").as_bytes())?;
        write_public(&cert_path, cert.pem().as_bytes())?;
    }
    let key_pem = fs::read_to_string(&key_path).map_err(io("read", &key_path))?;
    let cert_pem = fs::read_to_string(&cert_path).map_err(io("read", &cert_path))?;
    let names = fs::read_to_string(&names_path).unwrap_or_default();
    drop(lock);
    let key = KeyPair::from_pem(&key_pem)?;
    let permitted: Vec<String> = names
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    let params = ca_params(&key, &permitted);
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| CaError::Io {
        action: "parse",
        path: cert_path.clone(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let info = CaInfo {
        cert_path,
        key_path,
        fingerprint: fingerprint(&der),
        permitted: permitted.clone(),
        created,
    };
    Ok(Ca {
        issuer: Issuer::new(params, key),
        permitted,
        leaf_key: KeyPair::generate()?,
        leaves: Mutex::new(FxHashMap::default()),
        info,
    })
}

/// The CA's parameters, a function of its key and permitted names alone: loading an existing CA rebuilds the
/// same subject (so leaves chain to the stored certificate) without parsing it.
fn ca_params(key: &KeyPair, permitted: &[String]) -> CertificateParams {
    let mut params = CertificateParams::default();
    let id = hex(&Sha256::digest(key.subject_public_key_info()))[..8].to_owned();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "llmtap");
    // The id tells one machine's (or one rotation's) CA from another in a trust store.
    dn.push(DnType::CommonName, format!("llmtap local CA {id}"));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, -1, 10 * 365);
    if !permitted.is_empty() {
        params.name_constraints = Some(NameConstraints {
            permitted_subtrees: permitted.iter().map(|d| GeneralSubtree::DnsName(d.clone())).collect(),
            excluded_subtrees: Vec::new(),
        });
    }
    params
}

/// Valid from `from_days` to `to_days` from today (UTC; a day early, for clocks a little behind).
fn set_validity(params: &mut CertificateParams, from_days: i64, to_days: i64) {
    use chrono::Datelike;
    let day = |offset: i64| {
        let d = chrono::Utc::now().date_naive() + chrono::Duration::days(offset);
        rcgen::date_time_ymd(d.year(), d.month() as u8, d.day() as u8)
    };
    params.not_before = day(from_days);
    params.not_after = day(to_days);
}

impl Ca {
    /// Whether the CA's name constraints allow a certificate for `host` (IP addresses: no DNS constraint applies).
    pub fn covers(&self, host: &str) -> bool {
        if self.permitted.is_empty() || host.parse::<std::net::IpAddr>().is_ok() {
            return true;
        }
        self.permitted.iter().any(|d| {
            host == d
                || (host.len() > d.len()
                    && host.ends_with(d.as_str())
                    && host.as_bytes()[host.len() - d.len() - 1] == b'.')
        })
    }

    /// The TLS server config presenting a certificate for `host`, minted on first use and cached.
    pub fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, CaError> {
        let today = chrono::Utc::now().timestamp() / 86_400;
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((minted, config)) = leaves.get(host)
            && today - minted < LEAF_DAYS / 2
        {
            return Ok(config.clone());
        }
        let config = Arc::new(self.mint(host)?);
        if leaves.len() >= MAX_CACHED_HOSTS {
            leaves.clear();
        }
        leaves.insert(host.to_owned(), (today, config.clone()));
        Ok(config)
    }

    fn mint(&self, host: &str) -> Result<ServerConfig, CaError> {
        let mut params = CertificateParams::new(vec![host.to_owned()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params, -1, LEAF_DAYS);
        let cert = params.signed_by(&self.leaf_key, &self.issuer)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key)?;
        // The client's choice of protocol inside the tunnel; the upstream hop negotiates its own.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

fn fingerprint(der: &[u8]) -> String {
    Sha256::digest(der)
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key: written to a fresh file created 0600 (never readable by others, not even for a moment), then
/// renamed over the old one.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), CaError> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file: File = options.open(&tmp).map_err(io("create", &tmp))?;
    file.write_all(bytes).map_err(io("write", &tmp))?;
    file.sync_all().map_err(io("sync", &tmp))?;
    fs::rename(&tmp, path).map_err(io("rename", path))
}

fn write_public(path: &Path, bytes: &[u8]) -> Result<(), CaError> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).map_err(io("write", &tmp))?;
    fs::rename(&tmp, path).map_err(io("rename", path))
}

fn restrict(path: &Path, mode: u32) -> Result<(), CaError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io("restrict", path))?;
    }
    #[cfg(not(unix))]
    let _ = (path, mode);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_made_once_with_a_private_key_covers_its_names_and_rotates() {
        let dir = tempfile::tempdir().unwrap();
        let names = vec!["anthropic.com".to_owned(), "openai.com".to_owned()];
        let ca = load_or_create(dir.path(), &names, false).unwrap();
        assert!(ca.info.created);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&ca.info.key_path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let again = load_or_create(dir.path(), &[], false).unwrap();
        assert!(!again.info.created);
        assert_eq!(again.info.fingerprint, ca.info.fingerprint);
        assert_eq!(again.permitted, names, "the names are those the certificate carries");
        assert!(again.covers("api.anthropic.com") && again.covers("openai.com"));
        assert!(!again.covers("evilanthropic.com") && !again.covers("bank.example"));
        // Real clients verify the chain (tests/forward_proxy.rs); here: minted once per host.
        let config = again.server_config("api.anthropic.com").unwrap();
        assert!(
            Arc::ptr_eq(&config, &again.server_config("api.anthropic.com").unwrap()),
            "cached"
        );
        let rotated = load_or_create(dir.path(), &names, true).unwrap();
        assert_ne!(rotated.info.fingerprint, ca.info.fingerprint);
    }
}
