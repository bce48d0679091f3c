//! OpenAI Responses API.
//!
//! Stream: typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`, ..., `response.completed`). The terminal event carries the whole
//! response object, so reassembly takes it and only rebuilds from items and deltas when the stream was cut.
//! Conversation state may live server-side (`previous_response_id`, `conversation`): those are native ids.

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

pub struct OpenAiResponses;

impl ProviderAdapter for OpenAiResponses {
    fn api(&self) -> Api {
        Api::OpenAiResponses
    }

    fn family(&self) -> ApiFamily {
        ApiFamily::Openai
    }

    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/responses")
    }

    /// The OpenAI family also serves OpenAI-compatible servers: only the upstream named `openai` is OpenAI.
    fn otel_provider_name<'a>(&self, upstream: &'a str) -> &'a str {
        upstream
    }

    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError> {
        let mut base: Option<Value> = None;
        let mut terminal: Option<Value> = None;
        let mut items: Vec<Value> = Vec::new();
        let mut error: Option<Value> = None;
        let mut seen = false;
        for (event, ev) in json_events(events) {
            seen = true;
            let kind = value_str(&ev, "type").or(event).unwrap_or("");
            let oi = ev.get("output_index").and_then(Value::as_u64).map(|i| i as usize);
            match kind {
                "response.created" | "response.in_progress" => base = ev.get("response").cloned(),
                "response.completed" | "response.incomplete" | "response.failed" => {
                    terminal = ev.get("response").cloned()
                }
                "error" => error = Some(ev.get("error").cloned().unwrap_or(ev)),
                "response.output_item.added" | "response.output_item.done" => {
                    if let (Some(i), Some(item)) = (oi, ev.get("item")) {
                        put(&mut items, i, item.clone());
                    }
                }
                "response.content_part.added" | "response.content_part.done" => {
                    if let (Some(i), Some(part)) = (oi, ev.get("part")) {
                        let ci = ev.get("content_index").and_then(Value::as_u64).unwrap_or(0) as usize;
                        if let Some(content) = item_array(&mut items, i, "content") {
                            put(content, ci, part.clone());
                        }
                    }
                }
                "response.output_text.delta" | "response.refusal.delta" => {
                    if let (Some(i), Some(delta)) = (oi, value_str(&ev, "delta")) {
                        let ci = ev.get("content_index").and_then(Value::as_u64).unwrap_or(0) as usize;
                        let field = if kind == "response.refusal.delta" {
                            "refusal"
                        } else {
                            "text"
                        };
                        if let Some(content) = item_array(&mut items, i, "content") {
                            if content.len() <= ci {
                                let t = if field == "text" { "output_text" } else { "refusal" };
                                put(content, ci, json!({"type": t, field: ""}));
                            }
                            if let Some(Value::Object(p)) = content.get_mut(ci) {
                                append_str(p, field, delta);
                            }
                        }
                    }
                }
                "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
                    if let (Some(i), Some(delta)) = (oi, value_str(&ev, "delta")) {
                        let field = if kind.contains("custom") { "input" } else { "arguments" };
                        if let Some(Value::Object(item)) = items.get_mut(i) {
                            append_str(item, field, delta);
                        }
                    }
                }
                "response.reasoning_summary_text.delta" => {
                    if let (Some(i), Some(delta)) = (oi, value_str(&ev, "delta")) {
                        let si = ev.get("summary_index").and_then(Value::as_u64).unwrap_or(0) as usize;
                        if let Some(summary) = item_array(&mut items, i, "summary") {
                            if summary.len() <= si {
                                put(summary, si, json!({"type": "summary_text", "text": ""}));
                            }
                            if let Some(Value::Object(p)) = summary.get_mut(si) {
                                append_str(p, "text", delta);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        if !seen {
            return Err(AdapterError::EmptyStream("response"));
        }
        let mut out = match terminal.or(base) {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        let output_empty = out.get("output").and_then(Value::as_array).is_none_or(|a| a.is_empty());
        if output_empty && !items.is_empty() {
            out.insert(
                "output".into(),
                Value::Array(items.into_iter().filter(|i| !i.is_null()).collect()),
            );
        }
        if let Some(e) = error {
            out.insert("error".into(), e);
        }
        Ok(Value::Object(out))
    }

    fn read_call(&self, ctx: &CallContext<'_>, req: &Json<'_>, resp: &Json<'_>) -> NormalizedCall {
        let mut system: Vec<String> = req.owned_str("instructions").into_iter().collect();
        let mut messages: Vec<Message> = Vec::new();
        match req.get("input") {
            Some(Json::String(s)) => messages.push(Message {
                role: Role::User,
                parts: vec![Part::Text { text: s.to_string() }],
            }),
            Some(Json::Array(items)) => {
                for item in items {
                    read_input_item(item, &mut system, &mut messages);
                }
            }
            _ => {}
        }
        let tools = req
            .get("tools")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| {
                let name = t.owned_str("name").or_else(|| t.owned_str("type"))?;
                Some(ToolDef {
                    name,
                    description: t.owned_str("description"),
                    parameters: t.get("parameters").map(Json::to_value),
                })
            })
            .collect();

        let mut output = Output::default();
        for item in resp.get("output").and_then(Json::as_array).into_iter().flatten() {
            read_output_item(item, &mut output);
        }
        let status = resp.str_at("status");
        let error = error_from_body(resp, ctx.status);
        let provider_finish = match status {
            Some("incomplete") => resp
                .get("incomplete_details")
                .and_then(|d| d.owned_str("reason"))
                .or(Some("incomplete".into())),
            Some(s) => Some(s.to_owned()),
            None => None,
        };
        let finish_reason = if error.is_some() || status == Some("failed") {
            Some(FinishReason::Error)
        } else if !output.tool_calls.is_empty() {
            Some(FinishReason::ToolCall)
        } else {
            match provider_finish.as_deref() {
                Some("completed") => Some(FinishReason::Stop),
                Some("max_output_tokens") => Some(FinishReason::Length),
                Some("content_filter") => Some(FinishReason::ContentFilter),
                Some(_) => Some(FinishReason::Other),
                None => None,
            }
        };
        let usage = resp.get("usage").filter(|u| u.is_object());
        NormalizedCall {
            model_requested: req
                .owned_str("model")
                .or_else(|| super::cloud::model_from_path(ctx.path)),
            model_response: resp.owned_str("model"),
            response_id: resp.owned_str("id"),
            system: join_nonempty(system, "\n\n"),
            messages,
            tools,
            output,
            finish_reason,
            provider_finish_reason: provider_finish,
            usage: usage.map(|u| Usage {
                input: u64_at(u, &["input_tokens"]).unwrap_or(0),
                output: u64_at(u, &["output_tokens"]).unwrap_or(0),
                cache_read: u64_at(u, &["input_tokens_details", "cached_tokens"]),
                // Newer models report prompt-cache writes (billed above plain input); like cached_tokens, a
                // part of input_tokens.
                cache_write: u64_at(u, &["input_tokens_details", "cache_write_tokens"]),
                reasoning: u64_at(u, &["output_tokens_details", "reasoning_tokens"]),
            }),
            raw_usage: usage.map(Json::to_value),
            error,
            max_output_tokens: req.get("max_output_tokens").and_then(Json::as_u64),
            previous_response_id: req.owned_str("previous_response_id"),
            conversation_id: match req.get("conversation") {
                Some(Json::String(s)) => Some(s.to_string()),
                Some(c) => c.owned_str("id"),
                None => None,
            },
            client_session: None,
        }
    }
}

fn put(items: &mut Vec<Value>, i: usize, v: Value) {
    while items.len() <= i {
        items.push(Value::Null);
    }
    items[i] = v;
}

/// The array `items[i][key]`, created if missing.
fn item_array<'a>(items: &'a mut [Value], i: usize, key: &str) -> Option<&'a mut Vec<Value>> {
    let Some(Value::Object(item)) = items.get_mut(i) else {
        return None;
    };
    let arr = item.entry(key).or_insert_with(|| json!([]));
    if !arr.is_array() {
        *arr = json!([]);
    }
    arr.as_array_mut()
}

/// Push `part` onto the last message if it has `role`, else start a new message.
fn push_part(messages: &mut Vec<Message>, role: Role, part: Part) {
    match messages.last_mut() {
        Some(m) if m.role == role => m.parts.push(part),
        _ => messages.push(Message {
            role,
            parts: vec![part],
        }),
    }
}

fn text_parts(content: &Json<'_>) -> Vec<Part> {
    match content {
        Json::String(s) => vec![Part::Text { text: s.to_string() }],
        Json::Array(parts) => parts
            .iter()
            .filter_map(|p| match p.str_at("type") {
                Some("input_text") | Some("output_text") | Some("text") => Some(Part::Text {
                    text: p.str_at("text").unwrap_or("").to_owned(),
                }),
                Some("input_image") => Some(Part::Media {
                    reference: p
                        .str_at("image_url")
                        .or(p.str_at("file_id"))
                        .map(media_reference)
                        .unwrap_or_default(),
                    media_type: Some("image".into()),
                }),
                Some("input_file") => Some(Part::Media {
                    reference: p
                        .str_at("file_id")
                        .map(str::to_owned)
                        .or_else(|| p.str_at("file_data").map(media_reference))
                        .unwrap_or_default(),
                    media_type: Some("file".into()),
                }),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn summary_text(item: &Json<'_>) -> String {
    item.get("summary")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.str_at("text"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn tool_call_of(item: &Json<'_>) -> ToolCall {
    let raw = item
        .get("arguments")
        .or_else(|| item.get("input"))
        .unwrap_or(&Json::Null);
    ToolCall {
        id: item
            .owned_str("call_id")
            .or_else(|| item.owned_str("id"))
            .unwrap_or_default(),
        name: item.owned_str("name").unwrap_or_default(),
        arguments: parse_arguments(raw),
    }
}

fn read_input_item(item: &Json<'_>, system: &mut Vec<String>, messages: &mut Vec<Message>) {
    let kind = item.str_at("type").unwrap_or("message");
    match kind {
        "message" => match item.str_at("role").unwrap_or("user") {
            "system" | "developer" => system.push(content_to_text(item.field("content"))),
            "assistant" => {
                for p in text_parts(item.field("content")) {
                    push_part(messages, Role::Assistant, p);
                }
            }
            _ => messages.push(Message {
                role: Role::User,
                parts: text_parts(item.field("content")),
            }),
        },
        "function_call" | "custom_tool_call" => {
            push_part(messages, Role::Assistant, Part::ToolCall(tool_call_of(item)))
        }
        "reasoning" => {
            let text = summary_text(item);
            if !text.is_empty() {
                push_part(messages, Role::Assistant, Part::Reasoning { text });
            }
        }
        "function_call_output" | "custom_tool_call_output" => push_part(
            messages,
            Role::Tool,
            Part::ToolResult {
                call_id: item.owned_str("call_id").unwrap_or_default(),
                name: None,
                content: content_to_text(item.field("output")),
                is_error: false,
            },
        ),
        _ => {}
    }
}

fn read_output_item(item: &Json<'_>, out: &mut Output) {
    match item.str_at("type").unwrap_or("") {
        "message" => {
            for p in item.get("content").and_then(Json::as_array).into_iter().flatten() {
                match p.str_at("type") {
                    Some("output_text") => {
                        let t = out.text.get_or_insert_with(String::new);
                        t.push_str(p.str_at("text").unwrap_or(""));
                    }
                    Some("refusal") => out.refusal = p.owned_str("refusal"),
                    _ => {}
                }
            }
        }
        "reasoning" => {
            let text = summary_text(item);
            if text.is_empty() {
                out.reasoning_redacted |= item.get("encrypted_content").is_some_and(|e| !e.is_null());
            } else {
                let r = out.reasoning.get_or_insert_with(String::new);
                if !r.is_empty() {
                    r.push('\n');
                }
                r.push_str(&text);
            }
        }
        "function_call" | "custom_tool_call" => out.tool_calls.push(tool_call_of(item)),
        _ => {}
    }
}
