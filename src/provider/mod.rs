//! Provider adapters: one file per wire protocol, each pure and synchronous (no I/O, no clock, no logging),
//! so they are golden-tested directly and run on the pipeline thread.
//!
//! An adapter owns everything that differs between wire protocols, so that adding a provider is one adapter
//! file plus its `Api` (model) and `ApiFamily` (config) names: which request paths are its calls, how its
//! streams are framed, whether its tool call ids survive a client's echo, its OpenTelemetry provider name,
//! rebuilding the single JSON body a non-streamed call would have returned from a captured stream, and reading
//! a request/response pair into a [`NormalizedCall`]. Unknown fields are never rejected: reassembly carries
//! them along, normalization ignores what it does not need.

pub mod anthropic;
pub mod bedrock_converse;
pub mod cloud;
pub mod eventstream;
pub mod gemini;
pub mod openai_chat;
pub mod openai_responses;

use serde_json::{Map, Value};

use crate::capture::Api;
use crate::capture::sse::SseEvent;
use crate::config::ApiFamily;
use crate::model::call::{CallError, CallIds, NormalizedCall};
use crate::model::json::Json;

#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error("request body is not a JSON object")]
    RequestNotObject,
    #[error("stream holds no {0} events")]
    EmptyStream(&'static str),
}

/// What an adapter may know about the exchange besides the two bodies.
#[derive(Debug, Clone, Copy)]
pub struct CallContext<'a> {
    /// Upstream path (Gemini puts the model there).
    pub path: &'a str,
    pub status: Option<u16>,
}

pub trait ProviderAdapter: Send + Sync + 'static {
    fn api(&self) -> Api;
    /// The upstream family (`upstreams.*.api` in the config) whose traffic this adapter reads.
    fn family(&self) -> ApiFamily;
    /// Whether a request path (query removed) on an upstream of this family is one of this adapter's calls.
    fn matches_path(&self, path: &str) -> bool;
    /// Whether a response to `path` that is not SSE is a stream sent as one JSON array of chunks.
    fn streams_json_array(&self, _path: &str) -> bool {
        false
    }
    /// Whether the provider assigns tool call ids that clients echo verbatim.
    fn call_ids(&self) -> CallIds {
        CallIds::Stable
    }
    /// `gen_ai.provider.name` for calls through an upstream named `upstream`.
    fn otel_provider_name<'a>(&self, upstream: &'a str) -> &'a str;
    /// Rebuild the response JSON a non-streamed call would have returned. A mid-stream error is kept as a
    /// top-level `error` member next to whatever was generated before it.
    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError>;
    /// Read the call from a request that is a JSON object. `response` is Null when there was none (upstream
    /// unreachable). Both bodies are borrowed views (see `model::json`): the adapter copies only what the
    /// normalized call keeps.
    fn read_call(&self, ctx: &CallContext<'_>, request: &Json<'_>, response: &Json<'_>) -> NormalizedCall;

    /// Read the call; a request that is not a JSON object has nothing to normalize.
    fn normalize(
        &self,
        ctx: &CallContext<'_>,
        request: &Json<'_>,
        response: &Json<'_>,
    ) -> Result<NormalizedCall, AdapterError> {
        if !request.is_object() {
            return Err(AdapterError::RequestNotObject);
        }
        Ok(self.read_call(ctx, request, response))
    }
}

/// The closed set of adapters: registering a provider is one line here.
const ADAPTERS: [&dyn ProviderAdapter; 5] = [
    &openai_chat::OpenAiChat,
    &openai_responses::OpenAiResponses,
    &anthropic::AnthropicMessages,
    &gemini::Gemini,
    &bedrock_converse::BedrockConverse,
];

pub fn adapter_for(api: Api) -> Option<&'static dyn ProviderAdapter> {
    ADAPTERS.into_iter().find(|a| a.api() == api)
}

/// Which API a request on an upstream of `family` speaks, from its path (query removed); `Other` for the
/// family's endpoints llmtap forwards without reading (embeddings, model lists, token counting, ...). The cloud
/// families (Bedrock, Mantle, Vertex, Azure) carry several protocols each: `cloud` maps their paths.
pub fn detect_api(family: ApiFamily, path: &str) -> Api {
    if let Some(api) = cloud::detect(family, path) {
        return api;
    }
    ADAPTERS
        .into_iter()
        .find(|a| a.family() == family && a.matches_path(path))
        .map_or(Api::Other, |a| a.api())
}

/// `gen_ai.provider.name` of a call to `path` (as sent upstream) answered by `model`: the cloud's when the path is
/// a cloud route's or the model a Bedrock model id (Claude on Bedrock is `aws.bedrock`, not `anthropic`), else the
/// adapter's well-known name, else the upstream's own name.
pub fn otel_provider_name<'a>(api: Api, upstream: &'a str, path: &str, model: Option<&str>) -> &'a str {
    if api != Api::Other
        && let Some(cloud) = cloud::provider_of_path(path).or_else(|| model.and_then(cloud::provider_of_model))
    {
        return cloud;
    }
    adapter_for(api).map_or(upstream, |a| a.otel_provider_name(upstream))
}

/// Whether the API's tool call ids survive the client's echo (unknown APIs: assume they do).
pub fn call_ids(api: Api) -> CallIds {
    adapter_for(api).map_or(CallIds::Stable, |a| a.call_ids())
}

// === helpers shared by the adapters ===

/// Parse each event's data as JSON, skipping `[DONE]` sentinels, keep-alives and unparsable lines.
pub(crate) fn json_events(events: &[SseEvent]) -> impl Iterator<Item = (Option<&str>, Value)> {
    events.iter().filter_map(|e| {
        let data = e.data.trim();
        if data.is_empty() || data == "[DONE]" {
            return None;
        }
        serde_json::from_str::<Value>(data)
            .ok()
            .map(|v| (e.event.as_deref(), v))
    })
}

/// A string member of a JSON value being reassembled.
pub(crate) fn value_str<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// Append `add` to the string at `obj[key]` (creating it).
pub(crate) fn append_str(obj: &mut Map<String, Value>, key: &str, add: &str) {
    match obj.get_mut(key) {
        Some(Value::String(s)) => s.push_str(add),
        _ => {
            obj.insert(key.to_owned(), Value::String(add.to_owned()));
        }
    }
}

/// `{"error": {"type"|"code"|"status": .., "message": ..}}` → CallError; also a bare error object.
pub(crate) fn error_from_body(body: &Json<'_>, status: Option<u16>) -> Option<CallError> {
    let err = body.get("error").filter(|e| !e.is_null());
    match err {
        Some(e) => {
            let kind = ["type", "code", "status"]
                .iter()
                .find_map(|k| match e.get(k) {
                    Some(Json::String(s)) if !s.is_empty() => Some(s.to_string()),
                    Some(Json::Number(n)) => Some(n.to_string()),
                    _ => None,
                })
                .or_else(|| status.map(|s| format!("http_{s}")))
                .unwrap_or_else(|| "error".to_owned());
            let message = match e {
                Json::String(s) => s.to_string(),
                _ => e.str_at("message").map(str::to_owned).unwrap_or_else(|| e.to_string()),
            };
            Some(CallError { kind, message })
        }
        None => status.filter(|s| *s >= 400).map(|s| CallError {
            kind: format!("http_{s}"),
            message: body.as_str().map(str::to_owned).unwrap_or_else(|| body.to_string()),
        }),
    }
}

/// Join non-empty strings with blank lines; None if nothing remains.
pub(crate) fn join_nonempty(parts: impl IntoIterator<Item = String>, sep: &str) -> Option<String> {
    let v: Vec<String> = parts.into_iter().filter(|s| !s.is_empty()).collect();
    if v.is_empty() { None } else { Some(v.join(sep)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_detection() {
        assert_eq!(detect_api(ApiFamily::Openai, "/v1/chat/completions"), Api::OpenAiChat);
        assert_eq!(detect_api(ApiFamily::Openai, "/v1/responses"), Api::OpenAiResponses);
        assert_eq!(detect_api(ApiFamily::Openai, "/v1/embeddings"), Api::Other);
        assert_eq!(detect_api(ApiFamily::Anthropic, "/v1/messages"), Api::AnthropicMessages);
        assert_eq!(
            detect_api(ApiFamily::Anthropic, "/v1/messages/count_tokens"),
            Api::Other
        );
        assert_eq!(
            detect_api(
                ApiFamily::Gemini,
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
            ),
            Api::GeminiGenerateContent
        );
    }

    #[test]
    fn the_adapter_owns_its_provider_facts() {
        assert_eq!(call_ids(Api::GeminiGenerateContent), CallIds::ClientAssigned);
        assert_eq!(call_ids(Api::AnthropicMessages), CallIds::Stable);
        assert_eq!(
            otel_provider_name(Api::AnthropicMessages, "claude-proxy", "/v1/messages", None),
            "anthropic"
        );
        assert_eq!(
            otel_provider_name(Api::OpenAiChat, "openai", "/v1/chat/completions", None),
            "openai"
        );
        assert_eq!(
            otel_provider_name(Api::OpenAiChat, "groq", "/openai/v1/chat/completions", None),
            "groq"
        );
        assert_eq!(otel_provider_name(Api::Other, "x", "/model/m/invoke", None), "x");
        assert_eq!(
            otel_provider_name(
                Api::AnthropicMessages,
                "bedrock",
                "/model/anthropic.claude-x-v1:0/invoke",
                None
            ),
            "aws.bedrock"
        );
        assert_eq!(
            otel_provider_name(Api::OpenAiChat, "azure", "/openai/deployments/d/chat/completions", None),
            "azure.ai.openai"
        );
        // Bedrock Mantle's Anthropic path looks like a gateway's; its model ids name the cloud.
        assert_eq!(
            otel_provider_name(
                Api::AnthropicMessages,
                "mantle",
                "/anthropic/v1/messages",
                Some("anthropic.claude-opus-4-7")
            ),
            "aws.bedrock"
        );
        assert_eq!(
            otel_provider_name(
                Api::AnthropicMessages,
                "gw",
                "/anthropic/v1/messages",
                Some("claude-opus-4-7")
            ),
            "anthropic"
        );
        let gemini = adapter_for(Api::GeminiGenerateContent).unwrap();
        assert!(gemini.streams_json_array("/v1beta/models/g:streamGenerateContent"));
        assert!(!gemini.streams_json_array("/v1beta/models/g:generateContent"));
        for a in ADAPTERS {
            assert_eq!(adapter_for(a.api()).map(|b| b.api()), Some(a.api()));
        }
    }
}
