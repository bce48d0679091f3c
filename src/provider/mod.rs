//! Provider adapters: one file per wire protocol, each pure and synchronous (no I/O, no clock, no logging),
//! so they are golden-tested directly and run on the pipeline thread.
//!
//! An adapter does two things: rebuild the single JSON body a non-streamed call would have returned from a
//! captured stream, and read a request/response pair into a [`NormalizedCall`]. Unknown fields are never
//! rejected: reassembly carries them along, normalization ignores what it does not need.

pub mod anthropic;
pub mod gemini;
pub mod openai_chat;
pub mod openai_responses;

use serde_json::{Map, Value};

use crate::capture::Api;
use crate::capture::sse::SseEvent;
use crate::model::call::{CallError, Message, NormalizedCall};

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
    /// Rebuild the response JSON a non-streamed call would have returned. A mid-stream error is kept as a
    /// top-level `error` member next to whatever was generated before it.
    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError>;
    /// Read the call. `response` is Null when there was none (upstream unreachable).
    fn normalize(
        &self,
        ctx: &CallContext<'_>,
        request: &Value,
        response: &Value,
    ) -> Result<NormalizedCall, AdapterError>;
    /// Adapters whose conversation items read independently of each other expose it, so the pipeline can
    /// memoize items across calls: an agent resends its whole history every call, and in steady state only
    /// the last item or two are new.
    fn item_wise(&self) -> Option<&dyn ItemWise> {
        None
    }
}

/// What one conversation item contributes to a normalized call.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemOut {
    /// System/developer text (OpenAI puts it among the messages).
    System(String),
    Message(Message),
}

/// A protocol whose request carries the conversation as one array of self-contained items.
pub trait ItemWise: Sync {
    /// The request member holding the conversation array.
    fn conversation_key(&self) -> &'static str;
    /// One item, read on its own (the result must depend on nothing else).
    fn normalize_item(&self, item: &Value) -> ItemOut;
    /// The call from the request's other members, the items' contributions in order, and the response.
    fn normalize_rest(
        &self,
        ctx: &CallContext<'_>,
        request: &Value,
        items: Vec<ItemOut>,
        response: &Value,
    ) -> Result<NormalizedCall, AdapterError>;
}

/// `normalize` for an item-wise adapter: the same two halves the memoized path uses, so both stay one code.
pub(crate) fn normalize_item_wise(
    adapter: &dyn ItemWise,
    ctx: &CallContext<'_>,
    request: &Value,
    response: &Value,
) -> Result<NormalizedCall, AdapterError> {
    if !request.is_object() {
        return Err(AdapterError::RequestNotObject);
    }
    let items = request
        .get(adapter.conversation_key())
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|item| adapter.normalize_item(item))
        .collect();
    adapter.normalize_rest(ctx, request, items, response)
}

/// Split item contributions into system texts and messages.
pub(crate) fn split_items(items: Vec<ItemOut>) -> (Vec<String>, Vec<Message>) {
    let mut system = Vec::new();
    let mut messages = Vec::with_capacity(items.len());
    for item in items {
        match item {
            ItemOut::System(s) => system.push(s),
            ItemOut::Message(m) => messages.push(m),
        }
    }
    (system, messages)
}

/// The closed set of adapters.
pub fn adapter_for(api: Api) -> Option<&'static dyn ProviderAdapter> {
    match api {
        Api::OpenAiChat => Some(&openai_chat::OpenAiChat),
        Api::OpenAiResponses => Some(&openai_responses::OpenAiResponses),
        Api::AnthropicMessages => Some(&anthropic::AnthropicMessages),
        Api::GeminiGenerateContent => Some(&gemini::Gemini),
        Api::Other => None,
    }
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

pub(crate) fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

pub(crate) fn owned_str(v: &Value, key: &str) -> Option<String> {
    str_at(v, key).map(str::to_owned)
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
pub(crate) fn error_from_body(body: &Value, status: Option<u16>) -> Option<CallError> {
    let err = body.get("error").filter(|e| !e.is_null());
    match err {
        Some(e) => {
            let kind = ["type", "code", "status"]
                .iter()
                .find_map(|k| match e.get(*k) {
                    Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
                    Some(Value::Number(n)) => Some(n.to_string()),
                    _ => None,
                })
                .or_else(|| status.map(|s| format!("http_{s}")))
                .unwrap_or_else(|| "error".to_owned());
            let message = match e {
                Value::String(s) => s.clone(),
                _ => str_at(e, "message").map(str::to_owned).unwrap_or_else(|| e.to_string()),
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
