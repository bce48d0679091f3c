//! AWS Bedrock Converse (`POST /model/{modelId}/converse`, `/converse-stream`): Bedrock's own model-neutral
//! protocol (camelCase, content blocks keyed by kind: `{"text"}`, `{"toolUse"}`, `{"toolResult"}`,
//! `{"reasoningContent"}`, `{"image"}`, `{"document"}`, `{"cachePoint"}`).
//!
//! Stream: AWS event-stream messages (decoded by `eventstream`) named by `:event-type`: `messageStart`
//! (role), `contentBlockStart` (a tool call's id and name), `contentBlockDelta` (`text`, `toolUse.input` JSON
//! text fragments, `reasoningContent.text` / `.signature` / `.redactedContent`), `contentBlockStop`,
//! `messageStop` (stop reason), `metadata` (usage, metrics); exceptions arrive as `error` events. Payloads carry a
//! `p` member of random padding, ignored. Usage: `inputTokens` excludes cache reads and writes (as Anthropic's);
//! we add them. The model is the path's (the body names none).

use serde_json::{Map, Value, json};

use super::{AdapterError, CallContext, ProviderAdapter, error_from_body, join_nonempty, json_events, value_str};
use crate::capture::Api;
use crate::capture::sse::SseEvent;
use crate::config::ApiFamily;
use crate::model::call::{
    FinishReason, Message, NormalizedCall, Output, Part, Role, ToolCall, ToolDef, media_reference, parse_arguments,
};
use crate::model::json::Json;
use crate::model::usage::{Usage, u64_at};

pub struct BedrockConverse;

impl ProviderAdapter for BedrockConverse {
    fn api(&self) -> Api {
        Api::BedrockConverse
    }

    fn family(&self) -> ApiFamily {
        ApiFamily::Bedrock
    }

    fn matches_path(&self, path: &str) -> bool {
        super::cloud::detect(ApiFamily::Bedrock, path) == Some(Api::BedrockConverse)
    }

    fn otel_provider_name<'a>(&self, _upstream: &'a str) -> &'a str {
        "aws.bedrock"
    }

    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError> {
        let mut role = None;
        let mut blocks: Vec<Map<String, Value>> = Vec::new();
        let mut tool_input: Vec<Option<String>> = Vec::new();
        let mut top = Map::new();
        let mut seen = false;
        for (event, ev) in json_events(events) {
            let Some(kind) = event else { continue };
            seen = true;
            let index = ev.get("contentBlockIndex").and_then(Value::as_u64).map(|i| i as usize);
            match kind {
                "messageStart" => role = ev.get("role").cloned(),
                "contentBlockStart" => {
                    let (Some(i), Some(Value::Object(start))) = (index, ev.get("start")) else {
                        continue;
                    };
                    let i = block_at(&mut blocks, &mut tool_input, i);
                    for (k, v) in start {
                        blocks[i].insert(k.clone(), v.clone());
                    }
                }
                "contentBlockDelta" => {
                    let (Some(i), Some(delta)) = (index, ev.get("delta")) else {
                        continue;
                    };
                    let i = block_at(&mut blocks, &mut tool_input, i);
                    let block = &mut blocks[i];
                    if let Some(text) = value_str(delta, "text") {
                        super::append_str(block, "text", text);
                    } else if let Some(tool) = delta.get("toolUse") {
                        tool_input[i]
                            .get_or_insert_with(String::new)
                            .push_str(value_str(tool, "input").unwrap_or(""));
                    } else if let Some(Value::Object(r)) = delta.get("reasoningContent") {
                        let reasoning = block.entry("reasoningContent").or_insert_with(|| json!({}));
                        if let Value::Object(reasoning) = reasoning {
                            if let Some(text) = r.get("text").and_then(Value::as_str) {
                                let rt = reasoning.entry("reasoningText").or_insert_with(|| json!({}));
                                if let Value::Object(rt) = rt {
                                    super::append_str(rt, "text", text);
                                }
                            }
                            if let Some(sig) = r.get("signature") {
                                let rt = reasoning.entry("reasoningText").or_insert_with(|| json!({}));
                                if let Value::Object(rt) = rt {
                                    rt.insert("signature".into(), sig.clone());
                                }
                            }
                            if let Some(redacted) = r.get("redactedContent") {
                                reasoning.insert("redactedContent".into(), redacted.clone());
                            }
                        }
                    }
                }
                "contentBlockStop" => {
                    if let Some(i) = index {
                        finish_tool_input(&mut blocks, &mut tool_input, i);
                    }
                }
                "messageStop" => {
                    for k in ["stopReason", "additionalModelResponseFields"] {
                        if let Some(v) = ev.get(k) {
                            top.insert(k.into(), v.clone());
                        }
                    }
                }
                "metadata" => {
                    for k in ["usage", "metrics", "trace", "performanceConfig"] {
                        if let Some(v) = ev.get(k) {
                            top.insert(k.into(), v.clone());
                        }
                    }
                }
                "error" => {
                    top.insert("error".into(), ev.get("error").cloned().unwrap_or(ev));
                }
                _ => {}
            }
        }
        if !seen {
            return Err(AdapterError::EmptyStream("ConverseStream"));
        }
        for i in 0..blocks.len() {
            finish_tool_input(&mut blocks, &mut tool_input, i);
        }
        // The non-streamed response's shape: output.message first, then stopReason, usage, metrics.
        let content: Vec<Value> = blocks
            .into_iter()
            .filter(|b| !b.is_empty())
            .map(Value::Object)
            .collect();
        let mut out = Map::new();
        if role.is_some() || !content.is_empty() {
            out.insert(
                "output".into(),
                json!({"message": {"role": role.unwrap_or_else(|| json!("assistant")), "content": content}}),
            );
        }
        out.extend(top);
        Ok(Value::Object(out))
    }

    fn read_call(&self, ctx: &CallContext<'_>, req: &Json<'_>, resp: &Json<'_>) -> NormalizedCall {
        let system = req
            .get("system")
            .and_then(Json::as_array)
            .map(|blocks| join_nonempty(blocks.iter().filter_map(|b| b.owned_str("text")), "\n\n"))
            .unwrap_or_default();
        let messages = req
            .get("messages")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .map(|m| Message {
                role: match m.str_at("role") {
                    Some("assistant") => Role::Assistant,
                    _ => Role::User,
                },
                parts: blocks_to_parts(m.field("content")),
            })
            .collect();
        let tools = req
            .get("toolConfig")
            .and_then(|t| t.get("tools"))
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| {
                let spec = t.get("toolSpec")?;
                Some(ToolDef {
                    name: spec.owned_str("name")?,
                    description: spec.owned_str("description"),
                    parameters: spec
                        .get("inputSchema")
                        .map(|s| s.get("json").unwrap_or(s))
                        .map(Json::to_value),
                })
            })
            .collect();

        let mut output = Output::default();
        let mut reasoning = Vec::new();
        let content = resp
            .get("output")
            .and_then(|o| o.get("message"))
            .and_then(|m| m.get("content"));
        for part in content.map(blocks_to_parts).unwrap_or_default() {
            match part {
                Part::Text { text } => output.text.get_or_insert_with(String::new).push_str(&text),
                Part::Reasoning { text } => reasoning.push(text),
                Part::ToolCall(call) => output.tool_calls.push(call),
                _ => {}
            }
        }
        output.reasoning_redacted = content.and_then(Json::as_array).into_iter().flatten().any(|b| {
            b.get("reasoningContent")
                .is_some_and(|r| r.get("redactedContent").is_some())
        });
        output.reasoning = join_nonempty(reasoning, "\n");
        let provider_finish = resp.owned_str("stopReason");
        let error = error_from_body(resp, ctx.status).or_else(|| bare_message_error(resp, ctx.status));
        let finish_reason = if error.is_some() {
            Some(FinishReason::Error)
        } else {
            provider_finish.as_deref().map(|r| match r {
                "end_turn" | "stop_sequence" => FinishReason::Stop,
                "max_tokens" | "model_context_window_exceeded" => FinishReason::Length,
                "tool_use" => FinishReason::ToolCall,
                "guardrail_intervened" | "content_filtered" => FinishReason::ContentFilter,
                _ => FinishReason::Other,
            })
        };
        let usage = resp.get("usage").filter(|u| u.is_object());
        NormalizedCall {
            model_requested: super::cloud::model_from_path(ctx.path),
            model_response: None,
            response_id: None,
            system,
            messages,
            tools,
            output,
            finish_reason,
            provider_finish_reason: provider_finish,
            usage: usage.map(usage_of),
            raw_usage: usage.map(Json::to_value),
            error,
            max_output_tokens: req
                .get("inferenceConfig")
                .and_then(|c| c.get("maxTokens"))
                .and_then(Json::as_u64),
            previous_response_id: None,
            conversation_id: None,
            client_session: None,
        }
    }
}

/// Bedrock's error bodies are `{"message": "..."}` (the kind is in the `x-amzn-ErrorType` header, which the
/// adapter does not see): with an error status, the message is the error.
fn bare_message_error(resp: &Json<'_>, status: Option<u16>) -> Option<crate::model::call::CallError> {
    let status = status.filter(|s| *s >= 400)?;
    let message = resp.str_at("message").or_else(|| resp.str_at("Message"))?;
    Some(crate::model::call::CallError {
        kind: format!("http_{status}"),
        message: message.to_owned(),
    })
}

/// Grow the block list to hold index `i` (text blocks start with their first delta, not a start event).
fn block_at(blocks: &mut Vec<Map<String, Value>>, tool_input: &mut Vec<Option<String>>, i: usize) -> usize {
    while blocks.len() <= i {
        blocks.push(Map::new());
        tool_input.push(None);
    }
    i
}

fn finish_tool_input(blocks: &mut [Map<String, Value>], tool_input: &mut [Option<String>], i: usize) {
    let Some(text) = tool_input.get_mut(i).and_then(Option::take) else {
        return;
    };
    let Some(block) = blocks.get_mut(i) else { return };
    let input = if text.trim().is_empty() {
        json!({})
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    let tool = block.entry("toolUse").or_insert_with(|| json!({}));
    if let Value::Object(tool) = tool {
        tool.insert("input".into(), input);
    }
}

fn tool_call_of(t: &Json<'_>) -> ToolCall {
    ToolCall {
        id: t.owned_str("toolUseId").unwrap_or_default(),
        name: t.owned_str("name").unwrap_or_default(),
        arguments: parse_arguments(t.field("input")),
    }
}

/// Converse content blocks → parts. Cache points and guard content are dropped.
fn blocks_to_parts(content: &Json<'_>) -> Vec<Part> {
    let Some(blocks) = content.as_array() else {
        return Vec::new();
    };
    blocks
        .iter()
        .filter_map(|b| {
            if let Some(text) = b.str_at("text") {
                Some(Part::Text { text: text.to_owned() })
            } else if let Some(t) = b.get("toolUse") {
                Some(Part::ToolCall(tool_call_of(t)))
            } else if let Some(r) = b.get("toolResult") {
                Some(Part::ToolResult {
                    call_id: r.owned_str("toolUseId").unwrap_or_default(),
                    name: None,
                    content: tool_result_text(r.field("content")),
                    is_error: r.str_at("status") == Some("error"),
                })
            } else if let Some(r) = b.get("reasoningContent") {
                let text = r.get("reasoningText").and_then(|t| t.str_at("text"))?;
                Some(Part::Reasoning { text: text.to_owned() })
            } else {
                let (kind, media) = ["image", "document", "video"]
                    .into_iter()
                    .find_map(|k| b.get(k).map(|m| (k, m)))?;
                let source = media.get("source");
                let reference = source
                    .and_then(|s| {
                        s.str_at("bytes")
                            .or_else(|| s.get("s3Location").and_then(|l| l.str_at("uri")))
                    })
                    .map(media_reference)
                    .unwrap_or_default();
                Some(Part::Media {
                    reference,
                    media_type: Some(match media.str_at("format") {
                        Some(format) => format!("{kind}/{format}"),
                        None => kind.to_owned(),
                    }),
                })
            }
        })
        .collect()
}

/// A tool result's content blocks: `{"text"}` verbatim, `{"json"}` as compact JSON, joined by lines.
fn tool_result_text(content: &Json<'_>) -> String {
    let Some(items) = content.as_array() else {
        return crate::model::call::content_to_text(content);
    };
    let mut out = Vec::new();
    for item in items {
        if let Some(t) = item.str_at("text") {
            out.push(t.to_owned());
        } else if let Some(j) = item.get("json") {
            out.push(j.to_string());
        } else {
            out.push(item.to_string());
        }
    }
    out.join("\n")
}

fn usage_of(u: &Json<'_>) -> Usage {
    let base = u64_at(u, &["inputTokens"]).unwrap_or(0);
    let cache_read = u64_at(u, &["cacheReadInputTokens"]);
    let cache_write = u64_at(u, &["cacheWriteInputTokens"]);
    Usage {
        input: base + cache_read.unwrap_or(0) + cache_write.unwrap_or(0),
        output: u64_at(u, &["outputTokens"]).unwrap_or(0),
        cache_read,
        cache_write,
        reasoning: None,
    }
}
