//! `[upstreams.NAME]`: where `/<NAME>/...` goes, and which wire protocol family it speaks.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, de::Error};

use super::{ConfigError, invalid};

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

/// One upstream. `name` comes from the table's key, not from a field of its own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Shared: every captured exchange names its upstream (a refcount bump on the data path, not a copy).
    #[serde(skip, default = "unnamed")]
    pub name: std::sync::Arc<str>,
    /// Scheme + authority + optional path prefix, no trailing slash.
    #[serde(deserialize_with = "upstream_url")]
    pub url: http::Uri,
    /// None in the file: the built-in upstream's family for a built-in name, else OpenAI-compatible (resolved by
    /// [`complete`], so after validation it is always set; read it with [`UpstreamConfig::api`]).
    #[serde(rename = "api")]
    family: Option<ApiFamily>,
    pub ca_file: Option<PathBuf>,
}

fn unnamed() -> std::sync::Arc<str> {
    "".into()
}

impl UpstreamConfig {
    pub fn new(name: &str, url: http::Uri, api: ApiFamily) -> UpstreamConfig {
        UpstreamConfig {
            name: name.into(),
            url,
            family: Some(api),
            ca_file: None,
        }
    }

    pub fn api(&self) -> ApiFamily {
        self.family.unwrap_or(ApiFamily::Openai)
    }
}

/// The built-in upstreams: route `/<name>/...` to the provider's public API.
pub fn builtin_upstreams() -> [(&'static str, &'static str, ApiFamily); 3] {
    [
        ("openai", "https://api.openai.com", ApiFamily::Openai),
        ("anthropic", "https://api.anthropic.com", ApiFamily::Anthropic),
        ("gemini", "https://generativelanguage.googleapis.com", ApiFamily::Gemini),
    ]
}

/// Names each configured upstream, checks the names (they are path segments), resolves each family and adds
/// the built-ins the file does not override.
pub(super) fn complete(upstreams: &mut BTreeMap<String, UpstreamConfig>) -> Result<(), ConfigError> {
    for (name, upstream) in upstreams.iter_mut() {
        if name.is_empty()
            || ["s", "a", "metrics", "healthz"].contains(&name.as_str())
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            return Err(invalid(
                format!("upstreams.{name}"),
                "upstream names are path segments: letters, digits, '-', '_', '.'; 's', 'a', 'metrics' and 'healthz' are reserved",
            ));
        }
        upstream.name = name.as_str().into();
        let builtin = builtin_upstreams().into_iter().find(|(n, _, _)| n == name);
        upstream.family = upstream.family.or(builtin.map(|(_, _, family)| family));
    }
    for (name, url, family) in builtin_upstreams() {
        if !upstreams.contains_key(name) {
            let url = parse_url(url).map_err(|message| invalid(format!("upstreams.{name}.url"), message))?;
            upstreams.insert(name.to_owned(), UpstreamConfig::new(name, url, family));
        }
    }
    Ok(())
}

fn upstream_url<'de, D: Deserializer<'de>>(d: D) -> Result<http::Uri, D::Error> {
    parse_url(&String::deserialize(d)?).map_err(D::Error::custom)
}

fn parse_url(text: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = text
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("{text:?} is not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("https") | Some("http") => {}
        _ => return Err(format!("{text:?} must start with https:// or http://")),
    }
    if uri.authority().is_none() {
        return Err(format!("{text:?} has no host"));
    }
    if uri.query().is_some() {
        return Err("must not contain a query string".into());
    }
    Ok(uri)
}
