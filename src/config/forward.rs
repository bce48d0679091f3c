//! `[forward]`: the forward-proxy mode (CONNECT on the proxy port; see `proxy::intercept`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, de::Error};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ForwardConfig {
    /// Host patterns decrypted and captured besides the built-in list (lowercase; `*` matches within one label).
    #[serde(deserialize_with = "host_patterns")]
    pub intercept: Vec<String>,
    /// Host patterns taken off the intercept list: tunnelled blind, never decrypted, even when built in.
    #[serde(deserialize_with = "host_patterns")]
    pub passthrough: Vec<String>,
    /// Extra trust anchors (PEM) for the TLS connections to intercepted hosts, besides the public roots.
    pub ca_file: Option<PathBuf>,
    /// For tests and local setups: host (lowercase) → the address to connect to instead of the host's DNS
    /// answer (SNI, Host and certificate checks still use the host name).
    #[serde(deserialize_with = "resolve_map")]
    pub resolve: BTreeMap<String, SocketAddr>,
}

fn host_patterns<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let list = Vec::<String>::deserialize(d)?;
    for p in &list {
        let ok = !p.is_empty()
            && p.split('.').all(|label| !label.is_empty())
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '*'));
        if !ok {
            return Err(D::Error::custom(format!(
                "{p:?} is not a host name pattern (letters, digits, '-', '.', '*' within a label)"
            )));
        }
    }
    Ok(list.into_iter().map(|p| p.to_ascii_lowercase()).collect())
}

fn resolve_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, SocketAddr>, D::Error> {
    BTreeMap::<String, String>::deserialize(d)?
        .into_iter()
        .map(|(host, addr)| match addr.parse() {
            Ok(a) => Ok((host.to_ascii_lowercase(), a)),
            Err(e) => Err(D::Error::custom(format!("{host}: {addr:?} is not IP:PORT ({e})"))),
        })
        .collect()
}
