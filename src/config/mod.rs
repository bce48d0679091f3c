//! Configuration: one struct per TOML section, each deserialized as it is used (serde, `deny_unknown_fields`,
//! typed fields: durations, addresses, URLs), then [`Config::validate`] completes what depends on more than one
//! value or on the environment (built-in upstreams, the API token's sources, OTLP variables, resource
//! attributes) and runs the checks that span fields. A field is declared once, with its default in its
//! section's `Default` impl; `config/llmtap.example.toml` documents the same defaults. Errors carry the dotted
//! path of the offending key.

mod api;
mod capture;
mod export;
mod forward;
mod serde_units;
mod server;
mod store;
mod telemetry;
mod upstream;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use api::{ApiConfig, ApiToken, DEFAULT_API_LISTEN, DEFAULT_VIEWER_LISTEN, TokenDigest, ViewerConfig};
pub use capture::{CaptureConfig, MIN_SPILL_BYTES};
pub use export::{ExportConfig, OtlpConfig, OtlpProtocol};
pub use forward::ForwardConfig;
pub use server::ServerConfig;
pub use store::{SharedStoreUrl, StoreConfig, is_postgres_url, redacted_url};
pub use telemetry::TelemetryConfig;
pub use upstream::{ApiFamily, UpstreamConfig, builtin_upstreams};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";

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

/// The whole configuration. As read from a file (or `Default`) it is incomplete; [`Config::validate`] makes
/// it what the program uses.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// HOST:PORT of the proxy.
    #[serde(deserialize_with = "serde_units::host_port")]
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// How `serve` writes its log.
    pub log_format: LogFormat,
    pub capture: CaptureConfig,
    pub store: StoreConfig,
    pub derive: DeriveConfig,
    /// Keyed by route name (the first path segment); after validation the built-ins are here too.
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    pub export: ExportConfig,
    pub api: ApiConfig,
    pub viewer: ViewerConfig,
    pub server: ServerConfig,
    pub cost: CostConfig,
    pub forward: ForwardConfig,
    pub telemetry: TelemetryConfig,
    /// Resource attributes for exports (service.name and OTEL_RESOURCE_ATTRIBUTES): from the environment only.
    #[serde(skip)]
    pub resource: Vec<(String, String)>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: serde_units::addr(DEFAULT_LISTEN),
            data_dir: default_data_dir(),
            log_format: LogFormat::default(),
            capture: CaptureConfig::default(),
            store: StoreConfig::default(),
            derive: DeriveConfig::default(),
            upstreams: BTreeMap::new(),
            export: ExportConfig::default(),
            api: ApiConfig::default(),
            viewer: ViewerConfig::default(),
            server: ServerConfig::default(),
            cost: CostConfig::default(),
            forward: ForwardConfig::default(),
            telemetry: TelemetryConfig::default(),
            resource: Vec::new(),
        }
    }
}

/// `[derive]`: turning traces into steps.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeriveConfig {
    /// A trajectory with no call for this long is closed (its in-memory state dropped).
    #[serde(rename = "idle_timeout_secs", deserialize_with = "serde_units::secs")]
    pub idle_timeout: Duration,
}

impl Default for DeriveConfig {
    fn default() -> Self {
        DeriveConfig {
            idle_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// `[cost]`: prices.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostConfig {
    /// TOML file of price overrides (private, fine-tuned or negotiated prices); see `crate::cost`, read by
    /// [`Config::price_table`].
    pub prices_file: Option<PathBuf>,
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
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
    pub fn from_toml(text: &str) -> Result<Config, (String, String)> {
        let de = toml::Deserializer::parse(text).map_err(|e| ("<document>".to_owned(), e.to_string()))?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            (key, e.into_inner().message().to_owned())
        })
    }

    /// Completes and checks a configuration as read (CLI overrides are applied by the caller first). Reads
    /// the environment and `[api] token_file`, nothing else.
    pub fn validate(mut self) -> Result<Config, ConfigError> {
        self.capture.check()?;
        upstream::complete(&mut self.upstreams)?;
        self.export.complete()?;
        self.api.resolve_token()?;
        self.resource = resource_from_env();
        Ok(self)
    }

    /// The embedded price table with `[cost] prices_file`'s overrides. Built by the commands that price calls
    /// (`serve`, and `check-config` to validate the file), not while validating: parsing the embedded table
    /// would slow every `llmtap sessions` by a quarter of a second (debug build).
    pub fn price_table(&self) -> Result<crate::cost::CostTable, ConfigError> {
        match &self.cost.prices_file {
            Some(path) => crate::cost::CostTable::with_overrides(path),
            None => crate::cost::CostTable::embedded(),
        }
        .map_err(ConfigError::Prices)
    }
}

fn resource_from_env() -> Vec<(String, String)> {
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
    resource
}

/// `$LLMTAP_DATA_DIR`, else `$XDG_DATA_HOME/llmtap`, else `~/.local/share/llmtap`, else `./llmtap-data`.
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

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn percent_decode_value(v: &str) -> String {
    percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_have_three_builtins_on_loopback() {
        let c = Config::default().validate().unwrap();
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.api.listen.map(|a| a.to_string()).as_deref(), Some(DEFAULT_API_LISTEN));
        assert_eq!(
            c.viewer.listen.map(|a| a.to_string()).as_deref(),
            Some(DEFAULT_VIEWER_LISTEN)
        );
        assert_eq!(c.upstreams.len(), 3);
        assert_eq!(c.upstreams["anthropic"].api(), ApiFamily::Anthropic);
    }

    #[test]
    fn unknown_key_error_names_its_path() {
        let (key, msg) = Config::from_toml("[upstreams.groq]\nurl = \"https://x\"\nurll = 1\n").unwrap_err();
        assert_eq!(key, "upstreams.groq.urll");
        assert!(msg.contains("urll"), "{msg}");
        let (key, _) = Config::from_toml("[capture]\nmax_body_bytes = \"big\"\n").unwrap_err();
        assert_eq!(key, "capture.max_body_bytes");
    }

    #[test]
    fn custom_upstream_defaults_to_openai_api_and_overrides_builtin() {
        let raw = Config::from_toml(
            "[upstreams.groq]\nurl = \"https://api.groq.com/openai/\"\n[upstreams.anthropic]\nurl = \"http://127.0.0.1:9\"\n",
        )
        .unwrap();
        let c = raw.validate().unwrap();
        assert_eq!(c.upstreams["groq"].api(), ApiFamily::Openai);
        assert_eq!(c.upstreams["groq"].url.path(), "/openai");
        assert_eq!(c.upstreams["anthropic"].api(), ApiFamily::Anthropic);
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
        let c = Config::from_toml(&text).unwrap().validate().unwrap();
        assert_eq!(c.upstreams["bedrock"].api(), ApiFamily::Bedrock);
        assert_eq!(c.upstreams["mantle"].api(), ApiFamily::BedrockMantle);
        assert_eq!(c.upstreams["vertex"].api(), ApiFamily::Vertex);
        assert_eq!(c.upstreams["azure"].api(), ApiFamily::AzureOpenai);
        for (family, name) in [
            (ApiFamily::BedrockMantle, "bedrock-mantle"),
            (ApiFamily::AzureOpenai, "azure-openai"),
        ] {
            assert_eq!(family.as_str(), name);
        }
        assert!(Config::from_toml("[upstreams.x]\nurl = \"https://h\"\napi = \"bedrock_mantle\"\n").is_err());
    }

    #[test]
    fn bad_values_are_rejected_with_key() {
        let (key, message) = Config::from_toml("[upstreams.x]\nurl = \"ftp://h\"\n").unwrap_err();
        assert_eq!(key, "upstreams.x.url");
        assert!(message.contains("https://"), "{message}");
        let err = Config::from_toml("[upstreams.metrics]\nurl = \"https://h\"\n")
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("upstreams.metrics"), "{err}");
        for (toml, key) in [
            ("[server]\nidle_timeout_secs = 0\n", "server.idle_timeout_secs"),
            ("[server]\nworkers = 0\n", "server.workers"),
            ("[capture]\nqueue_capacity = 0\n", "capture.queue_capacity"),
            ("[api]\nlisten = \"x\"\n", "api.listen"),
            ("[store]\nurl = \"mysql://u:secret@h/db\"\n", "store.url"),
        ] {
            let (k, message) = Config::from_toml(toml).unwrap_err();
            assert_eq!(k, key, "{toml}");
            assert!(!message.contains("secret"), "{message}");
        }
        let (key, message) = Config::from_toml("listen = \"nope\"\n").unwrap_err();
        assert_eq!(key, "listen");
        assert!(message.contains("HOST:PORT"), "{message}");
    }

    #[test]
    fn spill_bytes_is_zero_or_at_least_a_mebibyte() {
        let spill = |toml: &str| {
            Config::from_toml(toml)
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
                let raw = Config::from_file(&entry.path()).unwrap();
                raw.validate().unwrap();
                n += 1;
            }
        }
        assert!(n >= 2);
    }
}
