//! `NormalizedCall`: what one provider exchange says, in a provider-independent shape.
//!
//! Produced by a provider adapter from the request JSON and the (reassembled) response JSON; consumed by the
//! deriver and the exporters. Normal forms are chosen to be stable across the ways clients echo history back:
//! arguments are parsed into objects, cache-control markers and signatures are dropped, text is kept verbatim.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::json::Json;
use super::usage::Usage;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
    /// A message that only carries tool results (OpenAI `role: tool`); Anthropic/Gemini put them in user turns.
    Tool,
    /// System context inside the history (Claude Code 2.x `{"role":"system"}` entries in `messages[]`): neither a
    /// user turn nor part of the system prompt.
    System,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// Always an object when the provider's JSON parses; the raw string otherwise.
    pub arguments: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text {
        text: String,
    },
    Reasoning {
        text: String,
    },
    /// An image, audio or file input, by reference (URL, or `sha256:<hex>` of inline data with its media type).
    Media {
        reference: String,
        media_type: Option<String>,
    },
    ToolCall(ToolCall),
    ToolResult {
        call_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        content: String,
        is_error: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub parts: Vec<Part>,
}

impl Message {
    pub fn text(&self) -> String {
        let mut out = String::new();
        for p in &self.parts {
            if let Part::Text { text } = p {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(text);
            }
        }
        out
    }

    pub fn tool_calls(&self) -> impl Iterator<Item = &ToolCall> {
        self.parts.iter().filter_map(|p| match p {
            Part::ToolCall(c) => Some(c),
            _ => None,
        })
    }

    pub fn has_user_text(&self) -> bool {
        self.role == Role::User
            && self
                .parts
                .iter()
                .any(|p| matches!(p, Part::Text { text } if !text.trim().is_empty()))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// Why generation stopped, mapped to the OpenTelemetry GenAI finish reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCall,
    ContentFilter,
    Error,
    /// Anthropic `pause_turn` and other provider-specific reasons.
    Other,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCall => "tool_call",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Error => "error",
            FinishReason::Other => "other",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallError {
    /// Provider error type/code (`invalid_request_error`, `rate_limit_exceeded`, `NOT_FOUND`, ...) or `http_<status>`.
    pub kind: String,
    pub message: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Output {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Reasoning happened but its content is hidden (Anthropic redacted_thinking, encrypted Responses reasoning).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reasoning_redacted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// Whether tool call ids can be trusted to survive a client's echo. Providers that assign ids (OpenAI,
/// Anthropic) see them echoed verbatim; Gemini usually returns calls without ids and clients invent their own
/// when they echo, so there a call is known by its name and canonical arguments instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallIds {
    Stable,
    ClientAssigned,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NormalizedCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_requested: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_response: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    /// System/developer instructions joined with blank lines; None when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolDef>,
    pub output: Output,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<FinishReason>,
    /// The provider's own stop reason string.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider_finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_usage: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<CallError>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// Native conversation ids (OpenAI Responses `previous_response_id` / `conversation`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    /// The session id the client put in the request body (Claude Code `metadata.user_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_session: Option<String>,
}

/// Tool arguments arrive as JSON text (OpenAI, Responses) or objects (Anthropic, Gemini); normalize to a value.
pub fn parse_arguments(raw: &Json<'_>) -> Value {
    match raw {
        Json::String(s) if s.trim().is_empty() => Value::Object(Default::default()),
        Json::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_string())),
        Json::Null => Value::Object(Default::default()),
        other => other.to_value(),
    }
}

/// A stable reference for inline media: `sha256:<16 hex>` (the bytes themselves are never copied into steps).
pub fn media_reference(url_or_data: &str) -> String {
    if url_or_data.starts_with("data:") || !url_or_data.contains("://") {
        format!("sha256:{}", crate::model::short_hash(url_or_data.as_bytes()))
    } else {
        url_or_data.to_owned()
    }
}

/// Text of a tool-result content value: strings verbatim, text blocks joined, anything else as compact JSON.
pub fn content_to_text(v: &Json<'_>) -> String {
    match v {
        Json::String(s) => s.to_string(),
        Json::Array(items) => {
            let mut out = String::new();
            for (n, i) in items.iter().enumerate() {
                if n > 0 {
                    out.push('\n');
                }
                match (i.str_at("text"), i) {
                    (Some(t), _) => out.push_str(t),
                    (None, Json::String(s)) => out.push_str(s),
                    (None, other) => out.push_str(&other.to_string()),
                }
            }
            out
        }
        Json::Null => String::new(),
        other => other.to_string(),
    }
}
