//! The API token's checks: the gRPC API's bearer token (every RPC carries `authorization: Bearer <token>`, or is
//! refused with UNAUTHENTICATED) and the web viewer's cookie derived from it. The API streams every captured
//! prompt, so when it listens beyond loopback a token is required (see `app::run`).

use std::sync::Arc;

use hmac::{KeyInit, Mac};
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

use crate::config::{ApiToken, TokenDigest};
use crate::telemetry::Metrics;

/// What the viewer's cookie is an HMAC of, keyed by the token. A new label (or a new token) ends every cookie.
const VIEWER_COOKIE_LABEL: &[u8] = b"llmtap viewer session cookie v1";

/// A tonic interceptor checking the bearer token; lets everything through when no token is configured.
#[derive(Clone)]
pub struct BearerAuth {
    expected: Option<TokenDigest>,
    metrics: Arc<Metrics>,
}

impl BearerAuth {
    pub fn new(token: Option<&ApiToken>, metrics: Arc<Metrics>) -> BearerAuth {
        BearerAuth {
            expected: token.map(ApiToken::digest),
            metrics,
        }
    }
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(request);
        };
        let presented = request.metadata().get("authorization").and_then(|v| v.to_str().ok());
        if presented.is_some_and(|v| expected.matches_bearer(v)) {
            return Ok(request);
        }
        self.metrics.api_unauthenticated.inc();
        Err(Status::unauthenticated(
            "llmtap API: missing or wrong bearer token (metadata `authorization: Bearer <token>`, see [api] token)",
        ))
    }
}

/// The viewer's cookie value: HMAC-SHA256 of a fixed label keyed by the token, in hex. A cookie that leaks
/// (a browser profile, a debugging proxy) opens the viewer until the token changes but is not the token, which
/// also opens the gRPC API and `/metrics`.
pub fn viewer_cookie(token: &ApiToken) -> String {
    hmac_sha256_hex(token.expose().as_bytes(), VIEWER_COOKIE_LABEL)
}

fn hmac_sha256_hex(key: &[u8], message: &[u8]) -> String {
    // HMAC takes a key of any length; the error is for other MACs behind the same trait. An empty value never
    // matches (`cookie_matches`).
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(key) else {
        return String::new();
    };
    mac.update(message);
    mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a presented cookie value is `expected`, in constant time.
pub fn cookie_matches(expected: &str, presented: &str) -> bool {
    !expected.is_empty() && bool::from(expected.as_bytes().ct_eq(presented.trim().as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_is_rfc_4231s_and_cookies_compare_exactly() {
        // RFC 4231, test case 2.
        assert_eq!(
            hmac_sha256_hex(b"Jefe", b"what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let cookie = hmac_sha256_hex(b"s3cret", VIEWER_COOKIE_LABEL);
        assert_ne!(cookie, hmac_sha256_hex(b"s3cret2", VIEWER_COOKIE_LABEL));
        assert!(cookie_matches(&cookie, &cookie));
        assert!(!cookie_matches(&cookie, &cookie[..63]));
        assert!(!cookie_matches(&cookie, "s3cret"));
        assert!(!cookie_matches("", ""));
    }
}
