//! Gemini `generateContent` / `streamGenerateContent` (REST, camelCase; snake_case accepted on input).
//!
//! Stream: each chunk is a whole `GenerateContentResponse` holding only the new parts; `?alt=sse` frames them
//! as SSE (with `\r\n` separators), otherwise they arrive as one JSON array. Usage: `candidatesTokenCount`
//! excludes `thoughtsTokenCount`; we add it to output. Function calls often carry no id: we give them a stable
//! one from their position in the conversation (`gemini:<message>:<n>`), so a call and its functionResponse in
//! the next request join the same way on every replica.

use serde_json::{Map, Value, json};

use super::{AdapterError, CallContext, ProviderAdapter, error_from_body, join_nonempty, json_events, value_str};
use crate::capture::Api;
use crate::capture::sse::SseEvent;
use crate::config::ApiFamily;
use crate::model::call::CallIds;
use crate::model::call::{
    FinishReason, Message, NormalizedCall, Output, Part, Role, ToolCall, ToolDef, content_to_text, media_reference,
};
use crate::model::json::Json;
use crate::model::usage::{Usage, u64_at};

pub struct Gemini;

/// camelCase or snake_case field (the REST API accepts both on input).
fn field<'a, 'j>(v: &'a Json<'j>, camel: &str, snake: &str) -> Option<&'a Json<'j>> {
    v.get(camel).or_else(|| v.get(snake))
}

impl ProviderAdapter for Gemini {
    fn api(&self) -> Api {
        Api::GeminiGenerateContent
    }

    fn family(&self) -> ApiFamily {
        ApiFamily::Gemini
    }

    fn matches_path(&self, path: &str) -> bool {
        path.ends_with(":generateContent") || path.ends_with(":streamGenerateContent")
    }

    /// Without `?alt=sse`, `streamGenerateContent` answers one JSON array of chunks.
    fn streams_json_array(&self, path: &str) -> bool {
        path.contains(":streamGenerateContent")
    }

    /// Gemini returns calls without ids; clients invent their own when they echo them.
    fn call_ids(&self) -> CallIds {
        CallIds::ClientAssigned
    }

    fn otel_provider_name<'a>(&self, _upstream: &'a str) -> &'a str {
        "gcp.gemini"
    }

    fn reassemble(&self, events: &[SseEvent]) -> Result<Value, AdapterError> {
        let mut top = Map::new();
        let mut candidates: Vec<Map<String, Value>> = Vec::new();
        let mut seen = false;
        for (_, chunk) in json_events(events) {
            // A stream sent without alt=sse is one JSON array of chunks.
            let chunks = match chunk {
                Value::Array(a) => a,
                other => vec![other],
            };
            for chunk in chunks {
                seen = true;
                let Value::Object(obj) = chunk else { continue };
                for (k, v) in obj {
                    if k == "candidates" {
                        for c in v.as_array().into_iter().flatten() {
                            merge_candidate(&mut candidates, c);
                        }
                    } else {
                        top.insert(k, v);
                    }
                }
            }
        }
        if !seen {
            return Err(AdapterError::EmptyStream("GenerateContentResponse"));
        }
        if !candidates.is_empty() {
            top.insert(
                "candidates".into(),
                Value::Array(candidates.into_iter().map(Value::Object).collect()),
            );
        }
        // Keep the documented key order of a non-streamed response: candidates first.
        let mut ordered = Map::new();
        if let Some(c) = top.remove("candidates") {
            ordered.insert("candidates".into(), c);
        }
        ordered.extend(top);
        Ok(Value::Object(ordered))
    }

    fn read_call(&self, ctx: &CallContext<'_>, req: &Json<'_>, resp: &Json<'_>) -> NormalizedCall {
        let system = field(req, "systemInstruction", "system_instruction")
            .map(|s| parts_text(s.get("parts").unwrap_or(s)))
            .filter(|s| !s.is_empty());
        let contents: &[Json<'_>] = req.get("contents").and_then(Json::as_array).unwrap_or(&[]);
        let mut messages: Vec<Message> = Vec::new();
        for (i, c) in contents.iter().enumerate() {
            let role = match c.str_at("role") {
                Some("model") => Role::Assistant,
                _ => Role::User,
            };
            let parts = c.get("parts").and_then(Json::as_array).unwrap_or(&[]);
            let mut out = Vec::new();
            let mut call_n = 0;
            for p in parts {
                if let Some(fc) = field(p, "functionCall", "function_call") {
                    out.push(Part::ToolCall(function_call(fc, i, call_n)));
                    call_n += 1;
                } else if let Some(fr) = field(p, "functionResponse", "function_response") {
                    let name = fr.owned_str("name").unwrap_or_default();
                    let call_id = fr
                        .owned_str("id")
                        .or_else(|| match_function_response(&messages, &out, &name))
                        .unwrap_or_else(|| format!("gemini:{name}"));
                    let response = fr.field("response");
                    let is_error = response.get("error").is_some_and(|e| !e.is_null());
                    out.push(Part::ToolResult {
                        call_id,
                        name: Some(name),
                        content: content_to_text(response),
                        is_error,
                    });
                } else if let Some(part) = content_part(p) {
                    out.push(part);
                }
            }
            messages.push(Message { role, parts: out });
        }
        let tools = req
            .get("tools")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .flat_map(
                |t| match field(t, "functionDeclarations", "function_declarations").and_then(Json::as_array) {
                    Some(decls) => decls
                        .iter()
                        .filter_map(|d| {
                            Some(ToolDef {
                                name: d.owned_str("name")?,
                                description: d.owned_str("description"),
                                parameters: d
                                    .get("parameters")
                                    .or_else(|| d.get("parametersJsonSchema"))
                                    .map(Json::to_value),
                            })
                        })
                        .collect::<Vec<_>>(),
                    // Built-in tools ({"googleSearch": {}}, {"codeExecution": {}}) are named by their key.
                    None => t
                        .as_object()
                        .into_iter()
                        .flat_map(|o| o.iter())
                        .map(|(k, _)| ToolDef {
                            name: k.to_string(),
                            description: None,
                            parameters: None,
                        })
                        .collect(),
                },
            )
            .collect();

        let candidate = resp.get("candidates").and_then(|c| c.at(0));
        let mut output = Output::default();
        let mut text = Vec::new();
        let mut reasoning = Vec::new();
        let mut call_n = 0;
        for p in candidate
            .and_then(|c| c.get("content"))
            .and_then(|c| c.get("parts"))
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(fc) = field(p, "functionCall", "function_call") {
                output.tool_calls.push(function_call(fc, contents.len(), call_n));
                call_n += 1;
            } else if let Some(t) = p.str_at("text") {
                if p.get("thought").and_then(Json::as_bool).unwrap_or(false) {
                    reasoning.push(t.to_owned());
                } else {
                    text.push(t.to_owned());
                }
            }
        }
        output.text = Some(text.concat()).filter(|t| !t.is_empty());
        output.reasoning = join_nonempty(reasoning, "");
        let provider_finish = candidate.and_then(|c| c.owned_str("finishReason"));
        let error = error_from_body(resp, ctx.status);
        let finish_reason = if error.is_some() {
            Some(FinishReason::Error)
        } else if !output.tool_calls.is_empty() {
            Some(FinishReason::ToolCall)
        } else {
            provider_finish.as_deref().map(|r| match r {
                "STOP" => FinishReason::Stop,
                "MAX_TOKENS" => FinishReason::Length,
                "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY" => {
                    FinishReason::ContentFilter
                }
                "MALFORMED_FUNCTION_CALL" | "UNEXPECTED_TOOL_CALL" => FinishReason::Error,
                _ => FinishReason::Other,
            })
        };
        let usage = resp.get("usageMetadata").filter(|u| u.is_object());
        let gen_config = field(req, "generationConfig", "generation_config");
        NormalizedCall {
            model_requested: model_from_path(ctx.path).or_else(|| req.owned_str("model")),
            model_response: resp.owned_str("modelVersion"),
            response_id: resp.owned_str("responseId"),
            system,
            messages,
            tools,
            output,
            finish_reason,
            provider_finish_reason: provider_finish,
            usage: usage.map(usage_of),
            raw_usage: usage.map(Json::to_value),
            error,
            max_output_tokens: gen_config
                .and_then(|g| field(g, "maxOutputTokens", "max_output_tokens"))
                .and_then(Json::as_u64),
            previous_response_id: None,
            conversation_id: None,
            client_session: None,
        }
    }
}

/// `/v1beta/models/gemini-2.5-flash:streamGenerateContent` → `gemini-2.5-flash`.
fn model_from_path(path: &str) -> Option<String> {
    let path = path.split('?').next().unwrap_or(path);
    let after = path.rsplit_once("/models/").map(|(_, m)| m)?;
    let model = after.split(':').next()?;
    (!model.is_empty()).then(|| model.to_owned())
}

fn function_call(fc: &Json<'_>, message_index: usize, n: usize) -> ToolCall {
    let name = fc.owned_str("name").unwrap_or_default();
    ToolCall {
        id: fc
            .owned_str("id")
            .unwrap_or_else(|| format!("gemini:{message_index}:{n}")),
        name,
        arguments: fc.get("args").map_or_else(|| json!({}), Json::to_value),
    }
}

/// A functionResponse without id answers the first not-yet-answered call of the same name in the latest
/// model turn (Gemini returns responses in call order).
fn match_function_response(messages: &[Message], current: &[Part], name: &str) -> Option<String> {
    let model_turn = messages.iter().rev().find(|m| m.role == Role::Assistant)?;
    let answered: Vec<&str> = messages
        .iter()
        .rev()
        .take_while(|m| m.role != Role::Assistant)
        .flat_map(|m| m.parts.iter())
        .chain(current.iter())
        .filter_map(|p| match p {
            Part::ToolResult { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        })
        .collect();
    model_turn
        .tool_calls()
        .find(|c| c.name == name && !answered.contains(&c.id.as_str()))
        .map(|c| c.id.clone())
}

fn content_part(p: &Json<'_>) -> Option<Part> {
    if let Some(t) = p.str_at("text") {
        return Some(if p.get("thought").and_then(Json::as_bool).unwrap_or(false) {
            Part::Reasoning { text: t.to_owned() }
        } else {
            Part::Text { text: t.to_owned() }
        });
    }
    if let Some(d) = field(p, "inlineData", "inline_data") {
        return Some(Part::Media {
            reference: media_reference(d.str_at("data").unwrap_or("")),
            media_type: field(d, "mimeType", "mime_type")
                .and_then(Json::as_str)
                .map(str::to_owned),
        });
    }
    if let Some(d) = field(p, "fileData", "file_data") {
        return Some(Part::Media {
            reference: field(d, "fileUri", "file_uri")
                .and_then(Json::as_str)
                .unwrap_or("")
                .to_owned(),
            media_type: field(d, "mimeType", "mime_type")
                .and_then(Json::as_str)
                .map(str::to_owned),
        });
    }
    None
}

fn parts_text(parts: &Json<'_>) -> String {
    match parts {
        Json::Array(ps) => ps
            .iter()
            .filter_map(|p| p.str_at("text"))
            .collect::<Vec<_>>()
            .join("\n"),
        Json::String(s) => s.to_string(),
        other => other.str_at("text").unwrap_or("").to_owned(),
    }
}

/// Append a chunk's candidate to the accumulated one with the same index.
fn merge_candidate(candidates: &mut Vec<Map<String, Value>>, c: &Value) {
    let idx = c.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
    while candidates.len() <= idx {
        candidates.push(Map::new());
    }
    let acc = &mut candidates[idx];
    let Some(obj) = c.as_object() else { return };
    for (k, v) in obj {
        if k != "content" {
            acc.insert(k.clone(), v.clone());
            continue;
        }
        let content = acc.entry("content").or_insert_with(|| json!({"parts": []}));
        let Value::Object(content) = content else { continue };
        if let Some(role) = v.get("role") {
            content.insert("role".into(), role.clone());
        }
        let parts = content.entry("parts").or_insert_with(|| json!([]));
        let Value::Array(parts) = parts else { continue };
        for p in v.get("parts").and_then(Value::as_array).into_iter().flatten() {
            merge_part(parts, p);
        }
    }
}

/// Adjacent text parts of the same kind (thought or not) are one part in a non-streamed response.
fn merge_part(parts: &mut Vec<Value>, p: &Value) {
    let is_thought = |v: &Value| v.get("thought").and_then(Value::as_bool).unwrap_or(false);
    if let (Some(Value::Object(last)), Some(add)) = (parts.last_mut(), value_str(p, "text"))
        && !last.contains_key("thoughtSignature")
        && last.get("thought").and_then(Value::as_bool).unwrap_or(false) == is_thought(p)
        && let Some(Value::String(t)) = last.get_mut("text")
    {
        t.push_str(add);
        if let Some(sig) = p.get("thoughtSignature") {
            last.insert("thoughtSignature".into(), sig.clone());
        }
        return;
    }
    parts.push(p.clone());
}

fn usage_of(u: &Json<'_>) -> Usage {
    let thoughts = u64_at(u, &["thoughtsTokenCount"]);
    Usage {
        input: u64_at(u, &["promptTokenCount"]).unwrap_or(0) + u64_at(u, &["toolUsePromptTokenCount"]).unwrap_or(0),
        output: u64_at(u, &["candidatesTokenCount"]).unwrap_or(0) + thoughts.unwrap_or(0),
        cache_read: u64_at(u, &["cachedContentTokenCount"]),
        cache_write: None,
        reasoning: thoughts,
    }
}
