//! Configuration: TOML → `RawConfig` (serde, `deny_unknown_fields`) → `Config` via a pure `validate()`.
//!
//! Defaults live in one place (the `Default` impls here) and are the documented defaults in
//! `config/llmtap.example.toml`. Errors carry the dotted path of the offending key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Which wire protocol family an upstream speaks. Selects the provider adapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ApiFamily {
    Openai,
    Anthropic,
    Gemini,
    /// AWS Bedrock runtime (`bedrock-runtime.{region}.amazonaws.com`): InvokeModel with Anthropic bodies, Converse.
    Bedrock,
    /// Bedrock Mantle (`bedrock-mantle.{region}.api.aws`): Anthropic Messages and OpenAI Chat / Responses.
    #[serde(rename = "bedrock-mantle")]
    BedrockMantle,
    /// Google Vertex AI (`{region}-aiplatform.googleapis.com`): Claude (rawPredict) and Gemini.
    Vertex,
    /// Azure OpenAI (`{resource}.openai.azure.com`): deployments and the `/openai/v1` API.
    #[serde(rename = "azure-openai")]
    AzureOpenai,
}

impl ApiFamily {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiFamily::Openai => "openai",
            ApiFamily::Anthropic => "anthropic",
            ApiFamily::Gemini => "gemini",
            ApiFamily::Bedrock => "bedrock",
            ApiFamily::BedrockMantle => "bedrock-mantle",
            ApiFamily::Vertex => "vertex",
            ApiFamily::AzureOpenai => "azure-openai",
        }
    }
}

/// How `llmtap serve` writes its log to stderr: text for people (coloured only on a terminal), or one JSON object
/// per line for log shippers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config {path}: at `{key}`: {message}")]
    Parse {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("invalid config: `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error("invalid config: `cost.prices_file`: {0}")]
    Prices(crate::cost::CostTableError),
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

// === raw (what the file says) ===

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub log_format: Option<LogFormat>,
    #[serde(default)]
    pub capture: RawCapture,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub derive: RawDerive,
    #[serde(default)]
    pub upstreams: BTreeMap<String, RawUpstream>,
    #[serde(default)]
    pub export: RawExport,
    #[serde(default)]
    pub api: RawApi,
    #[serde(default)]
    pub viewer: RawViewer,
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub cost: RawCost,
    #[serde(default)]
    pub forward: RawForward,
    #[serde(default)]
    pub telemetry: RawTelemetry,
}

/// `[telemetry]`: llmtap's own metrics over OTLP (they are always on `/metrics`; see `telemetry::sdk`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    /// OTLP/gRPC URL (`http://host:4317`) to push llmtap's metrics to; unset: no push.
    pub otlp_endpoint: Option<String>,
    /// Seconds between pushes (default 60).
    pub interval_secs: Option<u64>,
    /// Seconds one push may take (default 10).
    pub timeout_secs: Option<u64>,
}

/// `[forward]`: the forward-proxy mode (CONNECT on the proxy port; see `proxy::intercept`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawForward {
    /// Hosts decrypted and captured besides the built-in list (`*` wildcards within one label).
    pub intercept: Option<Vec<String>>,
    /// Hosts taken off the intercept list: tunnelled blind, never decrypted.
    pub passthrough: Option<Vec<String>>,
    /// Extra trust anchors (PEM) for the TLS connections to intercepted hosts, besides the public roots.
    pub ca_file: Option<PathBuf>,
    /// For tests and local setups: connect to this address for a host (SNI, Host and certificate checks still
    /// use the host name).
    #[serde(default)]
    pub resolve: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCost {
    /// TOML file of price overrides (private, fine-tuned or negotiated prices); see `crate::cost`.
    pub prices_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawViewer {
    /// HOST:PORT for the web viewer, or "off". Beyond loopback it requires `[api] token`.
    pub listen: Option<String>,
    /// Whether the viewer may re-send a captured call (`POST api/calls/<id>/replay`; default false).
    pub replay: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub header_read_timeout_secs: Option<u64>,
    pub idle_timeout_secs: Option<u64>,
    pub body_read_timeout_secs: Option<u64>,
    pub send_timeout_secs: Option<u64>,
    pub max_connections: Option<usize>,
    pub shutdown_grace_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawApi {
    /// HOST:PORT for llmtap's gRPC API, or "off".
    pub listen: Option<String>,
    /// Bearer token every RPC must carry (env LLMTAP_API_TOKEN wins over both).
    pub token: Option<String>,
    /// File holding the token (surrounding whitespace ignored).
    pub token_file: Option<PathBuf>,
    /// Concurrent Subscribe/Export streams; beyond it RESOURCE_EXHAUSTED.
    pub max_streams: Option<usize>,
    /// A stream whose client takes nothing for this long is dropped.
    pub stall_timeout_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawExport {
    #[serde(default)]
    pub otlp: Vec<RawOtlp>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOtlp {
    pub name: Option<String>,
    pub endpoint: Option<String>,
    pub protocol: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub compression: Option<String>,
    pub timeout_secs: Option<u64>,
    pub capture_content: Option<bool>,
    pub batch_size: Option<usize>,
    pub retry_initial_ms: Option<u64>,
    pub retry_max_ms: Option<u64>,
    pub metrics: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCapture {
    pub enabled: Option<bool>,
    pub max_body_bytes: Option<usize>,
    pub queue_capacity: Option<usize>,
    pub queue_bytes: Option<u64>,
    pub spill_bytes: Option<u64>,
    pub redact_headers: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub batch_size: Option<usize>,
    pub retention_days: Option<u64>,
    pub max_traces: Option<u64>,
    pub url: Option<String>,
    pub replica: Option<String>,
}

/// The URL may hold a password: a config printed for debugging shows it redacted.
impl std::fmt::Debug for SharedStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStoreConfig")
            .field("url", &redacted_url(&self.url))
            .field("replica", &self.replica)
            .finish()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDerive {
    pub idle_timeout_secs: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub url: String,
    pub api: Option<ApiFamily>,
    pub ca_file: Option<PathBuf>,
}

// === validated (what the program uses) ===

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// `log_format`: how `serve` writes its log.
    pub log_format: LogFormat,
    pub capture: CaptureConfig,
    pub store: StoreConfig,
    pub derive: DeriveConfig,
    /// Keyed by route name (the first path segment).
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    pub otlp: Vec<OtlpConfig>,
    /// llmtap's own gRPC API; None when "off".
    pub api_listen: Option<SocketAddr>,
    /// The gRPC API's token and limits.
    pub api: ApiConfig,
    /// The web viewer (`api::viewer`); None when "off". It shares `[api] token`.
    pub viewer_listen: Option<SocketAddr>,
    /// `[viewer] replay`: the viewer's Replay of a captured call (docs/viewer.md); off by default.
    pub viewer_replay: bool,
    /// Resource attributes for exports (service.name and OTEL_RESOURCE_ATTRIBUTES).
    pub resource: Vec<(String, String)>,
    pub server: ServerConfig,
    /// `[cost] prices_file`: price overrides, read by [`Config::price_table`].
    pub prices_file: Option<PathBuf>,
    /// `[forward]`: the forward-proxy mode.
    pub forward: ForwardConfig,
    /// `[telemetry]`: where llmtap's own metrics go besides `/metrics`.
    pub telemetry: TelemetryConfig,
}

/// llmtap's own metrics over OTLP (`[telemetry]`).
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// OTLP/gRPC endpoint; None: metrics only on `/metrics`.
    pub otlp_endpoint: Option<String>,
    pub interval: Duration,
    pub export_timeout: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            interval: Duration::from_secs(60),
            export_timeout: Duration::from_secs(10),
        }
    }
}

/// The forward-proxy mode's settings (`[forward]`, see `proxy::intercept`).
#[derive(Debug, Clone, Default)]
pub struct ForwardConfig {
    /// Host patterns added to the built-in intercept list (lowercase; `*` matches within one label).
    pub intercept: Vec<String>,
    /// Host patterns removed from it: never decrypted, even when built in.
    pub passthrough: Vec<String>,
    /// Extra trust anchors for the upstream side of intercepted connections.
    pub ca_file: Option<PathBuf>,
    /// Host → address to connect to instead of the host's DNS answer (tests; a local mirror).
    pub resolve: BTreeMap<String, SocketAddr>,
}

impl Config {
    /// The embedded price table with `[cost] prices_file`'s overrides. Built by the commands that price calls
    /// (`serve`, and `check-config` to validate the file), not while validating: parsing the embedded table
    /// would slow every `llmtap sessions` by a quarter of a second (debug build).
    pub fn price_table(&self) -> Result<crate::cost::CostTable, ConfigError> {
        match &self.prices_file {
            Some(path) => crate::cost::CostTable::with_overrides(path),
            None => crate::cost::CostTable::embedded(),
        }
        .map_err(ConfigError::Prices)
    }
}

/// Limits on the listening side: a slow or idle client must not hold a connection (and its file descriptor and
/// buffers) forever, and no number of clients may exhaust the process's file descriptors.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A client must send a request's whole header block within this time (hyper's default, 30 s). For
    /// HTTP/1.1 the clock also runs while a kept-alive connection waits for its next request.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed (nginx's `keepalive_timeout`, 75 s).
    pub idle_timeout: Duration,
    /// A client that sends nothing of a request body it started for this long has its connection closed
    /// (nginx's `client_body_timeout`, 60 s): a stalled upload holds its socket and an upstream connection.
    pub body_read_timeout: Duration,
    /// A client that takes nothing of a response body for this long has its connection closed (nginx's
    /// `send_timeout`, 60 s).
    pub send_timeout: Duration,
    /// Connections served at once; beyond it llmtap stops accepting until one closes (they wait in the
    /// kernel's backlog), like nginx's `worker_connections`.
    pub max_connections: usize,
    /// After SIGTERM/SIGINT, how long in-flight exchanges may take before their connections are closed.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(75),
            body_read_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_connections: 4096,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    Grpc,
    HttpProtobuf,
    HttpJson,
}

#[derive(Debug, Clone)]
pub struct OtlpConfig {
    /// Names the destination's cursor in the store: keep it stable across restarts.
    pub name: String,
    /// For gRPC the server URL; for HTTP the full traces URL (…/v1/traces).
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    pub headers: Vec<(String, String)>,
    pub gzip: bool,
    pub timeout: Duration,
    /// Put prompts, outputs, system instructions and tool definitions on spans (opt-in: they hold user data).
    pub capture_content: bool,
    pub batch_size: usize,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Also send the GenAI client metrics (token usage, operation duration, time to first chunk).
    pub metrics: bool,
}

/// The smallest non-zero `capture.spill_bytes`.
pub const MIN_SPILL_BYTES: u64 = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct CaptureConfig {
    pub enabled: bool,
    /// Per direction, per exchange. Beyond it the body is still forwarded; the trace is marked truncated.
    pub max_body_bytes: usize,
    /// Exchanges waiting to be processed. When full, new exchanges are dropped and counted (never blocks).
    pub queue_capacity: usize,
    /// Captured bytes (bodies and headers) waiting to be processed; same policy as `queue_capacity`.
    pub queue_bytes: u64,
    /// Exchanges the pipeline cannot take yet are written to `<data_dir>/spill/` up to this many bytes
    /// instead of being dropped (see `capture::spill`); 0 = no spill: a full queue drops.
    pub spill_bytes: u64,
    /// Name fragments redacted in the captured copy besides the built-in rule (see `proxy::redact`): headers
    /// and query parameters, any case and separator style.
    pub redact_headers: Vec<String>,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        CaptureConfig {
            enabled: true,
            max_body_bytes: 32 * 1024 * 1024,
            queue_capacity: 4096,
            queue_bytes: 256 * 1024 * 1024,
            spill_bytes: 1024 * 1024 * 1024,
            redact_headers: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub batch_size: usize,
    /// 0 = keep forever.
    pub retention_days: u64,
    /// 0 = unbounded.
    pub max_traces: u64,
    /// The team's shared PostgreSQL store, when configured (`[store] url`).
    pub shared: Option<SharedStoreConfig>,
}

/// `[store] url` and `replica`: where this replica delivers its records, and under what name.
#[derive(Clone)]
pub struct SharedStoreConfig {
    /// `postgres://…`; may hold a password, so never logged as is (`store::postgres::redacted`).
    pub url: String,
    /// This replica's name in the shared store; None: a random id kept in the data dir (stable across
    /// restarts).
    pub replica: Option<String>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            batch_size: 4096,
            retention_days: 30,
            max_traces: 0,
            shared: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DeriveConfig {
    pub idle_timeout: Duration,
}

impl Default for DeriveConfig {
    fn default() -> Self {
        DeriveConfig {
            idle_timeout: Duration::from_secs(30 * 60),
        }
    }
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Shared: every captured exchange names its upstream (a refcount bump on the data path, not a copy).
    pub name: std::sync::Arc<str>,
    /// Scheme + authority + optional path prefix, no trailing slash.
    pub url: http::Uri,
    pub api: ApiFamily,
    pub ca_file: Option<PathBuf>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";
pub const DEFAULT_API_LISTEN: &str = "127.0.0.1:8788";
pub const DEFAULT_VIEWER_LISTEN: &str = "127.0.0.1:8789";

/// The built-in upstreams: route `/<name>/...` to the provider's public API.
/// The gRPC API's access control and stream limits (`[api]`).
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub token: Option<ApiToken>,
    pub max_streams: usize,
    pub stall_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            token: None,
            max_streams: 16,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// The API's bearer token. Its `Debug` never shows it: `Config` is logged and printed in errors.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

impl ApiToken {
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What a presented token is checked against (the gRPC API, the viewer, `/metrics`).
    pub fn digest(&self) -> TokenDigest {
        TokenDigest::of(&self.0)
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

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

/// `[api]` token sources, first set wins: env LLMTAP_API_TOKEN, `token`, `token_file`.
fn api_config(raw: &RawApi) -> Result<ApiConfig, ConfigError> {
    let from_file = match &raw.token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| invalid("api.token_file", format!("cannot read {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let token = env_var("LLMTAP_API_TOKEN")
        .or_else(|| raw.token.clone())
        .or(from_file)
        .map(|t| t.trim().to_owned());
    if token.as_deref() == Some("") {
        return Err(invalid("api.token", "is empty"));
    }
    let defaults = ApiConfig::default();
    let max_streams = raw.max_streams.unwrap_or(defaults.max_streams);
    if max_streams == 0 {
        return Err(invalid("api.max_streams", "must be at least 1"));
    }
    let stall_timeout = raw
        .stall_timeout_secs
        .map(Duration::from_secs)
        .unwrap_or(defaults.stall_timeout);
    if stall_timeout.is_zero() {
        return Err(invalid("api.stall_timeout_secs", "must be at least 1"));
    }
    Ok(ApiConfig {
        token: token.map(ApiToken),
        max_streams,
        stall_timeout,
    })
}

pub fn builtin_upstreams() -> [(&'static str, &'static str, ApiFamily); 3] {
    [
        ("openai", "https://api.openai.com", ApiFamily::Openai),
        ("anthropic", "https://api.anthropic.com", ApiFamily::Anthropic),
        ("gemini", "https://generativelanguage.googleapis.com", ApiFamily::Gemini),
    ]
}

/// `$LLMTAP_DATA_DIR`, else `$XDG_DATA_HOME/llmtap`, else `~/.local/share/llmtap`, else `./llmtap-data`.
/// A URL that names the shared store.
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// `url` with any password replaced by `***` (`postgres://user:***@host/db`).
pub fn redacted_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "postgres://(unparsable)".into();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    // A password may also come as a query parameter (libpq's `?password=`).
    let tail = match tail.split_once("password=") {
        Some((before, after)) => {
            let end = after.find('&').unwrap_or(after.len());
            format!("{before}password=***{}", &after[end..])
        }
        None => tail.to_owned(),
    };
    let url = format!("{scheme}://{authority}{tail}");
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url,
        },
        None => url,
    }
}

pub fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LLMTAP_DATA_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(d).join("llmtap");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".local/share/llmtap");
    }
    PathBuf::from("llmtap-data")
}

impl RawConfig {
    pub fn from_file(path: &Path) -> Result<RawConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text).map_err(|(key, message)| ConfigError::Parse {
            path: path.to_owned(),
            key,
            message,
        })
    }

    /// Parse TOML text; on error return (dotted key path, message).
    pub fn from_toml(text: &str) -> Result<RawConfig, (String, String)> {
        let de = toml::Deserializer::parse(text).map_err(|e| ("<document>".to_owned(), e.to_string()))?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            (key, e.into_inner().message().to_owned())
        })
    }

    /// Pure validation: no I/O besides nothing; CLI overrides are applied by the caller first.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let listen_text = self.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let listen: SocketAddr = listen_text
            .parse()
            .map_err(|e| invalid("listen", format!("{listen_text:?} is not HOST:PORT ({e})")))?;

        let cd = CaptureConfig::default();
        let capture = CaptureConfig {
            enabled: self.capture.enabled.unwrap_or(cd.enabled),
            max_body_bytes: self.capture.max_body_bytes.unwrap_or(cd.max_body_bytes),
            queue_capacity: self.capture.queue_capacity.unwrap_or(cd.queue_capacity),
            queue_bytes: self.capture.queue_bytes.unwrap_or(cd.queue_bytes),
            spill_bytes: self.capture.spill_bytes.unwrap_or(cd.spill_bytes),
            redact_headers: self.capture.redact_headers.unwrap_or(cd.redact_headers),
        };
        if capture.queue_capacity == 0 {
            return Err(invalid("capture.queue_capacity", "must be at least 1"));
        }
        // A spill smaller than one segment would refuse most exchanges while costing disk writes: a typo
        // (`spill_bytes = 1024` meant as KiB) is a startup error rather than a silent near-drop.
        if capture.spill_bytes != 0 && capture.spill_bytes < MIN_SPILL_BYTES {
            return Err(invalid(
                "capture.spill_bytes",
                format!("must be 0 (no spill) or at least {MIN_SPILL_BYTES} bytes (1 MiB)"),
            ));
        }
        // Names are compared by their letters and digits only: an entry without any would match nothing.
        if let Some(bad) = capture
            .redact_headers
            .iter()
            .find(|n| !n.bytes().any(|b| b.is_ascii_alphanumeric()))
        {
            return Err(invalid(
                "capture.redact_headers",
                format!("{bad:?} has no letter or digit, so it would redact nothing"),
            ));
        }
        let sd = StoreConfig::default();
        let store = StoreConfig {
            batch_size: self.store.batch_size.unwrap_or(sd.batch_size).max(1),
            retention_days: self.store.retention_days.unwrap_or(sd.retention_days),
            max_traces: self.store.max_traces.unwrap_or(sd.max_traces),
            shared: match self.store.url {
                Some(url) if is_postgres_url(&url) => Some(SharedStoreConfig {
                    url,
                    replica: self.store.replica.filter(|r| !r.is_empty()),
                }),
                Some(url) => {
                    return Err(invalid(
                        "store.url",
                        format!(
                            "{} is not a PostgreSQL URL (postgres://user@host:5432/db)",
                            redacted_url(&url)
                        ),
                    ));
                }
                None => None,
            },
        };
        let server_defaults = ServerConfig::default();
        let secs = |v: Option<u64>, default: Duration| v.map(Duration::from_secs).unwrap_or(default);
        let server = ServerConfig {
            header_read_timeout: secs(
                self.server.header_read_timeout_secs,
                server_defaults.header_read_timeout,
            ),
            idle_timeout: secs(self.server.idle_timeout_secs, server_defaults.idle_timeout),
            body_read_timeout: secs(self.server.body_read_timeout_secs, server_defaults.body_read_timeout),
            send_timeout: secs(self.server.send_timeout_secs, server_defaults.send_timeout),
            max_connections: self.server.max_connections.unwrap_or(server_defaults.max_connections),
            shutdown_grace: secs(self.server.shutdown_grace_secs, server_defaults.shutdown_grace),
        };
        if server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be at least 1"));
        }
        if [
            server.header_read_timeout,
            server.idle_timeout,
            server.body_read_timeout,
            server.send_timeout,
        ]
        .iter()
        .any(Duration::is_zero)
        {
            return Err(invalid(
                "server",
                "header_read_timeout_secs, idle_timeout_secs, body_read_timeout_secs and send_timeout_secs must be at least 1",
            ));
        }
        let derive = DeriveConfig {
            idle_timeout: self
                .derive
                .idle_timeout_secs
                .map(Duration::from_secs)
                .unwrap_or(DeriveConfig::default().idle_timeout),
        };

        let mut upstreams = BTreeMap::new();
        for (name, url, api) in builtin_upstreams() {
            upstreams.insert(
                name.to_owned(),
                UpstreamConfig {
                    name: name.into(),
                    url: parse_upstream_url(name, url)?,
                    api,
                    ca_file: None,
                },
            );
        }
        for (name, raw) in self.upstreams {
            let key = format!("upstreams.{name}");
            if name.is_empty()
                || ["s", "a", "metrics", "healthz"].contains(&name.as_str())
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            {
                return Err(invalid(
                    key,
                    "upstream names are path segments: letters, digits, '-', '_', '.'; 's', 'a', 'metrics' and 'healthz' are reserved",
                ));
            }
            let builtin_api = builtin_upstreams()
                .iter()
                .find(|(n, _, _)| *n == name)
                .map(|(_, _, a)| *a);
            let api = match (raw.api, builtin_api) {
                (Some(a), _) => a,
                (None, Some(a)) => a,
                (None, None) => ApiFamily::Openai,
            };
            let url = parse_upstream_url(&format!("{key}.url"), &raw.url)?;
            upstreams.insert(
                name.clone(),
                UpstreamConfig {
                    name: name.into(),
                    url,
                    api,
                    ca_file: raw.ca_file,
                },
            );
        }

        let mut otlp = Vec::new();
        let mut raw_otlp = self.export.otlp;
        if raw_otlp.is_empty()
            && env_var("OTEL_EXPORTER_OTLP_ENDPOINT")
                .or(env_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
                .is_some()
        {
            raw_otlp.push(RawOtlp {
                name: Some("env".into()),
                ..RawOtlp::default()
            });
        }
        for (i, raw) in raw_otlp.into_iter().enumerate() {
            otlp.push(otlp_config(i, raw)?);
        }
        let names: std::collections::BTreeSet<&str> = otlp.iter().map(|o| o.name.as_str()).collect();
        if names.len() != otlp.len() {
            return Err(invalid(
                "export.otlp",
                "destination names must be unique (they name the export cursors)",
            ));
        }
        let mut resource = vec![(
            "service.name".to_owned(),
            env_var("OTEL_SERVICE_NAME").unwrap_or_else(|| "llmtap".to_owned()),
        )];
        resource.push(("service.version".to_owned(), env!("CARGO_PKG_VERSION").to_owned()));
        for pair in env_var("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default().split(',') {
            if let Some((k, v)) = pair.split_once('=') {
                let k = k.trim();
                if k == "service.name" && env_var("OTEL_SERVICE_NAME").is_some() {
                    continue;
                }
                resource.retain(|(rk, _)| rk != k);
                resource.push((k.to_owned(), percent_decode_value(v.trim())));
            }
        }

        Ok(Config {
            listen,
            data_dir: self.data_dir.unwrap_or_else(default_data_dir),
            log_format: self.log_format.unwrap_or_default(),
            capture,
            store,
            derive,
            upstreams,
            otlp,
            api_listen: match self.api.listen.as_deref().unwrap_or(DEFAULT_API_LISTEN) {
                "off" => None,
                text => Some(
                    text.parse()
                        .map_err(|e| invalid("api.listen", format!("{text:?} is not HOST:PORT or \"off\" ({e})")))?,
                ),
            },
            api: api_config(&self.api)?,
            viewer_listen: match self.viewer.listen.as_deref().unwrap_or(DEFAULT_VIEWER_LISTEN) {
                "off" => None,
                text => Some(
                    text.parse()
                        .map_err(|e| invalid("viewer.listen", format!("{text:?} is not HOST:PORT or \"off\" ({e})")))?,
                ),
            },
            viewer_replay: self.viewer.replay.unwrap_or(false),
            resource,
            server,
            prices_file: self.cost.prices_file,
            forward: forward_config(self.forward)?,
            telemetry: telemetry_config(self.telemetry)?,
        })
    }
}

fn telemetry_config(raw: RawTelemetry) -> Result<TelemetryConfig, ConfigError> {
    let d = TelemetryConfig::default();
    let seconds = |key: &str, v: Option<u64>, default: Duration| match v {
        None => Ok(default),
        Some(0) => Err(invalid(key, "must be at least 1")),
        Some(s) => Ok(Duration::from_secs(s)),
    };
    let otlp_endpoint = match raw.otlp_endpoint {
        None => None,
        Some(url) => {
            let parsed: Option<http::Uri> = url.parse().ok();
            match parsed.as_ref().and_then(|u| u.scheme_str()) {
                Some("http" | "https") if parsed.as_ref().and_then(|u| u.host()).is_some() => Some(url),
                _ => {
                    return Err(invalid(
                        "telemetry.otlp_endpoint",
                        format!("{url:?} is not an http(s) URL (OTLP/gRPC, e.g. http://127.0.0.1:4317)"),
                    ));
                }
            }
        }
    };
    Ok(TelemetryConfig {
        otlp_endpoint,
        interval: seconds("telemetry.interval_secs", raw.interval_secs, d.interval)?,
        export_timeout: seconds("telemetry.timeout_secs", raw.timeout_secs, d.export_timeout)?,
    })
}

fn forward_config(raw: RawForward) -> Result<ForwardConfig, ConfigError> {
    let patterns = |key: &str, list: Option<Vec<String>>| -> Result<Vec<String>, ConfigError> {
        let list = list.unwrap_or_default();
        for p in &list {
            let ok = !p.is_empty()
                && p.split('.').all(|label| !label.is_empty())
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '*'));
            if !ok {
                return Err(invalid(
                    key,
                    format!("{p:?} is not a host name pattern (letters, digits, '-', '.', '*' within a label)"),
                ));
            }
        }
        Ok(list.into_iter().map(|p| p.to_ascii_lowercase()).collect())
    };
    let mut resolve = BTreeMap::new();
    for (host, addr) in raw.resolve {
        let parsed: SocketAddr = addr.parse().map_err(|e| {
            invalid(
                format!("forward.resolve.{host}"),
                format!("{addr:?} is not IP:PORT ({e})"),
            )
        })?;
        resolve.insert(host.to_ascii_lowercase(), parsed);
    }
    Ok(ForwardConfig {
        intercept: patterns("forward.intercept", raw.intercept)?,
        passthrough: patterns("forward.passthrough", raw.passthrough)?,
        ca_file: raw.ca_file,
        resolve,
    })
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn percent_decode_value(v: &str) -> String {
    percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned()
}

/// One OTLP destination: file values win, then the standard OTEL_EXPORTER_OTLP_* variables, then defaults.
fn otlp_config(i: usize, raw: RawOtlp) -> Result<OtlpConfig, ConfigError> {
    let key = format!("export.otlp[{i}]");
    let protocol_text = raw
        .protocol
        .or_else(|| env_var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
        .or_else(|| env_var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into());
    let protocol = match protocol_text.as_str() {
        "grpc" => OtlpProtocol::Grpc,
        "http/protobuf" => OtlpProtocol::HttpProtobuf,
        "http/json" => OtlpProtocol::HttpJson,
        other => {
            return Err(invalid(
                format!("{key}.protocol"),
                format!("{other:?}: use grpc, http/protobuf or http/json"),
            ));
        }
    };
    let endpoint = match (
        raw.endpoint,
        env_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        env_var("OTEL_EXPORTER_OTLP_ENDPOINT"),
    ) {
        // A per-signal URL, or one given in the file, is used as is (HTTP: unless it lacks the path).
        (Some(e), _, _) | (None, Some(e), _) => e,
        (None, None, Some(base)) if protocol != OtlpProtocol::Grpc => {
            format!("{}/v1/traces", base.trim_end_matches('/'))
        }
        (None, None, Some(base)) => base,
        (None, None, None) if protocol == OtlpProtocol::Grpc => "http://localhost:4317".into(),
        (None, None, None) => "http://localhost:4318/v1/traces".into(),
    };
    let endpoint = if protocol != OtlpProtocol::Grpc && !endpoint.trim_end_matches('/').ends_with("/v1/traces") {
        let parsed: Option<http::Uri> = endpoint.parse().ok();
        match parsed {
            Some(u) if u.path() == "/" || u.path().is_empty() => {
                format!("{}/v1/traces", endpoint.trim_end_matches('/'))
            }
            _ => endpoint,
        }
    } else {
        endpoint
    };
    endpoint
        .parse::<http::Uri>()
        .ok()
        .filter(|u| u.scheme().is_some() && u.authority().is_some())
        .ok_or_else(|| invalid(format!("{key}.endpoint"), format!("{endpoint:?} is not an http(s) URL")))?;
    let mut headers: Vec<(String, String)> = env_var("OTEL_EXPORTER_OTLP_HEADERS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), percent_decode_value(v.trim())))
        })
        .collect();
    for (k, v) in raw.headers {
        headers.retain(|(hk, _)| !hk.eq_ignore_ascii_case(&k));
        headers.push((k, v));
    }
    let compression = raw
        .compression
        .or_else(|| env_var("OTEL_EXPORTER_OTLP_COMPRESSION"))
        .unwrap_or_else(|| "gzip".into());
    let gzip = match compression.as_str() {
        "gzip" => true,
        "none" => false,
        other => {
            return Err(invalid(
                format!("{key}.compression"),
                format!("{other:?}: use gzip or none"),
            ));
        }
    };
    let timeout = raw
        .timeout_secs
        .map(Duration::from_secs)
        .or_else(|| {
            env_var("OTEL_EXPORTER_OTLP_TIMEOUT")
                .and_then(|ms| ms.parse().ok())
                .map(Duration::from_millis)
        })
        .unwrap_or(Duration::from_secs(10));
    Ok(OtlpConfig {
        name: raw.name.unwrap_or_else(|| format!("otlp{i}")),
        endpoint,
        protocol,
        headers,
        gzip,
        timeout,
        capture_content: raw.capture_content.unwrap_or(false),
        batch_size: raw.batch_size.unwrap_or(512).max(1),
        retry_initial: Duration::from_millis(raw.retry_initial_ms.unwrap_or(1000)),
        retry_max: Duration::from_millis(raw.retry_max_ms.unwrap_or(30_000)),
        metrics: raw.metrics.unwrap_or(true),
    })
}

fn parse_upstream_url(key: &str, text: &str) -> Result<http::Uri, ConfigError> {
    let trimmed = text.trim_end_matches('/');
    let uri: http::Uri = trimmed
        .parse()
        .map_err(|e| invalid(key, format!("{text:?} is not a URL ({e})")))?;
    match uri.scheme_str() {
        Some("https") | Some("http") => {}
        _ => return Err(invalid(key, format!("{text:?} must start with https:// or http://"))),
    }
    if uri.authority().is_none() {
        return Err(invalid(key, format!("{text:?} has no host")));
    }
    if uri.query().is_some() {
        return Err(invalid(key, "must not contain a query string"));
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_have_three_builtins_on_loopback() {
        let c = RawConfig::default().validate().unwrap();
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.upstreams.len(), 3);
        assert_eq!(c.upstreams["anthropic"].api, ApiFamily::Anthropic);
    }

    #[test]
    fn unknown_key_error_names_its_path() {
        let (key, msg) = RawConfig::from_toml("[upstreams.groq]\nurl = \"https://x\"\nurll = 1\n").unwrap_err();
        assert_eq!(key, "upstreams.groq.urll");
        assert!(msg.contains("urll"), "{msg}");
        let (key, _) = RawConfig::from_toml("[capture]\nmax_body_bytes = \"big\"\n").unwrap_err();
        assert_eq!(key, "capture.max_body_bytes");
    }

    #[test]
    fn custom_upstream_defaults_to_openai_api_and_overrides_builtin() {
        let raw = RawConfig::from_toml(
            "[upstreams.groq]\nurl = \"https://api.groq.com/openai/\"\n[upstreams.anthropic]\nurl = \"http://127.0.0.1:9\"\n",
        )
        .unwrap();
        let c = raw.validate().unwrap();
        assert_eq!(c.upstreams["groq"].api, ApiFamily::Openai);
        assert_eq!(c.upstreams["groq"].url.path(), "/openai");
        assert_eq!(c.upstreams["anthropic"].api, ApiFamily::Anthropic);
        assert_eq!(c.upstreams["anthropic"].url.scheme_str(), Some("http"));
    }

    #[test]
    fn cloud_route_families_parse_by_their_documented_names() {
        let mut text = String::new();
        for (name, api) in [
            ("bedrock", "bedrock"),
            ("mantle", "bedrock-mantle"),
            ("vertex", "vertex"),
            ("azure", "azure-openai"),
        ] {
            text.push_str(&format!(
                "[upstreams.{name}]\nurl = \"https://h.example\"\napi = \"{api}\"\n"
            ));
        }
        let c = RawConfig::from_toml(&text).unwrap().validate().unwrap();
        assert_eq!(c.upstreams["bedrock"].api, ApiFamily::Bedrock);
        assert_eq!(c.upstreams["mantle"].api, ApiFamily::BedrockMantle);
        assert_eq!(c.upstreams["vertex"].api, ApiFamily::Vertex);
        assert_eq!(c.upstreams["azure"].api, ApiFamily::AzureOpenai);
        for (family, name) in [
            (ApiFamily::BedrockMantle, "bedrock-mantle"),
            (ApiFamily::AzureOpenai, "azure-openai"),
        ] {
            assert_eq!(family.as_str(), name);
        }
        assert!(RawConfig::from_toml("[upstreams.x]\nurl = \"https://h\"\napi = \"bedrock_mantle\"\n").is_err());
    }

    #[test]
    fn bad_values_are_rejected_with_key() {
        let raw = RawConfig::from_toml("[upstreams.x]\nurl = \"ftp://h\"\n").unwrap();
        let err = raw.validate().unwrap_err().to_string();
        assert!(err.contains("upstreams.x.url"), "{err}");
        let raw = RawConfig::from_toml("listen = \"nope\"\n").unwrap();
        assert!(raw.validate().unwrap_err().to_string().contains("`listen`"));
    }

    #[test]
    fn spill_bytes_is_zero_or_at_least_a_mebibyte() {
        let spill = |toml: &str| {
            RawConfig::from_toml(toml)
                .unwrap()
                .validate()
                .map(|c| c.capture.spill_bytes)
        };
        assert_eq!(spill("").unwrap(), 1 << 30, "on by default");
        assert_eq!(spill("[capture]\nspill_bytes = 0\n").unwrap(), 0);
        assert_eq!(spill("[capture]\nspill_bytes = 1048576\n").unwrap(), 1 << 20);
        let err = spill("[capture]\nspill_bytes = 1024\n").unwrap_err().to_string();
        assert!(err.contains("capture.spill_bytes"), "{err}");
    }

    #[test]
    fn shipped_examples_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            if entry.path().extension().is_some_and(|e| e == "toml") {
                let raw = RawConfig::from_file(&entry.path()).unwrap();
                raw.validate().unwrap();
                n += 1;
            }
        }
        assert!(n >= 2);
    }
}
