//! `[api]` (llmtap's gRPC API, and the token the viewer and `/metrics` share) and `[viewer]`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::serde_units::{addr, at_least_one, host_port_or_off, positive_secs};
use super::{ConfigError, env_var, invalid};

pub const DEFAULT_API_LISTEN: &str = "127.0.0.1:8788";
pub const DEFAULT_VIEWER_LISTEN: &str = "127.0.0.1:8789";

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// HOST:PORT for the gRPC API; None when "off".
    #[serde(deserialize_with = "host_port_or_off")]
    pub listen: Option<SocketAddr>,
    /// The bearer token every RPC (and the viewer, and `/metrics` beyond loopback) requires. After
    /// validation: env LLMTAP_API_TOKEN, else `token`, else the contents of `token_file`.
    pub token: Option<ApiToken>,
    /// File holding the token (surrounding whitespace ignored).
    pub token_file: Option<PathBuf>,
    /// Concurrent Subscribe/Export streams; beyond it RESOURCE_EXHAUSTED.
    #[serde(deserialize_with = "at_least_one")]
    pub max_streams: usize,
    /// A stream whose client takes nothing for this long is dropped.
    #[serde(rename = "stall_timeout_secs", deserialize_with = "positive_secs")]
    pub stall_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            listen: Some(addr(DEFAULT_API_LISTEN)),
            token: None,
            token_file: None,
            max_streams: 16,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

impl ApiConfig {
    /// Settles the token from its three sources (first set wins: env LLMTAP_API_TOKEN, `token`, `token_file`).
    pub(super) fn resolve_token(&mut self) -> Result<(), ConfigError> {
        if let Some(t) = env_var("LLMTAP_API_TOKEN") {
            self.token = Some(ApiToken::new(&t));
        } else if self.token.is_none()
            && let Some(path) = &self.token_file
        {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid("api.token_file", format!("cannot read {}: {e}", path.display())))?;
            self.token = Some(ApiToken::new(&text));
        }
        if self.token.as_ref().is_some_and(|t| t.0.is_empty()) {
            return Err(invalid("api.token", "is empty"));
        }
        Ok(())
    }
}

/// `[viewer]`: the web viewer (`api::viewer`). It shares `[api] token`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ViewerConfig {
    /// HOST:PORT for the web viewer; None when "off". Beyond loopback it requires `[api] token`.
    #[serde(deserialize_with = "host_port_or_off")]
    pub listen: Option<SocketAddr>,
    /// Whether the viewer may re-send a captured call (`POST api/calls/<id>/replay`, docs/viewer.md).
    pub replay: bool,
}

impl Default for ViewerConfig {
    fn default() -> Self {
        ViewerConfig {
            listen: Some(addr(DEFAULT_VIEWER_LISTEN)),
            replay: false,
        }
    }
}

/// The API's bearer token. Its `Debug` never shows it: `Config` is logged and printed in errors.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "String")]
pub struct ApiToken(String);

impl From<String> for ApiToken {
    fn from(text: String) -> Self {
        ApiToken::new(&text)
    }
}

impl ApiToken {
    fn new(text: &str) -> ApiToken {
        ApiToken(text.trim().to_owned())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What a presented token is checked against (the gRPC API, the viewer, `/metrics`).
    pub fn digest(&self) -> TokenDigest {
        TokenDigest::of(&self.0)
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

/// SHA-256 of the API token: comparing digests in constant time hides both the token's bytes and its length.
#[derive(Clone, Copy)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    fn of(token: &str) -> TokenDigest {
        use sha2::Digest;
        TokenDigest(sha2::Sha256::digest(token.trim().as_bytes()).into())
    }

    /// Whether `presented` is the token, in constant time.
    pub fn matches(&self, presented: &str) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(TokenDigest::of(presented).0.ct_eq(&self.0))
    }

    /// Whether an `Authorization` value is `Bearer <the token>` (the scheme in any case).
    pub fn matches_bearer(&self, authorization: &str) -> bool {
        authorization
            .trim()
            .split_once(' ')
            .is_some_and(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer") && self.matches(token))
    }
}
