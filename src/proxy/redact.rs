//! Secrets never leave the data path: header values and query parameters that carry credentials are replaced
//! before anything is captured. Forwarding is unaffected (the upstream needs the key); only the copy is redacted.

use http::HeaderMap;

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

pub fn is_secret_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    SECRET_HEADERS.contains(&lower.as_str()) || SECRET_FRAGMENTS.iter().any(|f| lower.contains(f))
}

/// Headers as (name, value) pairs with secret values replaced. Our own `x-llmtap-*` headers are omitted
/// (they become trace metadata instead).
pub fn redact_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !name.as_str().starts_with("x-llmtap-"))
        .map(|(name, value)| {
            let v = if is_secret_header(name.as_str()) {
                REDACTED.to_owned()
            } else {
                // Almost every value is visible ASCII: a plain copy; the lossy decode only for the rest.
                match value.to_str() {
                    Ok(v) => v.to_owned(),
                    Err(_) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
                }
            };
            (name.as_str().to_owned(), v)
        })
        .collect()
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
        let out = redact_headers(&h);
        assert!(out.iter().all(|(_, v)| !v.contains("sk-") && v != "AIza" && v != "t"));
        assert!(out.contains(&("content-type".into(), "application/json".into())));
        assert!(!out.iter().any(|(k, _)| k.starts_with("x-llmtap")));
        assert_eq!(out.len(), 5);
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
