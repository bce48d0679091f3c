//! `llmtap run -- <command...>` and `llmtap ca`: the forward-proxy mode from the user's side. The child gets
//! the proxy and llmtap's CA through the variables its HTTP stacks read, and a session id of its own.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use crate::proxy::intercept::ca::{CaError, CaInfo};
use crate::proxy::intercept::proxy_url;

/// Where the machine's own trust store lives, by distribution (the first that exists is used).
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
    "/usr/local/etc/openssl/cert.pem",
];

/// The bundle written next to the CA: the system roots, then llmtap's CA.
pub const BUNDLE_FILE: &str = "bundle.pem";

/// The system roots file to extend: `$SSL_CERT_FILE` if it names one, else the distribution's.
pub fn system_roots(ssl_cert_file: Option<&Path>) -> Option<PathBuf> {
    ssl_cert_file
        .filter(|p| p.is_file())
        .map(Path::to_path_buf)
        .or_else(|| SYSTEM_BUNDLES.iter().map(PathBuf::from).find(|p| p.is_file()))
}

/// Writes `<ca dir>/bundle.pem`: the system roots (so the child's other TLS keeps working under
/// `SSL_CERT_FILE`) followed by llmtap's CA. Returns its path and whether system roots were found.
pub fn write_bundle(ca: &CaInfo, system: Option<&Path>) -> Result<(PathBuf, bool), CaError> {
    let io = |action: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| CaError::Io { action, path, source }
    };
    let ca_pem = std::fs::read_to_string(&ca.cert_path).map_err(io("read", &ca.cert_path))?;
    let mut bundle = match system {
        Some(p) => std::fs::read_to_string(p).map_err(io("read", p))?,
        None => String::new(),
    };
    if !bundle.is_empty() && !bundle.ends_with('\n') {
        bundle.push('\n');
    }
    bundle.push_str(&ca_pem);
    let dir = ca.cert_path.parent().unwrap_or(Path::new("."));
    let path = dir.join(BUNDLE_FILE);
    let tmp = dir.join(format!("{BUNDLE_FILE}.tmp"));
    std::fs::write(&tmp, bundle).map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(io("rename", &path))?;
    Ok((path, system.is_some()))
}

/// The address a local client uses for a listener (an unspecified bind address is reached on loopback).
pub fn reachable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
    } else {
        addr
    }
}

/// The variables `llmtap run` sets for its child.
pub fn child_env(
    proxy: SocketAddr,
    session: &str,
    token: Option<&str>,
    ca_cert: &Path,
    bundle: &Path,
    no_proxy: Option<&str>,
) -> Vec<(String, String)> {
    let url = proxy_url(reachable(proxy), Some(session), token);
    let ca = ca_cert.display().to_string();
    let bundle = bundle.display().to_string();
    // Loopback stays direct: a local model server, llmtap's own viewer and API.
    let mut bypass = vec!["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()];
    if let Some(existing) = no_proxy {
        bypass.extend(
            existing
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty() && !bypass.iter().any(|b| b == s))
                .map(str::to_owned)
                .collect::<Vec<_>>(),
        );
    }
    let bypass = bypass.join(",");
    let mut env = Vec::new();
    // Plain http:// calls come through too (llmtap serves the absolute form): captured on an intercepted host.
    for name in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
        env.push((name.to_owned(), url.clone()));
    }
    for name in ["NO_PROXY", "no_proxy"] {
        env.push((name.to_owned(), bypass.clone()));
    }
    env.extend(
        [
            // Node (Claude Code, Gemini CLI, the JS SDKs): proxy support from the environment (Node 24+),
            // and one more trusted CA on top of Node's own roots.
            ("NODE_USE_ENV_PROXY", "1"),
            ("NODE_EXTRA_CA_CERTS", ca.as_str()),
            // OpenSSL-based stacks (Python's ssl/httpx, curl, git) replace their roots with this file: the bundle
            // carries the system roots too.
            ("SSL_CERT_FILE", bundle.as_str()),
            ("REQUESTS_CA_BUNDLE", bundle.as_str()),
            ("CURL_CA_BUNDLE", bundle.as_str()),
            // Codex CLI: the roots for its own HTTP client.
            ("CODEX_CA_CERTIFICATE", bundle.as_str()),
            ("LLMTAP_SESSION", session),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    env
}

/// `llmtap ca`'s text: where the CA is, what it is, and how to trust or remove it.
pub fn describe(info: &CaInfo) -> String {
    let cert = info.cert_path.display();
    let names = if info.permitted.is_empty() {
        "any host".to_owned()
    } else {
        info.permitted.join(", ")
    };
    format!(
        "llmtap's local CA{created}
  certificate: {cert}
  private key: {key} (0600; never leaves this machine)
  SHA-256:     {fp}
  valid for:   {names} (name constraints; TLS server certificates only)

Trust it for one process (what `llmtap run -- <command>` sets for you):
  Node (Claude Code, Gemini CLI, JS SDKs): NODE_EXTRA_CA_CERTS={cert}
  Python (openai, anthropic, httpx, requests): SSL_CERT_FILE / REQUESTS_CA_BUNDLE = a bundle of the system
    roots plus this file (`llmtap run` writes one next to it: {bundle})
  Codex CLI: CODEX_CA_CERTIFICATE=<that bundle>
Trust it machine-wide (every program; remove it the same way):
  Debian/Ubuntu: sudo cp {cert} /usr/local/share/ca-certificates/llmtap-ca.crt && sudo update-ca-certificates
                 remove: sudo rm /usr/local/share/ca-certificates/llmtap-ca.crt && sudo update-ca-certificates --fresh
  Fedora/RHEL:   sudo cp {cert} /etc/pki/ca-trust/source/anchors/llmtap-ca.pem && sudo update-ca-trust
                 remove: sudo rm /etc/pki/ca-trust/source/anchors/llmtap-ca.pem && sudo update-ca-trust
  macOS:         sudo security add-trusted-cert -d -r trustRoot -k /Library/Keychains/System.keychain {cert}
                 remove: sudo security delete-certificate -Z {fp_plain} /Library/Keychains/System.keychain
  Windows:       certutil -addstore -user Root {cert}
                 remove: certutil -delstore -user Root \"{cn}\"
Rotate it (a new key; trust the new one, remove the old): llmtap ca --rotate, then restart llmtap.
",
        created = if info.created { " (created now)" } else { "" },
        key = info.key_path.display(),
        fp = info.fingerprint,
        fp_plain = info.fingerprint.replace(':', ""),
        bundle = info.cert_path.with_file_name(BUNDLE_FILE).display(),
        cn = "llmtap local CA",
    )
}

/// A fresh session id for one `llmtap run`.
pub fn new_session_id() -> String {
    format!("run-{}", uuid::Uuid::now_v7().simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_child_gets_the_proxy_the_ca_and_its_session() {
        let env = child_env(
            "0.0.0.0:8787".parse().unwrap(),
            "run-1",
            None,
            Path::new("/d/ca/llmtap-ca.pem"),
            Path::new("/d/ca/bundle.pem"),
            Some("corp.example, localhost"),
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HTTPS_PROXY"), Some("http://run-1:llmtap@127.0.0.1:8787"));
        assert_eq!(get("HTTP_PROXY"), Some("http://run-1:llmtap@127.0.0.1:8787"));
        assert_eq!(get("NO_PROXY"), Some("localhost,127.0.0.1,::1,corp.example"));
        assert_eq!(get("NODE_EXTRA_CA_CERTS"), Some("/d/ca/llmtap-ca.pem"));
        assert_eq!(get("SSL_CERT_FILE"), Some("/d/ca/bundle.pem"));
        assert_eq!(get("NODE_USE_ENV_PROXY"), Some("1"));
        assert_eq!(get("LLMTAP_SESSION"), Some("run-1"));
    }
}
