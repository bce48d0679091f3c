//! Trajectory identity and message fingerprints: pure functions of one call.
//!
//! A trajectory is keyed by its root: the session scope (explicit `x-llmtap-session`, else empty), the system
//! prompt, the first user turn and the first assistant turn. Call 1 of a conversation has no assistant turn in
//! its request, so it uses its own output; every later call finds that same turn echoed back in its request.
//! Every replica therefore computes the same id for the same conversation without coordination.
//! Echoes are imperfect (thinking dropped, arguments re-serialized, whitespace), so keys use tool call ids when
//! there are any (the strongest join key) and trimmed text otherwise, never reasoning or signatures.

use std::hash::{Hash, Hasher};

// Fingerprints only compare a client's echo with what it echoes; FxHash is several times faster than SipHash on
// long text and collision attacks are not a concern for prefix-reuse accounting.
use rustc_hash::FxHasher as DefaultHasher;

use serde_json::Value;

use crate::model::call::{Message, NormalizedCall, Output, Part, Role, ToolCall};
use crate::model::short_hash;

/// `sp_` + 16 hex of SHA-256 of the system text.
pub fn system_prompt_hash(text: &str) -> String {
    format!("sp_{}", short_hash(text.trim().as_bytes()))
}

/// The user-visible text of a user turn, media by reference, in order.
pub fn user_key(m: &Message) -> String {
    let mut out = String::new();
    for p in &m.parts {
        match p {
            Part::Text { text } => {
                out.push_str(text.trim());
                out.push('\n');
            }
            Part::Media { reference, .. } => {
                out.push_str(reference);
                out.push('\n');
            }
            _ => {}
        }
    }
    out
}

/// Whether tool call ids can be trusted to survive the echo. Providers that assign ids (OpenAI, Anthropic)
/// see them echoed verbatim; Gemini usually returns calls without ids and clients invent their own when they
/// echo, so there a call is known by its name and canonical arguments instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallIds {
    Stable,
    ClientAssigned,
}

fn call_key(c: &ToolCall, ids: CallIds) -> String {
    match ids {
        CallIds::Stable if !c.id.is_empty() => c.id.clone(),
        _ => {
            let mut h = DefaultHasher::default();
            hash_canonical(&c.arguments, &mut h);
            format!("{}#{:016x}", c.name, h.finish())
        }
    }
}

fn assistant_key_from<'a>(text: &str, calls: impl Iterator<Item = &'a ToolCall>, ids: CallIds) -> String {
    let keys: Vec<String> = calls.map(|c| call_key(c, ids)).collect();
    if keys.is_empty() {
        format!("text:{}", text.trim())
    } else {
        format!("calls:{}", keys.join(","))
    }
}

pub fn assistant_key(m: &Message, ids: CallIds) -> String {
    assistant_key_from(&m.text(), m.tool_calls(), ids)
}

pub fn output_key(o: &Output, ids: CallIds) -> String {
    assistant_key_from(
        o.text.as_deref().or(o.refusal.as_deref()).unwrap_or(""),
        o.tool_calls.iter(),
        ids,
    )
}

/// Whether the output holds anything a client could echo back as an assistant turn.
pub fn output_is_empty(o: &Output) -> bool {
    o.text.as_deref().is_none_or(|t| t.trim().is_empty()) && o.tool_calls.is_empty() && o.refusal.is_none()
}

pub struct RootKeys {
    /// scope + system + first user turn: shared by a failed first call and its retry.
    pub prefix: String,
    /// prefix + first assistant turn: the trajectory's identity.
    pub root: String,
    /// The request already contains an assistant turn (this is not the conversation's first call).
    pub has_assistant: bool,
    pub first_user_text: String,
}

pub fn root_keys(scope: &str, call: &NormalizedCall, ids: CallIds) -> RootKeys {
    let first_user = call
        .messages
        .iter()
        .find(|m| m.role == Role::User)
        .map(user_key)
        .unwrap_or_default();
    let first_assistant = call.messages.iter().find(|m| m.role == Role::Assistant);
    let assistant = match first_assistant {
        Some(m) => assistant_key(m, ids),
        None => output_key(&call.output, ids),
    };
    let prefix = short_hash(
        format!(
            "{scope}\u{1}{}\u{1}{first_user}",
            call.system.as_deref().unwrap_or("").trim()
        )
        .as_bytes(),
    );
    let root = short_hash(format!("{prefix}\u{1}{assistant}").as_bytes());
    RootKeys {
        prefix,
        root,
        has_assistant: first_assistant.is_some(),
        first_user_text: first_user,
    }
}

/// A message's fingerprint for prefix comparison: role and content, reasoning dropped, arguments canonical.
pub fn fingerprint(m: &Message, ids: CallIds) -> u64 {
    let mut h = DefaultHasher::default();
    (m.role as u8).hash(&mut h);
    for p in &m.parts {
        match p {
            Part::Text { text } => ("t", text.trim()).hash(&mut h),
            Part::Reasoning { .. } => {}
            Part::Media { reference, .. } => ("m", reference).hash(&mut h),
            Part::ToolCall(c) => {
                ("c", &c.name).hash(&mut h);
                if ids == CallIds::Stable {
                    c.id.hash(&mut h);
                }
                hash_canonical(&c.arguments, &mut h);
            }
            Part::ToolResult { call_id, content, .. } => {
                "r".hash(&mut h);
                if ids == CallIds::Stable {
                    call_id.hash(&mut h);
                }
                content.trim().hash(&mut h);
            }
        }
    }
    h.finish()
}

/// The output as the assistant turn the next request should echo.
pub fn output_as_message(o: &Output) -> Message {
    let mut parts = Vec::new();
    if let Some(t) = o.text.as_ref().or(o.refusal.as_ref()) {
        parts.push(Part::Text { text: t.clone() });
    }
    parts.extend(o.tool_calls.iter().cloned().map(Part::ToolCall));
    Message {
        role: Role::Assistant,
        parts,
    }
}

/// Hash a JSON value independent of object key order and number formatting.
fn hash_canonical(v: &Value, h: &mut DefaultHasher) {
    match v {
        Value::Null => 0u8.hash(h),
        Value::Bool(b) => b.hash(h),
        Value::Number(n) => n.as_f64().map(f64::to_bits).hash(h),
        Value::String(s) => s.hash(h),
        Value::Array(a) => {
            a.len().hash(h);
            for x in a {
                hash_canonical(x, h);
            }
        }
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            for k in keys {
                k.hash(h);
                hash_canonical(&o[k], h);
            }
        }
    }
}

/// Approximate serialized size of a JSON value, without serializing it.
fn json_size(v: &Value) -> usize {
    match v {
        Value::Null | Value::Bool(_) => 4,
        Value::Number(_) => 8,
        Value::String(s) => s.len() + 2,
        Value::Array(a) => 2 + a.iter().map(json_size).sum::<usize>() + a.len(),
        Value::Object(o) => 2 + o.iter().map(|(k, v)| k.len() + 4 + json_size(v)).sum::<usize>(),
    }
}

/// Approximate size of a message in bytes (for estimating prefix reuse when it is not exact).
pub fn message_bytes(m: &Message) -> usize {
    m.parts
        .iter()
        .map(|p| match p {
            Part::Text { text } | Part::Reasoning { text } => text.len(),
            Part::Media { reference, .. } => reference.len(),
            Part::ToolCall(c) => c.name.len() + json_size(&c.arguments),
            Part::ToolResult { content, .. } => content.len(),
        })
        .sum::<usize>()
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::call::ToolCall;
    use serde_json::json;

    #[test]
    fn fingerprint_ignores_key_order_reasoning_and_whitespace() {
        let a = Message {
            role: Role::Assistant,
            parts: vec![
                Part::Reasoning { text: "hmm".into() },
                Part::Text { text: "ok ".into() },
                Part::ToolCall(ToolCall {
                    id: "c1".into(),
                    name: "f".into(),
                    arguments: json!({"a": 1, "b": [1, 2]}),
                }),
            ],
        };
        let b = Message {
            role: Role::Assistant,
            parts: vec![
                Part::Text { text: "ok".into() },
                Part::ToolCall(ToolCall {
                    id: "c1".into(),
                    name: "f".into(),
                    arguments: json!({"b": [1, 2], "a": 1}),
                }),
            ],
        };
        assert_eq!(fingerprint(&a, CallIds::Stable), fingerprint(&b, CallIds::Stable));
        let c = Message {
            role: Role::User,
            parts: b.parts.clone(),
        };
        assert_ne!(fingerprint(&b, CallIds::Stable), fingerprint(&c, CallIds::Stable));
        // Client-assigned ids do not count where ids are not the provider's.
        let mut d = b.clone();
        if let Part::ToolCall(tc) = &mut d.parts[1] {
            tc.id = "pyd_ai_1".into();
        }
        assert_ne!(fingerprint(&b, CallIds::Stable), fingerprint(&d, CallIds::Stable));
        assert_eq!(
            fingerprint(&b, CallIds::ClientAssigned),
            fingerprint(&d, CallIds::ClientAssigned)
        );
    }

    #[test]
    fn system_prompt_hash_shape() {
        let h = system_prompt_hash("You are helpful.");
        assert!(h.starts_with("sp_") && h.len() == 19);
        assert_eq!(h, system_prompt_hash("You are helpful.\n"));
    }
}
