//! `[telemetry]`: llmtap's own metrics over OTLP (they are always on `/metrics`; see `telemetry::sdk`).

use std::time::Duration;

use serde::{Deserialize, Deserializer, de::Error};

use super::serde_units::positive_secs;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/gRPC URL (`http://host:4317`) to push llmtap's metrics to; None: metrics only on `/metrics`.
    #[serde(deserialize_with = "otlp_grpc_url")]
    pub otlp_endpoint: Option<String>,
    /// Time between pushes.
    #[serde(rename = "interval_secs", deserialize_with = "positive_secs")]
    pub interval: Duration,
    /// Time one push may take.
    #[serde(rename = "timeout_secs", deserialize_with = "positive_secs")]
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

fn otlp_grpc_url<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let url = String::deserialize(d)?;
    let parsed: Option<http::Uri> = url.parse().ok();
    match parsed.as_ref().and_then(|u| u.scheme_str()) {
        Some("http" | "https") if parsed.as_ref().and_then(|u| u.host()).is_some() => Ok(Some(url)),
        _ => Err(D::Error::custom(format!(
            "{url:?} is not an http(s) URL (OTLP/gRPC, e.g. http://127.0.0.1:4317)"
        ))),
    }
}
