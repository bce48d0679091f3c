//! Trajectory identity: which trajectory a call belongs to.
//!
//! A trajectory is keyed by its root: the session scope (explicit `x-llmtap-session`, else empty), the system
//! prompt, the first user turn and the first assistant turn. Call 1 of a conversation has no assistant turn in
//! its request, so it uses its own output; every later call finds that same turn echoed back in its request.
//! Every replica therefore computes the same id for the same conversation without coordination.
//! Echoes are imperfect (thinking dropped, arguments re-serialized, whitespace), so keys use tool call ids when
//! there are any (the strongest join key) and trimmed text otherwise, never reasoning or signatures.
//!
//! Every hash in an id is SHA-256 (`model::short_hash`) of text or of `stable_hash`'s canonical bytes, so ids
//! are the same on every platform and version. Before this was so, a Gemini tool call (whose id the client
//! invents) was keyed by FxHash of its arguments: trajectories whose first assistant turn is a Gemini tool call
//! get a different id than stores written by earlier versions gave them (a conversation that spans the upgrade
//! is split in two; nothing else changes).

use std::collections::HashMap;

use crate::model::call::{Message, NormalizedCall, Output, Part, Role, ToolCall};
use crate::model::exchange::Api;
use crate::model::short_hash;

use super::stable_hash::json_digest;

/// Calls with at most this many output tokens allowed are cache-priming / quota probes.
const WARMUP_MAX_TOKENS: u64 = 1;

/// `sp_` + 16 hex of SHA-256 of the system text.
pub fn system_prompt_hash(text: &str) -> String {
    format!("sp_{}", short_hash(text.trim().as_bytes()))
}

/// A priming/quota probe: its output is never used, so it is never a step of the real conversation.
pub fn is_warmup(call: &NormalizedCall) -> bool {
    call.max_output_tokens.is_some_and(|m| m <= WARMUP_MAX_TOKENS)
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

pub use crate::model::call::CallIds;

impl CallIds {
    pub fn of(api: Api) -> CallIds {
        crate::provider::call_ids(api)
    }
}

/// A tool call as identity sees it: its id, or `name#<json_digest of the arguments>` where ids are invented.
fn call_key(c: &ToolCall, ids: CallIds) -> String {
    match ids {
        CallIds::Stable if !c.id.is_empty() => c.id.clone(),
        _ => format!("{}#{}", c.name, json_digest(&c.arguments)),
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

fn trajectory_id_of(kind: &str, key: &str) -> String {
    format!("tr_{}", short_hash(format!("{kind}\u{1}{key}").as_bytes()))
}

/// The cross-call part of identity: native conversation chains and retries of a failed first call.
#[derive(Default)]
pub struct Resolver {
    /// Response id → trajectory, for `previous_response_id` chains.
    response_owner: HashMap<String, String>,
    /// Root key → trajectory id, when a root was adopted by an earlier trajectory (retry after failure).
    aliases: HashMap<String, String>,
    /// Prefix key → trajectory id of a first call that failed before producing a turn.
    failed_roots: HashMap<String, String>,
}

impl Resolver {
    /// The trajectory `call` belongs to. `scope` is the explicit session (empty when none); `is_open` says
    /// whether this process has a trajectory open under an id.
    pub fn resolve(
        &mut self,
        scope: &str,
        call: &NormalizedCall,
        ids: CallIds,
        is_open: impl Fn(&str) -> bool,
    ) -> String {
        if let Some(id) = self.native_id(call) {
            return id;
        }
        let keys = root_keys(scope, call, ids);
        if is_warmup(call) {
            return trajectory_id_of("warmup", &keys.root);
        }
        if let Some(t) = self.aliases.get(&keys.root) {
            return t.clone();
        }
        let id = format!("tr_{}", keys.root);
        if is_open(&id) {
            return id;
        }
        // A first call that produced no turn: remember it so its retry joins the same trajectory.
        if !keys.has_assistant && output_is_empty(&call.output) {
            self.failed_roots.insert(keys.prefix, id.clone());
            return id;
        }
        if let Some(failed) = self.failed_roots.remove(&keys.prefix)
            && is_open(&failed)
        {
            self.aliases.insert(keys.root, failed.clone());
            return failed;
        }
        id
    }

    /// Server-side conversation state (OpenAI Responses): the provider's own ids name the conversation.
    fn native_id(&self, call: &NormalizedCall) -> Option<String> {
        if let Some(prev) = &call.previous_response_id {
            let known = self.response_owner.get(prev).cloned();
            return Some(known.unwrap_or_else(|| trajectory_id_of("resp", prev)));
        }
        call.conversation_id.as_ref().map(|c| trajectory_id_of("conv", c))
    }

    pub fn remember_response(&mut self, response_id: &str, trajectory_id: &str) {
        self.response_owner
            .insert(response_id.to_owned(), trajectory_id.to_owned());
    }

    /// A closed trajectory is never resolved to again through cross-call state.
    pub fn forget(&mut self, trajectory_id: &str) {
        self.response_owner.retain(|_, owner| owner != trajectory_id);
        self.aliases.retain(|_, owner| owner != trajectory_id);
        self.failed_roots.retain(|_, owner| owner != trajectory_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::derive::testkit::*;
    use serde_json::json;

    #[test]
    fn call_one_keys_from_its_output_and_call_two_from_the_echo() {
        let first = call("Be brief.", vec![user("Fix the bug")], text_out("Looking."));
        let second = call(
            "Be brief.",
            vec![user("Fix the bug"), assistant("Looking."), user("go on")],
            text_out("Done."),
        );
        let (a, b) = (
            root_keys("", &first, CallIds::Stable),
            root_keys("", &second, CallIds::Stable),
        );
        assert_eq!(a.root, b.root);
        assert_eq!(a.prefix, b.prefix);
        assert!(!a.has_assistant && b.has_assistant);
        assert_eq!(a.first_user_text, "Fix the bug\n");
        // Another first answer is another conversation; another session scope is too.
        let other = call("Be brief.", vec![user("Fix the bug")], text_out("No."));
        assert_ne!(root_keys("", &other, CallIds::Stable).root, a.root);
        assert_ne!(root_keys("s1", &first, CallIds::Stable).root, a.root);
    }

    #[test]
    fn tool_call_ids_are_preferred_over_text() {
        let turn = |text: &str, id: &str| Message {
            role: Role::Assistant,
            parts: vec![
                Part::Text { text: text.into() },
                Part::ToolCall(tool_call(id, "read", json!({"path": "a.rs"}))),
            ],
        };
        let key = |m: &Message| assistant_key(m, CallIds::Stable);
        assert_eq!(key(&turn("Let me read it.", "call_1")), "calls:call_1");
        assert_eq!(
            key(&turn("Reading a.rs", "call_1")),
            key(&turn("Let me read it.", "call_1"))
        );
        assert_ne!(
            key(&turn("Let me read it.", "call_2")),
            key(&turn("Let me read it.", "call_1"))
        );
        assert_eq!(key(&assistant("  Hello \n")), "text:Hello");
    }

    #[test]
    fn echo_imperfections_do_not_change_the_root() {
        let out = Output {
            text: Some("Reading. ".into()),
            reasoning: Some("the user wants a.rs".into()),
            tool_calls: vec![tool_call("c1", "read", json!({"path": "a.rs", "limit": 10}))],
            ..Output::default()
        };
        let echo = Message {
            role: Role::Assistant,
            parts: vec![
                Part::Text {
                    text: "Reading.".into(),
                },
                Part::ToolCall(tool_call("c1", "read", json!({"limit": 10.0, "path": "a.rs"}))),
            ],
        };
        let first = call("", vec![user("read a.rs")], out);
        let second = call(
            "",
            vec![user("read a.rs"), echo, result("c1", "fn a() {}")],
            text_out("ok"),
        );
        for ids in [CallIds::Stable, CallIds::ClientAssigned] {
            assert_eq!(
                root_keys("", &first, ids).root,
                root_keys("", &second, ids).root,
                "{ids:?}"
            );
        }
    }

    #[test]
    fn client_assigned_ids_key_by_name_and_canonical_arguments() {
        let a = tool_call("pyd_ai_1", "get_weather", json!({"city": "Paris"}));
        let b = tool_call("gemini:0:0", "get_weather", json!({"city": "Paris"}));
        assert_eq!(call_key(&a, CallIds::ClientAssigned), "get_weather#a1635b3de2bb6194");
        assert_eq!(
            call_key(&b, CallIds::ClientAssigned),
            call_key(&a, CallIds::ClientAssigned)
        );
        assert_eq!(call_key(&a, CallIds::Stable), "pyd_ai_1");
        assert_eq!(CallIds::of(Api::GeminiGenerateContent), CallIds::ClientAssigned);
        assert_eq!(CallIds::of(Api::AnthropicMessages), CallIds::Stable);
    }

    #[test]
    fn native_ids_name_the_trajectory() {
        let mut r = Resolver::default();
        let mut c = call("", vec![user("hi")], text_out("hello"));
        c.conversation_id = Some("conv_1".into());
        let by_conv = r.resolve("", &c, CallIds::Stable, |_| false);
        assert_eq!(by_conv, format!("tr_{}", short_hash("conv\u{1}conv_1".as_bytes())));
        c.conversation_id = None;
        c.previous_response_id = Some("resp_9".into());
        // An unknown previous response is named by itself; a known one by its trajectory.
        assert_eq!(
            r.resolve("", &c, CallIds::Stable, |_| false),
            format!("tr_{}", short_hash("resp\u{1}resp_9".as_bytes()))
        );
        r.remember_response("resp_9", "tr_owner");
        assert_eq!(r.resolve("", &c, CallIds::Stable, |_| false), "tr_owner");
        r.forget("tr_owner");
        assert_ne!(r.resolve("", &c, CallIds::Stable, |_| false), "tr_owner");
    }

    #[test]
    fn a_retry_of_a_failed_first_call_joins_its_trajectory() {
        let mut r = Resolver::default();
        let failed = call("sys", vec![user("task")], Output::default());
        let failed_id = r.resolve("", &failed, CallIds::Stable, |_| false);
        assert_eq!(
            failed_id,
            format!("tr_{}", root_keys("", &failed, CallIds::Stable).root)
        );
        let retry = call("sys", vec![user("task")], text_out("answer"));
        let open = failed_id.clone();
        assert_eq!(r.resolve("", &retry, CallIds::Stable, |id| id == open), failed_id);
        // Later calls echo the retry's answer: the alias keeps them in the failed call's trajectory.
        let later = call(
            "sys",
            vec![user("task"), assistant("answer"), user("more")],
            text_out("x"),
        );
        assert_eq!(r.resolve("", &later, CallIds::Stable, |id| id == open), failed_id);
    }

    #[test]
    fn a_warmup_is_its_own_trajectory() {
        let mut r = Resolver::default();
        let mut c = call("sys", vec![user("task")], text_out("a"));
        let real = r.resolve("", &c, CallIds::Stable, |_| false);
        c.max_output_tokens = Some(1);
        assert!(is_warmup(&c));
        let warm = r.resolve("", &c, CallIds::Stable, |_| false);
        let root = root_keys("", &c, CallIds::Stable).root;
        assert_eq!(
            warm,
            format!("tr_{}", short_hash(format!("warmup\u{1}{root}").as_bytes()))
        );
        assert_ne!(warm, real);
        c.max_output_tokens = Some(2);
        assert!(!is_warmup(&c));
    }

    #[test]
    fn system_prompt_hash_shape() {
        let h = system_prompt_hash("You are helpful.");
        assert_eq!(h, format!("sp_{}", short_hash(b"You are helpful.")));
        assert_eq!(h, system_prompt_hash("You are helpful.\n"));
    }
}
