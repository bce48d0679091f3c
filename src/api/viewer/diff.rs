//! What changed between two calls' requests (messages, system prompt, tools, parameters), and two trajectories'
//! steps aligned side by side. Pure functions over JSON the store already holds; the viewer's `data` reads it.
//!
//! Messages are compared as the provider received them, less `cache_control` markers: agents move their cache
//! breakpoint to the newest message on every call, which would make each repeated message look changed. A
//! message changed in place shows as removed and added.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::model::exchange::Api;
use crate::model::step::{Step, StepRole};

/// Past this many messages (or steps) on each side of what two sequences share at their ends, the middle is
/// not aligned (an O(n·m) table): it is reported as all removed and all added.
const MAX_ALIGNED: usize = 2_000;

/// The request keys holding the conversation, the system prompt and the tools, per API.
fn conversation_key(api: Api) -> &'static str {
    match api {
        Api::GeminiGenerateContent => "contents",
        Api::OpenAiResponses => "input",
        _ => "messages",
    }
}

const SYSTEM_KEYS: &[&str] = &["system", "systemInstruction", "instructions"];

/// The difference from request `old` to request `new` (both of API `api`):
/// - `messages`: in order, runs of `{"op": "same", "count": n}` and single `{"op": "added" | "removed",
///   "message": …}` entries; `added` / `removed` / `same` count them;
/// - `system`: `{"changed": bool, "old", "new"}`; `tools`: names `added`, `removed`, `changed`;
/// - `params`: every other top-level key whose value differs, `{key: {"old", "new"}}`.
pub fn requests(api: Api, old: &Value, new: &Value) -> Value {
    let key = conversation_key(api);
    let old_messages = messages(old, key);
    let new_messages = messages(new, key);
    let a: Vec<Value> = old_messages.iter().map(without_cache_markers).collect();
    let b: Vec<Value> = new_messages.iter().map(without_cache_markers).collect();
    let mut ops = Vec::new();
    let (mut same, mut added, mut removed) = (0usize, 0usize, 0usize);
    let mut run = 0usize;
    let flush = |ops: &mut Vec<Value>, run: &mut usize| {
        if *run > 0 {
            ops.push(json!({"op": "same", "count": *run}));
            *run = 0;
        }
    };
    for pair in align(&a, &b, |x, y| x == y) {
        match pair {
            (Some(_), Some(_)) => {
                same += 1;
                run += 1;
            }
            (Some(i), None) => {
                flush(&mut ops, &mut run);
                removed += 1;
                ops.push(op("removed", &old_messages[i]));
            }
            (None, Some(j)) => {
                flush(&mut ops, &mut run);
                added += 1;
                ops.push(op("added", &new_messages[j]));
            }
            (None, None) => {}
        }
    }
    flush(&mut ops, &mut run);
    let system_of = |v: &Value| {
        SYSTEM_KEYS
            .iter()
            .find_map(|k| v.get(*k))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let (old_system, new_system) = (system_of(old), system_of(new));
    json!({
        "messages": ops,
        "added": added,
        "removed": removed,
        "same": same,
        "system": {
            "changed": without_cache_markers(&old_system) != without_cache_markers(&new_system),
            "old": old_system,
            "new": new_system,
        },
        "tools": tools(old, new),
        "params": params(old, new, key),
    })
}

/// An added or removed message; a text-only one holding context the client injected also as `content_parts`
/// (`derive::context::segments`), for the page to fold.
fn op(kind: &str, message: &Value) -> Value {
    let mut v = json!({"op": kind, "message": message});
    if let Some(text) = message_text(message)
        && crate::derive::context::has_injected(&text)
    {
        v["content_parts"] = serde_json::to_value(crate::derive::context::segments(&text)).unwrap_or(Value::Null);
    }
    v
}

/// A message's text when its content is a string or text blocks only (as the page shows it, blocks joined by
/// newlines); None when it holds anything else (tool calls, results, media).
fn message_text(message: &Value) -> Option<String> {
    match message.get("content").or_else(|| message.get("parts"))? {
        Value::String(s) => Some(s.clone()),
        Value::Array(blocks) => {
            let texts: Option<Vec<&str>> = blocks
                .iter()
                .map(|b| {
                    let only_text = b
                        .as_object()?
                        .keys()
                        .all(|k| k == "text" || k == "type" || k == "cache_control");
                    if only_text { b.get("text")?.as_str() } else { None }
                })
                .collect();
            Some(texts?.join("\n"))
        }
        _ => None,
    }
}

fn messages(request: &Value, key: &str) -> Vec<Value> {
    match request.get(key) {
        Some(Value::Array(items)) => items.clone(),
        // Responses `input` may be one string: one user message.
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        _ => Vec::new(),
    }
}

/// Tool definitions by name: added, removed, and changed (same name, another definition).
fn tools(old: &Value, new: &Value) -> Value {
    let by_name = |v: &Value| -> BTreeMap<String, Value> {
        v.get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, t)| {
                (
                    tool_name(t).unwrap_or_else(|| format!("#{i}")),
                    without_cache_markers(t),
                )
            })
            .collect()
    };
    let (a, b) = (by_name(old), by_name(new));
    let added: Vec<&String> = b.keys().filter(|k| !a.contains_key(*k)).collect();
    let removed: Vec<&String> = a.keys().filter(|k| !b.contains_key(*k)).collect();
    let changed: Vec<&String> = a
        .iter()
        .filter(|(k, v)| b.get(*k).is_some_and(|w| w != *v))
        .map(|(k, _)| k)
        .collect();
    json!({ "added": added, "removed": removed, "changed": changed, "count": b.len() })
}

/// A tool definition's name in any provider's shape (`name`, Chat's `function.name`, Gemini's declarations).
fn tool_name(t: &Value) -> Option<String> {
    t.get("name")
        .or_else(|| t.get("function").and_then(|f| f.get("name")))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| {
            let decls = t.get("functionDeclarations")?.as_array()?;
            let names: Vec<&str> = decls.iter().filter_map(|d| d.get("name")?.as_str()).collect();
            Some(names.join(","))
        })
}

fn params(old: &Value, new: &Value, conversation: &str) -> Value {
    let empty = Map::new();
    let (a, b) = (old.as_object().unwrap_or(&empty), new.as_object().unwrap_or(&empty));
    let skip = |k: &str| k == conversation || k == "tools" || SYSTEM_KEYS.contains(&k);
    let mut out = Map::new();
    for k in a.keys().chain(b.keys()) {
        if skip(k) || out.contains_key(k) {
            continue;
        }
        let (x, y) = (a.get(k), b.get(k));
        if x != y {
            out.insert(k.clone(), json!({"old": x, "new": y}));
        }
    }
    Value::Object(out)
}

/// `v` without `cache_control` members, at any depth.
fn without_cache_markers(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| k.as_str() != "cache_control")
                .map(|(k, v)| (k.clone(), without_cache_markers(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_cache_markers).collect()),
        other => other.clone(),
    }
}

/// Two trajectories' steps side by side: rows of (index into `a`, index into `b`), aligned on what each step
/// is (a user step by its text, an agent step by the tools it called, or as text), in order.
pub fn align_steps(a: &[Step], b: &[Step]) -> Vec<(Option<usize>, Option<usize>)> {
    let (ka, kb): (Vec<String>, Vec<String>) = (a.iter().map(step_key).collect(), b.iter().map(step_key).collect());
    align(&ka, &kb, |x, y| x == y)
}

/// What a step is, for alignment: the same task run twice makes steps with the same keys.
fn step_key(s: &Step) -> String {
    match s.role {
        StepRole::Agent if !s.tool_calls.is_empty() => {
            let names: Vec<&str> = s.tool_calls.iter().map(|c| c.tool_name.as_str()).collect();
            format!("agent calls {}", names.join(","))
        }
        StepRole::Agent => "agent text".to_owned(),
        StepRole::User => format!(
            "user {}",
            crate::derive::context::user_text(s.content.as_deref().unwrap_or(""))
        ),
        StepRole::System => "system".to_owned(),
    }
}

/// A longest-common-subsequence alignment of `a` and `b`: pairs in order, `(Some(i), Some(j))` where they
/// match, one side `None` where an item is only on the other. Common ends are matched first; a middle longer
/// than [`MAX_ALIGNED`] on either side is reported as removed then added.
fn align<T>(a: &[T], b: &[T], eq: impl Fn(&T, &T) -> bool) -> Vec<(Option<usize>, Option<usize>)> {
    let prefix = a.iter().zip(b).take_while(|(x, y)| eq(x, y)).count();
    let suffix = a[prefix..]
        .iter()
        .rev()
        .zip(b[prefix..].iter().rev())
        .take_while(|(x, y)| eq(x, y))
        .count();
    let (am, bm) = (&a[prefix..a.len() - suffix], &b[prefix..b.len() - suffix]);
    let mut out: Vec<(Option<usize>, Option<usize>)> = (0..prefix).map(|i| (Some(i), Some(i))).collect();
    if am.len() > MAX_ALIGNED || bm.len() > MAX_ALIGNED {
        out.extend((0..am.len()).map(|i| (Some(prefix + i), None)));
        out.extend((0..bm.len()).map(|j| (None, Some(prefix + j))));
    } else {
        // lcs[i][j]: the longest common subsequence of am[i..] and bm[j..].
        let (n, m) = (am.len(), bm.len());
        let mut lcs = vec![vec![0u32; m + 1]; n + 1];
        for i in (0..n).rev() {
            for j in (0..m).rev() {
                lcs[i][j] = if eq(&am[i], &bm[j]) {
                    lcs[i + 1][j + 1] + 1
                } else {
                    lcs[i + 1][j].max(lcs[i][j + 1])
                };
            }
        }
        let (mut i, mut j) = (0, 0);
        while i < n || j < m {
            if i < n && j < m && eq(&am[i], &bm[j]) {
                out.push((Some(prefix + i), Some(prefix + j)));
                i += 1;
                j += 1;
            } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
                // Removed before added: a message changed in place reads as the old one, then the new.
                out.push((Some(prefix + i), None));
                i += 1;
            } else {
                out.push((None, Some(prefix + j)));
                j += 1;
            }
        }
    }
    let (a_end, b_end) = (a.len() - suffix, b.len() - suffix);
    out.extend((0..suffix).map(|k| (Some(a_end + k), Some(b_end + k))));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, text: &str) -> Value {
        json!({"role": role, "content": [{"type": "text", "text": text}]})
    }

    #[test]
    fn the_next_call_of_a_conversation_adds_exactly_its_new_messages() {
        let old = json!({"model": "m", "max_tokens": 100, "system": "s", "messages": [
            msg("user", "hi"), msg("assistant", "hello")], "tools": [{"name": "Bash", "input_schema": {}}]});
        let mut new = old.clone();
        new["messages"]
            .as_array_mut()
            .unwrap()
            .extend([msg("user", "more"), msg("assistant", "sure")]);
        // The cache breakpoint moved to the newest message: not a change.
        new["messages"][1]["content"][0]["cache_control"] = json!({"type": "ephemeral"});
        new["max_tokens"] = json!(200);
        new["tools"] = json!([{"name": "Bash", "input_schema": {"x": 1}}, {"name": "Read", "input_schema": {}}]);
        let d = requests(Api::AnthropicMessages, &old, &new);
        assert_eq!(d["same"], 2);
        assert_eq!(d["added"], 2);
        assert_eq!(d["removed"], 0);
        assert_eq!(
            d["messages"],
            json!([{"op": "same", "count": 2}, {"op": "added", "message": msg("user", "more")},
                {"op": "added", "message": msg("assistant", "sure")}])
        );
        assert_eq!(d["system"]["changed"], false);
        assert_eq!(
            d["tools"],
            json!({"added": ["Read"], "removed": [], "changed": ["Bash"], "count": 2})
        );
        assert_eq!(d["params"], json!({"max_tokens": {"old": 100, "new": 200}}));
    }

    #[test]
    fn a_rewritten_history_shows_removed_and_added_messages_in_place_and_a_new_system_prompt() {
        let old = json!({"instructions": "a", "input": [msg("user", "1"), msg("user", "2"), msg("user", "3")]});
        let new = json!({"instructions": "b", "input": [msg("user", "1"), msg("user", "2b"), msg("user", "3")]});
        let d = requests(Api::OpenAiResponses, &old, &new);
        let ops: Vec<&str> = d["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["op"].as_str().unwrap())
            .collect();
        assert_eq!(ops, ["same", "removed", "added", "same"]);
        assert_eq!(d["system"], json!({"changed": true, "old": "a", "new": "b"}));
        assert_eq!(d["params"], json!({}));
        // Injected context in an added text message is split out for the page to fold.
        let injected = json!({"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nx\n</system-reminder>"}, {"type": "text", "text": "go"}]});
        let d = requests(
            Api::AnthropicMessages,
            &json!({"messages": []}),
            &json!({"messages": [injected]}),
        );
        let parts = &d["messages"][0]["content_parts"];
        assert_eq!(parts[0]["injected"], "system-reminder");
        assert_eq!(parts[1]["text"], "\ngo");
        assert!(d["messages"].as_array().unwrap().len() == 1 && d["added"] == 1);
        // A string input is one user message.
        let s = requests(Api::OpenAiResponses, &json!({"input": "x"}), &json!({"input": "y"}));
        assert_eq!((s["added"].as_u64(), s["removed"].as_u64()), (Some(1), Some(1)));
    }

    #[test]
    fn alignment_matches_common_ends_and_the_longest_common_middle() {
        let a = ["u", "x", "y", "z", "e"];
        let b = ["u", "y", "q", "z", "e"];
        assert_eq!(
            align(&a, &b, |x, y| x == y),
            vec![
                (Some(0), Some(0)),
                (Some(1), None),
                (Some(2), Some(1)),
                (None, Some(2)),
                (Some(3), Some(3)),
                (Some(4), Some(4)),
            ]
        );
        assert_eq!(align::<&str>(&[], &["a"], |x, y| x == y), vec![(None, Some(0))]);
        assert_eq!(align(&["a"], &["a"], |x, y| x == y), vec![(Some(0), Some(0))]);
    }
}
