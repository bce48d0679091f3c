//! `[[export.otlp]]`: OpenTelemetry destinations. A value in the file wins, then the standard
//! `OTEL_EXPORTER_OTLP_*` variables (read as the defaults), then llmtap's own defaults. With no destination in
//! the file, an `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` in the environment makes one named `env`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, de::Error};

use super::serde_units::{at_least_one, millis, secs};
use super::{ConfigError, env_var, invalid, percent_decode_value};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExportConfig {
    pub otlp: Vec<OtlpConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum OtlpProtocol {
    #[serde(rename = "grpc")]
    Grpc,
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
    #[serde(rename = "http/json")]
    HttpJson,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OtlpConfig {
    /// Names the destination's cursor in the store: keep it stable across restarts (default `otlp<N>`).
    pub name: String,
    /// For gRPC the server URL; for HTTP the full traces URL (…/v1/traces). Empty in the file: from the
    /// environment, else the protocol's local default (filled in by validation).
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    /// Sent with every export; the environment's `OTEL_EXPORTER_OTLP_HEADERS` are added under names the file
    /// does not set.
    pub headers: BTreeMap<String, String>,
    /// `compression = "gzip" | "none"`.
    #[serde(rename = "compression", deserialize_with = "gzip_or_none")]
    pub gzip: bool,
    #[serde(rename = "timeout_secs", deserialize_with = "secs")]
    pub timeout: Duration,
    /// Put prompts, outputs, system instructions and tool definitions on spans (opt-in: they hold user data).
    pub capture_content: bool,
    #[serde(deserialize_with = "at_least_one")]
    pub batch_size: usize,
    #[serde(rename = "retry_initial_ms", deserialize_with = "millis")]
    pub retry_initial: Duration,
    #[serde(rename = "retry_max_ms", deserialize_with = "millis")]
    pub retry_max: Duration,
    /// Also send the GenAI client metrics (token usage, operation duration, time to first chunk).
    pub metrics: bool,
}

impl Default for OtlpConfig {
    /// The environment's values where it has valid ones (checked by [`ExportConfig::complete`]).
    fn default() -> Self {
        OtlpConfig {
            name: String::new(),
            endpoint: String::new(),
            protocol: env_protocol()
                .and_then(Result::ok)
                .unwrap_or(OtlpProtocol::HttpProtobuf),
            headers: BTreeMap::new(),
            gzip: env_var("OTEL_EXPORTER_OTLP_COMPRESSION").is_none_or(|c| c != "none"),
            timeout: env_var("OTEL_EXPORTER_OTLP_TIMEOUT")
                .and_then(|ms| ms.parse().ok())
                .map_or(Duration::from_secs(10), Duration::from_millis),
            capture_content: false,
            batch_size: 512,
            retry_initial: Duration::from_millis(1000),
            retry_max: Duration::from_millis(30_000),
            metrics: true,
        }
    }
}

fn env_protocol() -> Option<Result<OtlpProtocol, String>> {
    let text = env_var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env_var("OTEL_EXPORTER_OTLP_PROTOCOL"))?;
    Some(match text.as_str() {
        "grpc" => Ok(OtlpProtocol::Grpc),
        "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
        "http/json" => Ok(OtlpProtocol::HttpJson),
        other => Err(format!("{other:?}: use grpc, http/protobuf or http/json")),
    })
}

fn gzip_or_none<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match String::deserialize(d)?.as_str() {
        "gzip" => Ok(true),
        "none" => Ok(false),
        other => Err(D::Error::custom(format!("{other:?}: use gzip or none"))),
    }
}

impl ExportConfig {
    /// Adds the environment's destination when the file has none, and settles each destination's name,
    /// endpoint and headers.
    pub(super) fn complete(&mut self) -> Result<(), ConfigError> {
        if self.otlp.is_empty()
            && env_var("OTEL_EXPORTER_OTLP_ENDPOINT")
                .or(env_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
                .is_some()
        {
            self.otlp.push(OtlpConfig {
                name: "env".into(),
                ..OtlpConfig::default()
            });
        }
        if !self.otlp.is_empty() {
            if let Some(Err(message)) = env_protocol() {
                return Err(invalid("OTEL_EXPORTER_OTLP_PROTOCOL", message));
            }
            if let Some(c) = env_var("OTEL_EXPORTER_OTLP_COMPRESSION").filter(|c| c != "gzip" && c != "none") {
                return Err(invalid(
                    "OTEL_EXPORTER_OTLP_COMPRESSION",
                    format!("{c:?}: use gzip or none"),
                ));
            }
        }
        for (i, o) in self.otlp.iter_mut().enumerate() {
            o.complete(i)?;
        }
        let names: std::collections::BTreeSet<&str> = self.otlp.iter().map(|o| o.name.as_str()).collect();
        if names.len() != self.otlp.len() {
            return Err(invalid(
                "export.otlp",
                "destination names must be unique (they name the export cursors)",
            ));
        }
        Ok(())
    }
}

impl OtlpConfig {
    fn complete(&mut self, i: usize) -> Result<(), ConfigError> {
        let key = format!("export.otlp[{i}]");
        if self.name.is_empty() {
            self.name = format!("otlp{i}");
        }
        let grpc = self.protocol == OtlpProtocol::Grpc;
        let endpoint = match (
            std::mem::take(&mut self.endpoint),
            env_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            env_var("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            // A per-signal URL, or one given in the file, is used as is (HTTP: unless it lacks the path).
            (e, _, _) if !e.is_empty() => e,
            (_, Some(e), _) => e,
            (_, None, Some(base)) if !grpc => format!("{}/v1/traces", base.trim_end_matches('/')),
            (_, None, Some(base)) => base,
            (_, None, None) if grpc => "http://localhost:4317".into(),
            (_, None, None) => "http://localhost:4318/v1/traces".into(),
        };
        let parsed: Option<http::Uri> = endpoint.parse().ok();
        if !parsed
            .as_ref()
            .is_some_and(|u| u.scheme().is_some() && u.authority().is_some())
        {
            return Err(invalid(
                format!("{key}.endpoint"),
                format!("{endpoint:?} is not an http(s) URL"),
            ));
        }
        let bare = parsed.is_some_and(|u| u.path() == "/" || u.path().is_empty());
        self.endpoint = if !grpc && bare && !endpoint.trim_end_matches('/').ends_with("/v1/traces") {
            format!("{}/v1/traces", endpoint.trim_end_matches('/'))
        } else {
            endpoint
        };
        for pair in env_var("OTEL_EXPORTER_OTLP_HEADERS").unwrap_or_default().split(',') {
            if let Some((k, v)) = pair.split_once('=') {
                let k = k.trim();
                if !self.headers.keys().any(|hk| hk.eq_ignore_ascii_case(k)) {
                    self.headers.insert(k.to_owned(), percent_decode_value(v.trim()));
                }
            }
        }
        Ok(())
    }
}
