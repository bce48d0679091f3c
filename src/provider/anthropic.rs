//! Anthropic Messages.
//!
//! Stream: `message_start` (the message with empty content and the input-side usage), `content_block_start` /
//! `content_block_delta` (`text_delta`, `input_json_delta`, `thinking_delta`, `signature_delta`,
//! `citations_delta`) / `content_block_stop`, `message_delta` (stop reason, cumulative output usage),
//! `message_stop`, `ping`, and `error` mid-stream. Usage: input excludes cache reads and writes; we add them.

use serde_json::{Map, Value, json};

use super::{
    AdapterError, CallContext, ProviderAdapter, append_str, error_from_body, join_nonempty, json_events, value_str,
};
use crate::capture::Api;
use crate::capture::sse::SseEvent;
use crate::config::ApiFamily;
use crate::model::call::{
    FinishReason, Message, NormalizedCall, Output, Part, Role, ToolCall, ToolDef, content_to_text, media_reference,
    parse_arguments,
};
use crate::model::json::Json;
use crate::model::usage::{Usage, u64_at};

pub struct AnthropicMessages;

/// Claude Code talking to the first-party host (forward mode) puts a per-request attestation block first in
/// `system` (`x-anthropic-billing-header: ...; cch=<changes every call>;`). It is not prompt text, and keeping it
/// would give every call of one agent another system prompt (read as a handoff to another agent), so the
/// system prompt leaves it out; the trace keeps the request's bytes.
const BILLING_BLOCK_PREFIX: &str = "x-anthropic-billing-header:";

fn system_text(system: &Json<'_>) -> String {
    let Some(blocks) = system.as_array() else {
        return content_to_text(system);
    };
    let mut out = String::new();
    let mut first = true;
    for b in blocks {
        let text = match (b.str_at("text"), b) {
            (Some(t), _) if t.starts_with(BILLING_BLOCK_PREFIX) => continue,
            (Some(t), _) => t.to_owned(),
            (None, Json::String(s)) => s.to_string(),
            (None, other) => other.to_string(),
        };
        if !first {
            out.push('\n');
        }
        first = false;
        out.push_str(&text);
    }
    out
}

impl ProviderAdapter for AnthropicMessages {
    fn api(&self) -> Api {
        Api::AnthropicMessages
    }

    fn family(&self) -> ApiFamily {
        ApiFamily::Anthropic
    }

    /// `/v1/messages`, not `/v1/messages/count_tokens` or the batch endpoints.
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/messages")
    }

    fn otel_provider_name<'a>(&self, _upstream: &'a str) -> &'a str {
        "anthropic"
    }

    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError> {
        let mut message: Option<Map<String, Value>> = None;
        let mut blocks: Vec<Value> = Vec::new();
        // Tool input arrives as JSON text fragments; parsed when the block stops (or at the end if cut).
        let mut partial_json: Vec<Option<String>> = Vec::new();
        let mut error: Option<Value> = None;
        for (event, ev) in json_events(events) {
            let kind = value_str(&ev, "type").or(event).unwrap_or("");
            let index = ev.get("index").and_then(Value::as_u64).map(|i| i as usize);
            match kind {
                "message_start" => {
                    if let Some(Value::Object(m)) = ev.get("message") {
                        message = Some(m.clone());
                    }
                }
                "content_block_start" => {
                    if let (Some(i), Some(block)) = (index, ev.get("content_block")) {
                        while blocks.len() <= i {
                            blocks.push(Value::Null);
                            partial_json.push(None);
                        }
                        blocks[i] = block.clone();
                    }
                }
                "content_block_delta" => {
                    let (Some(i), Some(delta)) = (index, ev.get("delta")) else {
                        continue;
                    };
                    let Some(Value::Object(block)) = blocks.get_mut(i) else {
                        continue;
                    };
                    match value_str(delta, "type").unwrap_or("") {
                        "text_delta" => append_str(block, "text", value_str(delta, "text").unwrap_or("")),
                        "thinking_delta" => append_str(block, "thinking", value_str(delta, "thinking").unwrap_or("")),
                        "signature_delta" => {
                            block.insert(
                                "signature".into(),
                                delta.get("signature").cloned().unwrap_or(Value::Null),
                            );
                        }
                        "input_json_delta" => {
                            let slot = &mut partial_json[i];
                            slot.get_or_insert_with(String::new)
                                .push_str(value_str(delta, "partial_json").unwrap_or(""));
                        }
                        "citations_delta" => {
                            if let Some(c) = delta.get("citation") {
                                let arr = block.entry("citations").or_insert_with(|| json!([]));
                                if let Value::Array(a) = arr {
                                    a.push(c.clone());
                                } else {
                                    *arr = json!([c]);
                                }
                            }
                        }
                        _ => {
                            // Unknown delta kind: keep its fields (last value wins) rather than lose them.
                            if let Value::Object(d) = delta {
                                for (k, v) in d.iter().filter(|(k, _)| k.as_str() != "type") {
                                    block.insert(k.clone(), v.clone());
                                }
                            }
                        }
                    }
                }
                "content_block_stop" => {
                    if let Some(i) = index {
                        finish_tool_input(&mut blocks, &mut partial_json, i);
                    }
                }
                "message_delta" => {
                    let m = message.get_or_insert_with(Map::new);
                    if let Some(Value::Object(d)) = ev.get("delta") {
                        for (k, v) in d {
                            m.insert(k.clone(), v.clone());
                        }
                    }
                    // message_delta usage is cumulative: its fields replace those from message_start.
                    if let Some(Value::Object(u)) = ev.get("usage") {
                        let usage = m.entry("usage").or_insert_with(|| json!({}));
                        if let Value::Object(usage) = usage {
                            for (k, v) in u.iter().filter(|(_, v)| !v.is_null()) {
                                usage.insert(k.clone(), v.clone());
                            }
                        }
                    }
                }
                "error" => error = Some(ev.get("error").cloned().unwrap_or(ev)),
                _ => {}
            }
        }
        for i in 0..blocks.len() {
            finish_tool_input(&mut blocks, &mut partial_json, i);
        }
        let Some(mut m) = message else {
            return match error {
                Some(e) => Ok(json!({"type": "error", "error": e})),
                None => Err(AdapterError::EmptyStream("message_start")),
            };
        };
        m.insert(
            "content".into(),
            Value::Array(blocks.into_iter().filter(|b| !b.is_null()).collect()),
        );
        if let Some(e) = error {
            m.insert("error".into(), e);
        }
        Ok(Value::Object(m))
    }

    fn read_call(&self, ctx: &CallContext<'_>, req: &Json<'_>, resp: &Json<'_>) -> NormalizedCall {
        let system = match req.get("system") {
            Some(s) => Some(system_text(s)).filter(|s| !s.is_empty()),
            None => None,
        };
        let mut messages = Vec::new();
        for m in req.get("messages").and_then(Json::as_array).into_iter().flatten() {
            let role = match m.str_at("role") {
                Some("assistant") => Role::Assistant,
                Some("system") => Role::System,
                _ => Role::User,
            };
            let parts = blocks_to_parts(m.field("content"));
            messages.push(Message { role, parts });
        }
        let tools = req
            .get("tools")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| {
                Some(ToolDef {
                    name: t.owned_str("name").or_else(|| t.owned_str("type"))?,
                    description: t.owned_str("description"),
                    parameters: t.get("input_schema").map(Json::to_value),
                })
            })
            .collect();

        let mut output = Output::default();
        let mut reasoning = Vec::new();
        for b in resp.get("content").and_then(Json::as_array).into_iter().flatten() {
            match b.str_at("type").unwrap_or("") {
                "text" => output
                    .text
                    .get_or_insert_with(String::new)
                    .push_str(b.str_at("text").unwrap_or("")),
                "thinking" => reasoning.push(b.str_at("thinking").unwrap_or("").to_owned()),
                "redacted_thinking" => output.reasoning_redacted = true,
                "tool_use" | "server_tool_use" | "mcp_tool_use" => output.tool_calls.push(tool_call_of(b)),
                _ => {}
            }
        }
        output.reasoning = join_nonempty(reasoning, "\n");
        let provider_finish = resp.owned_str("stop_reason");
        let error = error_from_body(resp, ctx.status);
        let finish_reason = if error.is_some() {
            Some(FinishReason::Error)
        } else {
            provider_finish.as_deref().map(|r| match r {
                "end_turn" | "stop_sequence" => FinishReason::Stop,
                "max_tokens" | "model_context_window_exceeded" => FinishReason::Length,
                "tool_use" => FinishReason::ToolCall,
                "refusal" => FinishReason::ContentFilter,
                _ => FinishReason::Other,
            })
        };
        let usage = resp.get("usage").filter(|u| u.is_object());
        NormalizedCall {
            model_requested: req
                .owned_str("model")
                .or_else(|| super::cloud::model_from_path(ctx.path)),
            model_response: resp.owned_str("model"),
            response_id: resp.owned_str("id"),
            system,
            messages,
            tools,
            output,
            finish_reason,
            provider_finish_reason: provider_finish,
            usage: usage.map(usage_of),
            raw_usage: usage.map(Json::to_value),
            error,
            max_output_tokens: req.get("max_tokens").and_then(Json::as_u64),
            previous_response_id: None,
            conversation_id: None,
            client_session: req
                .get("metadata")
                .and_then(|m| m.str_at("user_id"))
                .and_then(claude_code_session),
        }
    }
}

/// The session id in Claude Code's `metadata.user_id`: a JSON string `{"device_id":…,"session_id":"<uuid>"}`
/// (2.1.78 and later) or `user_<hash>_account_<id>_session_<uuid>` (earlier versions).
pub fn claude_code_session(user_id: &str) -> Option<String> {
    let id = if user_id.trim_start().starts_with('{') {
        serde_json::from_str::<serde_json::Value>(user_id)
            .ok()?
            .get("session_id")?
            .as_str()?
            .to_owned()
    } else {
        user_id.rsplit_once("_session_")?.1.to_owned()
    };
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_owned())
}

fn finish_tool_input(blocks: &mut [Value], partial_json: &mut [Option<String>], i: usize) {
    let Some(text) = partial_json.get_mut(i).and_then(Option::take) else {
        return;
    };
    if let Some(Value::Object(block)) = blocks.get_mut(i) {
        let parsed = if text.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        block.insert("input".into(), parsed);
    }
}

fn tool_call_of(b: &Json<'_>) -> ToolCall {
    ToolCall {
        id: b.owned_str("id").unwrap_or_default(),
        name: b.owned_str("name").unwrap_or_default(),
        arguments: parse_arguments(b.field("input")),
    }
}

/// Anthropic content (string or blocks) → parts. Cache-control markers and signatures are dropped.
fn blocks_to_parts(content: &Json<'_>) -> Vec<Part> {
    match content {
        Json::String(s) => vec![Part::Text { text: s.to_string() }],
        Json::Array(blocks) => blocks
            .iter()
            .filter_map(|b| match b.str_at("type").unwrap_or("") {
                "text" => Some(Part::Text {
                    text: b.str_at("text").unwrap_or("").to_owned(),
                }),
                "thinking" => Some(Part::Reasoning {
                    text: b.str_at("thinking").unwrap_or("").to_owned(),
                }),
                "tool_use" | "server_tool_use" | "mcp_tool_use" => Some(Part::ToolCall(tool_call_of(b))),
                "tool_result" | "mcp_tool_result" => Some(Part::ToolResult {
                    call_id: b.owned_str("tool_use_id").unwrap_or_default(),
                    name: None,
                    content: content_to_text(b.field("content")),
                    is_error: b.get("is_error").and_then(Json::as_bool).unwrap_or(false),
                }),
                kind @ ("image" | "document") => {
                    let src = b.get("source");
                    let reference = src
                        .and_then(|s| s.str_at("url").or(s.str_at("file_id")).or(s.str_at("data")))
                        .map(media_reference)
                        .unwrap_or_default();
                    Some(Part::Media {
                        reference,
                        media_type: src.and_then(|s| s.owned_str("media_type")).or(Some(kind.to_owned())),
                    })
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn usage_of(u: &Json<'_>) -> Usage {
    let base = u64_at(u, &["input_tokens"]).unwrap_or(0);
    let cache_read = u64_at(u, &["cache_read_input_tokens"]);
    let cache_write = u64_at(u, &["cache_creation_input_tokens"]);
    Usage {
        input: base + cache_read.unwrap_or(0) + cache_write.unwrap_or(0),
        output: u64_at(u, &["output_tokens"]).unwrap_or(0),
        cache_read,
        cache_write,
        reasoning: None,
    }
}

#[cfg(test)]
mod tests {
    use super::{claude_code_session, system_text};
    use crate::model::json::Json;

    #[test]
    fn the_per_request_billing_block_is_not_part_of_the_system_prompt() {
        let text = |cch: &str| {
            let raw = format!(
                r#"[{{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197.066; cch={cch};"}},
                   {{"type":"text","text":"You are Claude Code."}},{{"type":"text","text":"Be brief."}}]"#
            );
            system_text(&Json::parse(&raw).unwrap())
        };
        assert_eq!(text("87acd"), "You are Claude Code.\nBe brief.");
        assert_eq!(text("87acd"), text("93919"), "one agent's calls keep one system prompt");
        assert_eq!(system_text(&Json::parse(r#""Plain.""#).unwrap()), "Plain.");
    }

    #[test]
    fn claude_code_session_from_both_user_id_shapes() {
        let json = r#"{"device_id":"abc","account_uuid":"","session_id":"54c1eb09-bc4c"}"#;
        assert_eq!(claude_code_session(json).as_deref(), Some("54c1eb09-bc4c"));
        let legacy = "user_9f2e_account__session_57a121ec-f78c";
        assert_eq!(claude_code_session(legacy).as_deref(), Some("57a121ec-f78c"));
        assert_eq!(claude_code_session("user_9f2e"), None);
        assert_eq!(claude_code_session(r#"{"device_id":"abc"}"#), None);
        assert_eq!(claude_code_session("user_x_session_ "), None);
    }
}
