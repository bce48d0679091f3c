//! Secrets never leave the data path: header values and query parameters that carry credentials are replaced
//! before anything is captured. Forwarding is unaffected (the upstream needs the key); only the copy is redacted.

use http::{HeaderMap, HeaderName};

use crate::capture::HeaderList;

pub const REDACTED: &str = "REDACTED";

/// Headers that always carry credentials.
const SECRET_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "x-goog-api-key",
    "api-key",
    "cookie",
    "set-cookie",
];

/// Name fragments that mark a header as secret even when we have never seen it (e.g. `x-portkey-api-key`).
const SECRET_FRAGMENTS: &[&str] = &["api-key", "apikey", "token", "secret", "password", "auth"];

/// Query parameters that carry credentials (`?key=` is Gemini's).
const SECRET_QUERY_PARAMS: &[&str] = &["key", "api_key", "apikey", "access_token", "token", "sig", "signature"];

/// Runs for every header of every captured exchange, so it takes a `HeaderName` (always lowercase: nothing to
/// allocate) and tests fragments only where their first letter occurs: a `str::contains` per fragment set up a
/// substring searcher each time and was ~70% of capture's cost on the data path.
pub fn is_secret_header(name: &HeaderName) -> bool {
    let name = name.as_str();
    let bytes = name.as_bytes();
    SECRET_HEADERS.contains(&name)
        || (0..bytes.len()).any(|i| {
            let rest = &bytes[i..];
            SECRET_FRAGMENTS
                .iter()
                .any(|f| f.as_bytes()[0] == rest[0] && rest.starts_with(f.as_bytes()))
        })
}

/// Headers as (name, value) pairs with secret values replaced. Our own `x-llmtap-*` headers are omitted
/// (they become trace metadata instead).
pub fn redact_headers(headers: &HeaderMap) -> HeaderList {
    let bytes = headers.iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    let mut out = HeaderList::with_capacity(headers.len(), bytes);
    for (header, value) in headers {
        let name = header.as_str();
        if name.starts_with("x-llmtap-") {
            continue;
        }
        // `push_wire`: a `HeaderMap`'s names and values never hold a newline (nor its names a colon).
        if is_secret_header(header) {
            out.push_wire(name, REDACTED);
        } else {
            // Almost every value is visible ASCII: no copy of its own; the lossy decode only for the rest.
            match value.to_str() {
                Ok(v) => out.push_wire(name, v),
                Err(_) => out.push_wire(name, &String::from_utf8_lossy(value.as_bytes())),
            }
        }
    }
    out
}

/// `path?query` with the values of secret query parameters replaced.
pub fn redact_path_and_query(path: &str, query: Option<&str>) -> String {
    let Some(query) = query else {
        return path.to_owned();
    };
    let redacted: Vec<String> = query
        .split('&')
        .map(|pair| {
            let (k, _) = pair.split_once('=').unwrap_or((pair, ""));
            if SECRET_QUERY_PARAMS.iter().any(|s| k.eq_ignore_ascii_case(s)) {
                format!("{k}={REDACTED}")
            } else {
                pair.to_owned()
            }
        })
        .collect();
    format!("{path}?{}", redacted.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_headers_are_redacted_and_llmtap_headers_dropped() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer sk-live".parse().unwrap());
        h.insert("x-api-key", "sk-ant".parse().unwrap());
        h.insert("x-goog-api-key", "AIza".parse().unwrap());
        h.insert("x-custom-auth-token", "t".parse().unwrap());
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("x-llmtap-session", "s1".parse().unwrap());
        h.insert("x-utf8", http::HeaderValue::from_bytes("café".as_bytes()).unwrap());
        h.insert("x-latin1", http::HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let out = redact_headers(&h);
        assert_eq!(out.get("x-utf8"), Some("café"));
        assert_eq!(out.get("x-latin1"), Some("caf\u{fffd}"));
        assert!(out.iter().all(|(_, v)| !v.contains("sk-") && v != "AIza" && v != "t"));
        assert_eq!(out.get("content-type"), Some("application/json"));
        assert_eq!(out.get("authorization"), Some(REDACTED));
        assert!(!out.iter().any(|(k, _)| k.starts_with("x-llmtap")));
        assert_eq!(out.len(), 7);
    }

    #[test]
    fn secret_names_are_found_anywhere_and_in_any_case() {
        for name in [
            "authorization",
            "Proxy-Authorization",
            "x-portkey-api-key",
            "X-Goog-Api-Key",
            "x-apikey",
            "x-session-token",
            "x-client-secret",
            "db-password",
            "cookie",
            "set-cookie",
            "x-custom-auth",
            "api-key",
            "x-api-key",
        ] {
            // Names arrive as `HeaderName`s, which lowercase whatever the client sent.
            let header = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert!(is_secret_header(&header), "{name} should be secret");
        }
        for name in [
            "content-type",
            "accept",
            "user-agent",
            "anthropic-version",
            "x-stainless-os",
            "x-stainless-retry-count",
            "accept-encoding",
            "a",
            "t",
        ] {
            let header = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert!(!is_secret_header(&header), "{name} should not be secret");
        }
    }

    #[test]
    fn key_query_param_is_redacted() {
        assert_eq!(
            redact_path_and_query("/v1beta/models/g:streamGenerateContent", Some("alt=sse&key=AIzaSECRET")),
            "/v1beta/models/g:streamGenerateContent?alt=sse&key=REDACTED"
        );
        assert_eq!(
            redact_path_and_query("/v1/messages", Some("beta=true")),
            "/v1/messages?beta=true"
        );
    }
}
