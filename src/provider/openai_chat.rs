//! OpenAI Chat Completions (and every OpenAI-compatible server: Groq, OpenRouter, vLLM, Ollama, DeepSeek...).
//!
//! Stream: `data: {chat.completion.chunk}` lines ending with `data: [DONE]`; usage arrives in a final chunk with
//! empty `choices` when `stream_options.include_usage` is set. Compatible servers add fields (`reasoning`,
//! `reasoning_content`, `channel`, `x_groq`) and may send `event: error` mid-stream.

use serde_json::{Map, Value, json};

use super::{AdapterError, CallContext, ProviderAdapter, append_str, error_from_body, join_nonempty, json_events};
use crate::capture::Api;
use crate::capture::sse::SseEvent;
use crate::config::ApiFamily;
use crate::model::call::{
    FinishReason, Message, NormalizedCall, Output, Part, Role, ToolCall, ToolDef, content_to_text, media_reference,
    parse_arguments,
};
use crate::model::json::Json;
use crate::model::usage::{Usage, u64_at};

pub struct OpenAiChat;

/// A choice being reassembled: the choice object without `delta`, its message, its tool calls by index.
type ChoiceAcc = (Map<String, Value>, Map<String, Value>, Vec<Map<String, Value>>);

/// Delta fields that are text produced token by token: concatenated. Every other field: last value wins.
const TEXT_DELTA_FIELDS: &[&str] = &["content", "reasoning_content", "reasoning", "refusal"];

impl ProviderAdapter for OpenAiChat {
    fn api(&self) -> Api {
        Api::OpenAiChat
    }

    fn family(&self) -> ApiFamily {
        ApiFamily::Openai
    }

    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/chat/completions")
    }

    /// The OpenAI family also serves OpenAI-compatible servers: only the upstream named `openai` is OpenAI.
    fn otel_provider_name<'a>(&self, upstream: &'a str) -> &'a str {
        upstream
    }

    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError> {
        let mut top = Map::new();
        // Choices by index, each: (choice object without delta, message object, tool calls by index).
        let mut choices: Vec<ChoiceAcc> = Vec::new();
        let mut seen = false;
        for (event, chunk) in json_events(events) {
            if event == Some("error") || chunk.get("error").is_some_and(|e| !e.is_null()) {
                let err = chunk.get("error").cloned().unwrap_or(chunk);
                top.insert("error".into(), err);
                continue;
            }
            seen = true;
            if let Value::Object(obj) = &chunk {
                for (k, v) in obj {
                    match k.as_str() {
                        "choices" => {}
                        "object" => {}
                        // Random per-chunk padding against length side channels: stream-only, meaningless merged.
                        "obfuscation" => {}
                        "usage" if v.is_null() => {}
                        _ if v.is_null() && top.contains_key(k) => {}
                        _ => {
                            top.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            for c in chunk.get("choices").and_then(Value::as_array).into_iter().flatten() {
                let idx = c.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                while choices.len() <= idx {
                    choices.push((Map::new(), Map::new(), Vec::new()));
                }
                let (choice, message, tool_calls) = &mut choices[idx];
                if let Value::Object(cobj) = c {
                    for (k, v) in cobj {
                        match k.as_str() {
                            "delta" => {}
                            "logprobs" => merge_logprobs(choice, v),
                            _ if v.is_null() && choice.contains_key(k) => {}
                            _ => {
                                choice.insert(k.clone(), v.clone());
                            }
                        }
                    }
                }
                let Some(Value::Object(delta)) = c.get("delta") else {
                    continue;
                };
                for (k, v) in delta {
                    match (k.as_str(), v) {
                        ("tool_calls", Value::Array(calls)) => merge_tool_call_deltas(tool_calls, calls),
                        (field, Value::String(s)) if TEXT_DELTA_FIELDS.contains(&field) => {
                            append_str(message, field, s)
                        }
                        (_, Value::Null) if message.contains_key(k) => {}
                        _ => {
                            message.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
        }
        if !seen && !top.contains_key("error") {
            return Err(AdapterError::EmptyStream("chat.completion.chunk"));
        }
        if seen {
            top.insert("object".into(), json!("chat.completion"));
        }
        let choices: Vec<Value> = choices
            .into_iter()
            .map(|(mut choice, mut message, tool_calls)| {
                message.entry("role").or_insert(json!("assistant"));
                message.entry("content").or_insert(Value::Null);
                if !tool_calls.is_empty() {
                    message.insert(
                        "tool_calls".into(),
                        Value::Array(tool_calls.into_iter().map(Value::Object).collect()),
                    );
                }
                choice.insert("message".into(), Value::Object(message));
                choice.entry("finish_reason").or_insert(Value::Null);
                Value::Object(choice)
            })
            .collect();
        if seen {
            top.insert("choices".into(), Value::Array(choices));
        }
        // The key order of a non-streamed body: id, object, created, model, choices, usage, then the rest.
        let mut ordered = Map::new();
        for k in ["id", "object", "created", "model", "choices", "usage"] {
            if let Some(v) = top.remove(k) {
                ordered.insert(k.to_owned(), v);
            }
        }
        ordered.extend(top);
        Ok(Value::Object(ordered))
    }

    fn read_call(&self, ctx: &CallContext<'_>, req: &Json<'_>, resp: &Json<'_>) -> NormalizedCall {
        let mut system = Vec::new();
        let mut messages = Vec::new();
        for m in req.get("messages").and_then(Json::as_array).into_iter().flatten() {
            match m.str_at("role").unwrap_or("user") {
                "system" | "developer" => system.push(content_to_text(m.field("content"))),
                "assistant" => messages.push(assistant_message(m)),
                "tool" | "function" => messages.push(Message {
                    role: Role::Tool,
                    parts: vec![Part::ToolResult {
                        call_id: m
                            .owned_str("tool_call_id")
                            .or_else(|| m.owned_str("name"))
                            .unwrap_or_default(),
                        name: m.owned_str("name"),
                        content: content_to_text(m.field("content")),
                        is_error: false,
                    }],
                }),
                _ => messages.push(Message {
                    role: Role::User,
                    parts: user_parts(m.field("content")),
                }),
            }
        }
        let tools = req
            .get("tools")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| t.get("function"))
            .chain(req.get("functions").and_then(Json::as_array).into_iter().flatten())
            .filter_map(|f| {
                Some(ToolDef {
                    name: f.owned_str("name")?,
                    description: f.owned_str("description"),
                    parameters: f.get("parameters").map(Json::to_value),
                })
            })
            .collect();

        let choice = resp.get("choices").and_then(|c| c.at(0));
        let message = choice.and_then(|c| c.get("message"));
        let output = message.map(output_of).unwrap_or_default();
        let provider_finish = choice.and_then(|c| c.owned_str("finish_reason"));
        let error = error_from_body(resp, ctx.status);
        let finish_reason = provider_finish
            .as_deref()
            .map(map_finish_reason)
            .or(error.as_ref().map(|_| FinishReason::Error));
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
            usage: usage.map(usage_of),
            raw_usage: usage.map(Json::to_value),
            error,
            max_output_tokens: req
                .get("max_completion_tokens")
                .and_then(Json::as_u64)
                .or_else(|| req.get("max_tokens").and_then(Json::as_u64)),
            previous_response_id: None,
            conversation_id: None,
            client_session: None,
        }
    }
}

fn merge_logprobs(choice: &mut Map<String, Value>, v: &Value) {
    let Some(obj) = v.as_object() else { return };
    let target = choice.entry("logprobs").or_insert_with(|| json!({}));
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, items) in obj {
            if let Value::Array(items) = items {
                match t.get_mut(k) {
                    Some(Value::Array(existing)) => existing.extend(items.iter().cloned()),
                    _ => {
                        t.insert(k.clone(), Value::Array(items.clone()));
                    }
                }
            }
        }
    }
}

/// Tool call deltas are keyed by `index`; `id`, `type` and `function.name` arrive once, `arguments` in pieces.
fn merge_tool_call_deltas(calls: &mut Vec<Map<String, Value>>, deltas: &[Value]) {
    for d in deltas {
        let idx = d.get("index").and_then(Value::as_u64).unwrap_or(calls.len() as u64) as usize;
        while calls.len() <= idx {
            calls.push(Map::new());
        }
        let call = &mut calls[idx];
        let Some(dobj) = d.as_object() else { continue };
        for (k, v) in dobj {
            match (k.as_str(), v) {
                ("index", _) => {}
                ("function", Value::Object(f)) => {
                    let func = call.entry("function").or_insert_with(|| json!({}));
                    if let Value::Object(func) = func {
                        for (fk, fv) in f {
                            match (fk.as_str(), fv) {
                                ("arguments", Value::String(s)) => append_str(func, "arguments", s),
                                (_, Value::Null) => {}
                                _ => {
                                    func.insert(fk.clone(), fv.clone());
                                }
                            }
                        }
                    }
                }
                (_, Value::Null) => {}
                _ => {
                    call.insert(k.clone(), v.clone());
                }
            }
        }
        call.entry("type").or_insert(json!("function"));
    }
}

fn user_parts(content: &Json<'_>) -> Vec<Part> {
    match content {
        Json::Array(parts) => parts
            .iter()
            .filter_map(|p| match p.str_at("type") {
                Some("text") | Some("input_text") => Some(Part::Text {
                    text: p.str_at("text").unwrap_or("").to_owned(),
                }),
                Some("image_url") => {
                    let url = p
                        .get("image_url")
                        .and_then(|i| i.get("url").or(Some(i)))
                        .and_then(Json::as_str)
                        .unwrap_or("");
                    Some(Part::Media {
                        reference: media_reference(url),
                        media_type: Some("image".into()),
                    })
                }
                Some("input_audio") => {
                    let data = p
                        .get("input_audio")
                        .and_then(|a| a.get("data"))
                        .and_then(Json::as_str)
                        .unwrap_or("");
                    Some(Part::Media {
                        reference: media_reference(data),
                        media_type: Some("audio".into()),
                    })
                }
                Some("file") => Some(Part::Media {
                    reference: p
                        .get("file")
                        .and_then(|f| {
                            f.str_at("file_id")
                                .map(str::to_owned)
                                .or_else(|| f.str_at("file_data").map(media_reference))
                        })
                        .unwrap_or_default(),
                    media_type: Some("file".into()),
                }),
                _ => None,
            })
            .collect(),
        Json::Null => Vec::new(),
        other => vec![Part::Text {
            text: content_to_text(other),
        }],
    }
}

fn tool_calls_of(message: &Json<'_>) -> Vec<ToolCall> {
    let mut calls: Vec<ToolCall> = message
        .get("tool_calls")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let f = c.get("function")?;
            Some(ToolCall {
                id: c.owned_str("id").unwrap_or_default(),
                name: f.owned_str("name").unwrap_or_default(),
                arguments: parse_arguments(f.field("arguments")),
            })
        })
        .collect();
    // Legacy single `function_call` (no id: the function name stands in).
    if let Some(f) = message.get("function_call").filter(|f| f.is_object()) {
        calls.push(ToolCall {
            id: f.owned_str("name").unwrap_or_default(),
            name: f.owned_str("name").unwrap_or_default(),
            arguments: parse_arguments(f.field("arguments")),
        });
    }
    calls
}

/// Reasoning text under any of the names compatible servers use.
fn reasoning_of(message: &Json<'_>) -> Option<String> {
    ["reasoning_content", "reasoning"]
        .iter()
        .find_map(|k| message.str_at(k).filter(|s| !s.is_empty()).map(str::to_owned))
}

fn assistant_message(m: &Json<'_>) -> Message {
    let mut parts = Vec::new();
    if let Some(r) = reasoning_of(m) {
        parts.push(Part::Reasoning { text: r });
    }
    let text = content_to_text(m.field("content"));
    if !text.is_empty() {
        parts.push(Part::Text { text });
    }
    parts.extend(tool_calls_of(m).into_iter().map(Part::ToolCall));
    Message {
        role: Role::Assistant,
        parts,
    }
}

fn output_of(message: &Json<'_>) -> Output {
    let text = content_to_text(message.field("content"));
    Output {
        text: Some(text).filter(|t| !t.is_empty()),
        reasoning: reasoning_of(message),
        reasoning_redacted: false,
        refusal: message.owned_str("refusal").filter(|r| !r.is_empty()),
        tool_calls: tool_calls_of(message),
    }
}

pub(crate) fn map_finish_reason(r: &str) -> FinishReason {
    match r {
        "stop" => FinishReason::Stop,
        "length" => FinishReason::Length,
        "tool_calls" | "function_call" => FinishReason::ToolCall,
        "content_filter" => FinishReason::ContentFilter,
        _ => FinishReason::Other,
    }
}

fn usage_of(u: &Json<'_>) -> Usage {
    Usage {
        input: u64_at(u, &["prompt_tokens"]).unwrap_or(0),
        output: u64_at(u, &["completion_tokens"]).unwrap_or(0),
        cache_read: u64_at(u, &["prompt_tokens_details", "cached_tokens"]),
        cache_write: None,
        reasoning: u64_at(u, &["completion_tokens_details", "reasoning_tokens"]),
    }
}
