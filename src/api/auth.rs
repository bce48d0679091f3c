//! The gRPC API's optional bearer token: every RPC carries `authorization: Bearer <token>`, or is refused with
//! UNAUTHENTICATED. The API streams every captured prompt, so when it listens beyond loopback a token is required
//! (see `app::run`).

use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

use crate::config::ApiToken;
use crate::telemetry::Metrics;

/// A tonic interceptor checking the bearer token; lets everything through when no token is configured.
#[derive(Clone)]
pub struct BearerAuth {
    /// SHA-256 of the token: comparing digests in constant time hides both the token's bytes and its length.
    expected: Option<[u8; 32]>,
    metrics: Arc<Metrics>,
}

impl BearerAuth {
    pub fn new(token: Option<&ApiToken>, metrics: Arc<Metrics>) -> BearerAuth {
        BearerAuth {
            expected: token.map(|t| digest(t.expose())),
            metrics,
        }
    }

    fn presented_is_valid(&self, expected: &[u8; 32], request: &Request<()>) -> bool {
        let Some(value) = request.metadata().get("authorization") else {
            return false;
        };
        let Ok(value) = value.to_str() else { return false };
        let Some((scheme, token)) = value.trim().split_once(' ') else {
            return false;
        };
        scheme.eq_ignore_ascii_case("bearer") && token_matches(expected, token)
    }
}

pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `presented` is the token whose digest is `expected`, in constant time (the web viewer checks its
/// cookie and header with this too).
pub fn token_matches(expected: &[u8; 32], presented: &str) -> bool {
    bool::from(digest(presented.trim()).ct_eq(expected))
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(request);
        };
        if self.presented_is_valid(expected, &request) {
            return Ok(request);
        }
        self.metrics.api_unauthenticated.inc();
        Err(Status::unauthenticated(
            "llmtap API: missing or wrong bearer token (metadata `authorization: Bearer <token>`, see [api] token)",
        ))
    }
}
