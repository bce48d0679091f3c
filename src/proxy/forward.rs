//! The upstream side: a pooled hyper-util client over rustls, and the header rules for a transparent hop.

use std::path::Path;
use std::time::Duration;

use http::{HeaderMap, HeaderName, Uri, header};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustc_hash::FxHashMap;
use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use super::tap::{RequestBody, TapBody};
use crate::config::UpstreamConfig;

pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, TapBody<RequestBody>>;

#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("cannot read ca_file {path}: {source}")]
    CaFile {
        path: String,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("ca_file {path} holds no usable certificate")]
    NoCertificate { path: String },
    #[error("the TLS provider does not support the safe protocol versions: {0}")]
    Protocols(#[source] rustls::Error),
}

/// One client per distinct trust configuration; upstreams without `ca_file` share the default client (and its pool).
pub struct Clients {
    default: UpstreamClient,
    by_upstream: FxHashMap<String, UpstreamClient>,
}

impl Clients {
    pub fn build<'a>(upstreams: impl IntoIterator<Item = &'a UpstreamConfig>) -> Result<Clients, TlsSetupError> {
        let default = client(root_store(None)?)?;
        let mut by_upstream = FxHashMap::default();
        for u in upstreams {
            if let Some(ca) = &u.ca_file {
                by_upstream.insert(u.name.to_string(), client(root_store(Some(ca))?)?);
            }
        }
        Ok(Clients { default, by_upstream })
    }

    pub fn for_upstream(&self, name: &str) -> &UpstreamClient {
        if self.by_upstream.is_empty() {
            return &self.default;
        }
        self.by_upstream.get(name).unwrap_or(&self.default)
    }
}

pub(crate) fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, TlsSetupError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let display = path.display().to_string();
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|source| TlsSetupError::CaFile {
                path: display.clone(),
                source,
            })?
            .collect::<Result<_, _>>()
            .map_err(|source| TlsSetupError::CaFile {
                path: display.clone(),
                source,
            })?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(TlsSetupError::NoCertificate { path: display });
        }
    }
    Ok(roots)
}

fn client(roots: RootCertStore) -> Result<UpstreamClient, TlsSetupError> {
    // An error, not a fallback: a client built some other way (no roots) would fail every HTTPS call later.
    let tls =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(TlsSetupError::Protocols)?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(https))
}

/// The upstream URI for `rest` (path after the route prefix) and the client's query string.
pub fn upstream_uri(upstream: &UpstreamConfig, rest: &str, query: Option<&str>) -> Result<Uri, http::Error> {
    let base_path = upstream.url.path().trim_end_matches('/');
    let mut pq = String::with_capacity(base_path.len() + rest.len() + query.map_or(0, |q| q.len() + 1));
    pq.push_str(base_path);
    pq.push_str(rest);
    if let Some(q) = query {
        pq.push('?');
        pq.push_str(q);
    }
    let mut parts = upstream.url.clone().into_parts();
    parts.path_and_query = Some(pq.parse()?);
    Ok(Uri::from_parts(parts)?)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) are not forwarded; neither are those the `Connection` header names.
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection" | "keep-alive" | "proxy-connection" | "te" | "trailer" | "transfer-encoding" | "upgrade"
    )
}

pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers, |_| false);
}

/// Request headers as the upstream should see them: hop-by-hop, `host` (the client sets it from the URI),
/// `proxy-authorization` (credentials for a proxy on the way, here llmtap: the provider has no use for them and
/// must not receive them) and llmtap's own `x-llmtap-*` headers removed. Everything else, the provider's
/// credentials included, passes unchanged.
pub fn upstream_request_headers(headers: &mut HeaderMap) {
    strip(headers, |name| {
        name == "host" || name == "proxy-authorization" || name.starts_with("x-llmtap-")
    });
}

/// Remove hop-by-hop headers, those `Connection` names, and those `also` picks. One pass over the names finds
/// what is present (usually nothing, or `host` and `connection`): a `remove` per candidate name hashed and
/// probed nine names per message whether they were there or not (~2k instructions per proxied request).
fn strip(headers: &mut HeaderMap, also: impl Fn(&str) -> bool) {
    let mut doomed: smallvec::SmallVec<[HeaderName; 4]> = smallvec::SmallVec::new();
    for name in headers.keys() {
        let s = name.as_str();
        if is_hop_by_hop(s) || also(s) {
            doomed.push(name.clone());
        }
    }
    if doomed.contains(&header::CONNECTION) {
        let named = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok());
        doomed.extend(named);
    }
    for name in doomed {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ApiFamily;

    #[test]
    fn uri_joins_prefix_rest_and_query() {
        let u = UpstreamConfig::new(
            "groq",
            "https://api.groq.com/openai".parse().unwrap(),
            ApiFamily::Openai,
        );
        let uri = upstream_uri(&u, "/v1/chat/completions", Some("a=1")).unwrap();
        assert_eq!(uri.to_string(), "https://api.groq.com/openai/v1/chat/completions?a=1");
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    fn sorted_names(h: &HeaderMap) -> Vec<&str> {
        let mut names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        names
    }

    #[test]
    fn hop_by_hop_and_own_headers_removed() {
        let mut h = headers(&[
            ("connection", "keep-alive, x-foo"),
            ("x-foo", "1"),
            ("host", "127.0.0.1"),
            ("x-llmtap-session", "s"),
            ("authorization", "Bearer k"),
            ("proxy-authorization", "Basic cHJveHk6c2VjcmV0"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("x-llmtap-agent", "a"),
            ("content-type", "application/json"),
        ]);
        upstream_request_headers(&mut h);
        assert_eq!(sorted_names(&h), ["authorization", "content-type"]);

        let mut r = headers(&[
            ("connection", "close"),
            ("upgrade", "h2c"),
            ("host", "kept-on-responses"),
            ("x-request-id", "1"),
        ]);
        strip_hop_by_hop(&mut r);
        assert_eq!(sorted_names(&r), ["host", "x-request-id"]);
    }
}
