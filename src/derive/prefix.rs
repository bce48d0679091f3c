//! Prefix reuse: how much of a prompt repeats the previous call of its trajectory (prompt + output turn).
//!
//! Fingerprints are only ever compared with fingerprints this process computed for the previous call, never
//! stored or sent to another replica, so they use FxHash (several times faster than SipHash on long text).

use std::hash::{Hash, Hasher};

use rustc_hash::FxHasher;
use serde_json::Value;

use crate::model::call::{Message, NormalizedCall, Part};

use super::identity::{CallIds, output_as_message};
use super::stable_hash::put_json;

/// What the next call of a trajectory is compared with.
pub struct LastCall {
    system_hash: Option<String>,
    /// Request messages followed by the output turn.
    fingerprints: Vec<u64>,
    bytes: Vec<usize>,
    input_tokens: u64,
    output_tokens: u64,
}

impl LastCall {
    /// `prompt` is `prompt_fingerprints` of the call's request (computed once, for `reuse` too).
    pub fn new(call: &NormalizedCall, prompt: Vec<u64>, system_hash: Option<String>, ids: CallIds) -> LastCall {
        let usage = call.usage.unwrap_or_default();
        let mut fingerprints = prompt;
        let mut bytes: Vec<usize> = call.messages.iter().map(message_bytes).collect();
        let out = output_as_message(&call.output);
        fingerprints.push(fingerprint(&out, ids));
        bytes.push(message_bytes(&out));
        LastCall {
            system_hash,
            fingerprints,
            bytes,
            input_tokens: usage.input,
            output_tokens: usage.output,
        }
    }

    pub fn system_hash(&self) -> Option<&str> {
        self.system_hash.as_deref()
    }

    /// The fingerprint of the call's output turn (as its echo in a later request would have).
    pub fn output_fingerprint(&self) -> Option<u64> {
        self.fingerprints.last().copied()
    }
}

/// Prefix reuse in tokens and whether it is estimated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reuse {
    pub tokens: u64,
    pub estimated: bool,
}

pub fn prompt_fingerprints(messages: &[Message], ids: CallIds) -> Vec<u64> {
    messages.iter().map(|m| fingerprint(m, ids)).collect()
}

/// Exact when this prompt extends the previous prompt plus its output turn (the previous call's input and
/// output tokens are all reused); otherwise estimated from the bytes of the common message prefix.
pub fn reuse(last: Option<&LastCall>, prompt: &[u64], system_hash: Option<&str>) -> Reuse {
    let none = |estimated| Reuse { tokens: 0, estimated };
    let Some(last) = last else { return none(false) };
    if last.system_hash.as_deref() != system_hash {
        return none(false);
    }
    let common = prompt
        .iter()
        .zip(&last.fingerprints)
        .take_while(|(a, b)| a == b)
        .count();
    let prev_total = last.input_tokens + last.output_tokens;
    if common == last.fingerprints.len() && prompt.len() > common {
        return Reuse {
            tokens: prev_total,
            estimated: false,
        };
    }
    if common == 0 {
        return none(true);
    }
    let total: usize = last.bytes.iter().sum();
    let shared: usize = last.bytes[..common].iter().sum();
    Reuse {
        tokens: ((prev_total as f64) * shared as f64 / total.max(1) as f64) as u64,
        estimated: true,
    }
}

/// A message's fingerprint: role and content, reasoning dropped, arguments canonical, ids only where the
/// provider assigned them (so the echo of a call matches the call).
pub fn fingerprint(m: &Message, ids: CallIds) -> u64 {
    let mut h = FxHasher::default();
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
                put_json(&mut h, &c.arguments);
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
    use crate::derive::testkit::*;
    use crate::model::call::Role;
    use serde_json::json;

    fn last_of(c: &NormalizedCall) -> LastCall {
        LastCall::new(
            c,
            prompt_fingerprints(&c.messages, CallIds::Stable),
            Some("sp_a".into()),
            CallIds::Stable,
        )
    }

    #[test]
    fn reuse_is_exact_when_the_prompt_extends_the_previous_call() {
        let first = call(
            "",
            vec![user("read a.rs")],
            calls_out(&[tool_call("c1", "read", json!({"p": 1}))]),
        );
        let echo = calls(&[tool_call("c1", "read", json!({"p": 1.0}))]);
        let next = vec![user("read a.rs"), echo, result("c1", "text")];
        let got = reuse(
            Some(&last_of(&first)),
            &prompt_fingerprints(&next, CallIds::Stable),
            Some("sp_a"),
        );
        assert_eq!(
            got,
            Reuse {
                tokens: 110,
                estimated: false
            }
        );
    }

    #[test]
    fn reuse_is_estimated_from_bytes_when_the_prompt_diverges() {
        let first = call(
            "",
            vec![user("aaaa"), assistant("bbbb"), user("cccccccc")],
            text_out("dddd"),
        );
        // Same first two messages (8 of the previous 20 bytes), then another user turn.
        let next = vec![user("aaaa"), assistant("bbbb"), user("zz")];
        let got = reuse(
            Some(&last_of(&first)),
            &prompt_fingerprints(&next, CallIds::Stable),
            Some("sp_a"),
        );
        assert_eq!(
            got,
            Reuse {
                tokens: 110 * 8 / 20,
                estimated: true
            }
        );
        let unrelated = vec![user("other")];
        let got = reuse(
            Some(&last_of(&first)),
            &prompt_fingerprints(&unrelated, CallIds::Stable),
            Some("sp_a"),
        );
        assert_eq!(
            got,
            Reuse {
                tokens: 0,
                estimated: true
            }
        );
    }

    #[test]
    fn no_reuse_without_a_previous_call_or_across_system_prompts() {
        let first = call("", vec![user("a")], text_out("b"));
        let next = prompt_fingerprints(&[user("a"), assistant("b"), user("c")], CallIds::Stable);
        assert_eq!(
            reuse(None, &next, Some("sp_a")),
            Reuse {
                tokens: 0,
                estimated: false
            }
        );
        assert_eq!(
            reuse(Some(&last_of(&first)), &next, Some("sp_b")),
            Reuse {
                tokens: 0,
                estimated: false
            }
        );
        assert_eq!(reuse(Some(&last_of(&first)), &next, Some("sp_a")).tokens, 110);
    }

    #[test]
    fn fingerprint_ignores_key_order_reasoning_and_whitespace() {
        let a = Message {
            role: Role::Assistant,
            parts: vec![
                Part::Reasoning { text: "hmm".into() },
                Part::Text { text: "ok ".into() },
                Part::ToolCall(tool_call("c1", "f", json!({"a": 1, "b": [1, 2]}))),
            ],
        };
        let b = Message {
            role: Role::Assistant,
            parts: vec![
                Part::Text { text: "ok".into() },
                Part::ToolCall(tool_call("c1", "f", json!({"b": [1, 2], "a": 1}))),
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
        d.parts[1] = Part::ToolCall(tool_call("pyd_ai_1", "f", json!({"a": 1, "b": [1, 2]})));
        assert_ne!(fingerprint(&b, CallIds::Stable), fingerprint(&d, CallIds::Stable));
        assert_eq!(
            fingerprint(&b, CallIds::ClientAssigned),
            fingerprint(&d, CallIds::ClientAssigned)
        );
    }
}
