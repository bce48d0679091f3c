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

use std::collections::{HashMap, VecDeque};

use super::hash_memo::short_hash;
use crate::model::call::{Message, NormalizedCall, Output, Part, Role, ToolCall};
use crate::model::exchange::Api;

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
    /// First user turn + first assistant turn only (no scope, no system prompt): what a resumed conversation
    /// shares with the trajectory it continues.
    pub history: String,
    /// Hash of the system prompt (in the root key only outside a native session).
    pub system: String,
    /// The request already contains an assistant turn (this is not the conversation's first call).
    pub has_assistant: bool,
    pub first_user_text: String,
}

/// The root keys of a call. `scope` is the native session (empty when none): within a session the system prompt
/// is left out of the key, so a resumed conversation whose system prompt changed keeps its trajectory id; without
/// a session the system prompt separates agents that start alike.
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
    let system = if scope.is_empty() {
        call.system.as_deref().unwrap_or("").trim()
    } else {
        ""
    };
    let prefix = short_hash(format!("{scope}\u{1}{system}\u{1}{first_user}").as_bytes());
    let root = short_hash(format!("{prefix}\u{1}{assistant}").as_bytes());
    let history = short_hash(format!("{first_user}\u{1}{assistant}").as_bytes());
    RootKeys {
        prefix,
        root,
        history,
        system: short_hash(call.system.as_deref().unwrap_or("").trim().as_bytes()),
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

/// How many runs of one root this process remembers after they closed (so a fresh root after the earlier one
/// closed still gets a new id); the oldest are forgotten first.
const MAX_REMEMBERED_ROOTS: usize = 100_000;

/// Where a call belongs.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub id: String,
    /// For a compaction call: the trajectory whose history it summarizes.
    pub summarizes: Option<String>,
}

impl Resolved {
    fn to(id: String) -> Resolved {
        Resolved { id, summarizes: None }
    }
}

/// One open run of a root: the trajectory and the message count of its latest call.
struct Run {
    id: String,
    last_len: usize,
    /// The system prompt hash of the run's latest call: a request under another system prompt that answers a
    /// call still open in the run is a handoff to another agent (which starts with its parent's history), not
    /// the run's next call.
    system: String,
}

/// The cross-call part of identity: native conversation chains, retries of a failed first call, repeated runs
/// of the same root, and resumed conversations.
///
/// Every map below names trajectories; `held` indexes them the other way (trajectory → the keys that name
/// it), so that closing a trajectory costs what it holds, not a scan of every map. A flood of identical calls
/// keeps up to the open-trajectory limit of runs under one root; their lists are queues in start order (the
/// oldest run, usually the first to close, is at the front) and a new run is appended without searching.
#[derive(Default)]
pub struct Resolver {
    /// Response id → trajectory, for `previous_response_id` chains.
    response_owner: HashMap<String, String>,
    /// Root key → trajectory id, when a root was adopted by an earlier trajectory (retry after failure, resume).
    aliases: HashMap<String, String>,
    /// Prefix key → trajectory id of a first call that failed before producing a turn.
    failed_roots: HashMap<String, String>,
    /// Root key → its open runs, oldest first.
    runs: HashMap<String, VecDeque<Run>>,
    /// Root key → how many runs of it started (kept after they close, bounded by `MAX_REMEMBERED_ROOTS`).
    started: HashMap<String, u32>,
    started_order: VecDeque<String>,
    /// History key → open trajectories (id, agent) that started with that history.
    history: HashMap<String, VecDeque<(String, Option<String>)>>,
    /// Trajectory id → the keys under which the maps above name it.
    held: HashMap<String, Vec<Held>>,
}

/// A key under which one of the resolver's maps names a trajectory.
enum Held {
    Response(String),
    Alias(String),
    FailedRoot(String),
    Run(String),
    History(String),
}

impl Resolver {
    /// The trajectory `call` belongs to. `scope` is the native session (empty when none), `agent` the
    /// `x-llmtap-agent` name; `is_open` says whether this process has a trajectory open under an id.
    pub fn resolve(
        &mut self,
        scope: &str,
        agent: Option<&str>,
        call: &NormalizedCall,
        ids: CallIds,
        is_open: impl Fn(&str) -> bool,
    ) -> Resolved {
        self.resolve_with(scope, agent, call, ids, is_open, |_| true)
    }

    /// `resolve`, where `may_resume(id)` says whether the call may continue open trajectory `id` by history
    /// alone (the deriver refuses when the request answers a call still open in `id`: that is a handoff, whose
    /// target starts with its parent's history).
    pub fn resolve_with(
        &mut self,
        scope: &str,
        agent: Option<&str>,
        call: &NormalizedCall,
        ids: CallIds,
        is_open: impl Fn(&str) -> bool,
        may_resume: impl Fn(&str) -> bool,
    ) -> Resolved {
        if let Some(id) = self.native_id(call) {
            return Resolved::to(id);
        }
        let keys = root_keys(scope, call, ids);
        if is_warmup(call) {
            return Resolved::to(trajectory_id_of("warmup", &keys.root));
        }
        let len = call.messages.len();
        if is_compaction_request(call) {
            // Its own one-call trajectory, linked to the one it summarizes (never a step of it). It may answer
            // the run's open tool calls (auto-compaction inside a tool loop): that is not a handoff here.
            let summarizes = self.find_continued(&keys, len, agent, false, &|_: &str| true);
            let id = trajectory_id_of("compaction", &format!("{}\u{1}{len}", keys.root));
            return Resolved { id, summarizes };
        }
        if let Some(t) = self.aliases.get(&keys.root) {
            return Resolved::to(t.clone());
        }
        if !keys.has_assistant {
            return Resolved::to(self.resolve_root_call(&keys, call, len, agent, is_open));
        }
        if let Some(id) = self.find_continued(&keys, len, agent, true, &may_resume) {
            return Resolved::to(id);
        }
        // The first answer failed but the client kept what it got (a broken tool call, an error text) and went on.
        if let Some(failed) = self.failed_roots.remove(&keys.prefix)
            && is_open(&failed)
        {
            self.alias(&keys.root, &failed);
            self.open_run(&keys, &failed, len, agent);
            return Resolved::to(failed);
        }
        // Runs of this root are open but none may take the call: it answers a call still open in them under
        // another system prompt, a handoff to another agent that starts with its parent's history (inside a
        // native session the root key leaves the system prompt out). Named by its root and its own system prompt.
        if self.runs.get(&keys.root).is_some_and(|runs| !runs.is_empty()) {
            let id = trajectory_id_of("handoff", &format!("{}\u{1}{}", keys.root, keys.system));
            self.open_run(&keys, &id, len, agent);
            return Resolved::to(id);
        }
        // A conversation this process did not see start (another replica, a restart, a mid-conversation
        // handoff): named by its root, like its first run.
        let id = self.run_id(&keys.root, self.started.get(&keys.root).copied().unwrap_or(1).max(1));
        self.open_run(&keys, &id, len, agent);
        Resolved::to(id)
    }

    /// A request without assistant turns: the first call of a conversation. A failed first call is adopted by
    /// its retry; otherwise every root call starts a new run (two runs that start alike are two trajectories).
    fn resolve_root_call(
        &mut self,
        keys: &RootKeys,
        call: &NormalizedCall,
        len: usize,
        agent: Option<&str>,
        is_open: impl Fn(&str) -> bool,
    ) -> String {
        if let Some(failed) = self.failed_roots.get(&keys.prefix).filter(|f| is_open(f)).cloned() {
            if !output_is_empty(&call.output) {
                self.failed_roots.remove(&keys.prefix);
                self.alias(&keys.root, &failed);
                self.open_run(keys, &failed, len, agent);
            }
            return failed;
        }
        let n = self.started.get(&keys.root).copied().unwrap_or(0) + 1;
        self.remember_started(&keys.root, n);
        let id = self.run_id(&keys.root, n);
        if output_is_empty(&call.output) {
            // A first call that produced no turn: remember it so its retry joins the same trajectory.
            self.hold(&id, Held::FailedRoot(keys.prefix.clone()));
            self.failed_roots.insert(keys.prefix.clone(), id.clone());
        }
        self.open_new_run(keys, &id, len, agent);
        id
    }

    /// The open trajectory a continuing request extends: a run of its root (the one whose last call this
    /// request extends, the longest such; the oldest among equals, so identical concurrent runs advance in
    /// turn; a repeat of the last call is a retry), else a trajectory that started with the same history for the
    /// same agent (a resumed conversation whose system prompt or session changed). With `adopt`, the match is
    /// recorded so the next calls find it directly.
    fn find_continued(
        &mut self,
        keys: &RootKeys,
        len: usize,
        agent: Option<&str>,
        adopt: bool,
        may_resume: &impl Fn(&str) -> bool,
    ) -> Option<String> {
        if let Some(runs) = self.runs.get_mut(&keys.root) {
            let candidate = |r: &Run| r.system == keys.system || may_resume(&r.id);
            let extends = runs
                .iter()
                .enumerate()
                .filter(|(_, r)| r.last_len < len && candidate(r))
                .max_by_key(|(i, r)| (r.last_len, std::cmp::Reverse(*i)))
                .map(|(i, _)| i);
            let pick = extends
                .or_else(|| runs.iter().position(|r| r.last_len == len && candidate(r)))
                .or_else(|| runs.iter().rposition(candidate));
            if let Some(i) = pick {
                if adopt {
                    runs[i].last_len = len;
                    runs[i].system = keys.system.clone();
                }
                return Some(runs[i].id.clone());
            }
        }
        let id = self
            .history
            .get(&keys.history)?
            .iter()
            .rev()
            .find(|(id, a)| a.as_deref() == agent && may_resume(id))
            .map(|(id, _)| id.clone())?;
        if adopt {
            self.alias(&keys.root, &id);
        }
        Some(id)
    }

    fn run_id(&self, root: &str, n: u32) -> String {
        if n <= 1 {
            format!("tr_{root}")
        } else {
            trajectory_id_of("run", &format!("{root}#{n}"))
        }
    }

    /// Record that open trajectory `id` runs under `keys` (it may already).
    fn open_run(&mut self, keys: &RootKeys, id: &str, len: usize, agent: Option<&str>) {
        let runs = self.runs.entry(keys.root.clone()).or_default();
        match runs.iter_mut().find(|r| r.id == id) {
            Some(r) => {
                r.last_len = r.last_len.max(len);
                r.system = keys.system.clone();
            }
            None => {
                runs.push_back(Run {
                    id: id.to_owned(),
                    last_len: len,
                    system: keys.system.clone(),
                });
                self.hold(id, Held::Run(keys.root.clone()));
            }
        }
        let seen = self.history.entry(keys.history.clone()).or_default();
        if !seen.iter().any(|(t, _)| t == id) {
            seen.push_back((id.to_owned(), agent.map(str::to_owned)));
            self.hold(id, Held::History(keys.history.clone()));
        }
    }

    /// `open_run` for an id that was just made and so is in no list yet: appended without a search.
    fn open_new_run(&mut self, keys: &RootKeys, id: &str, len: usize, agent: Option<&str>) {
        self.runs.entry(keys.root.clone()).or_default().push_back(Run {
            id: id.to_owned(),
            last_len: len,
            system: keys.system.clone(),
        });
        self.history
            .entry(keys.history.clone())
            .or_default()
            .push_back((id.to_owned(), agent.map(str::to_owned)));
        // Extended, not replaced: a root whose run count was forgotten names its first run again, which may
        // still be open; each entry appended above has its own key here, so closing removes both.
        self.held
            .entry(id.to_owned())
            .or_default()
            .extend([Held::Run(keys.root.clone()), Held::History(keys.history.clone())]);
    }

    fn hold(&mut self, id: &str, key: Held) {
        self.held.entry(id.to_owned()).or_default().push(key);
    }

    fn alias(&mut self, root: &str, id: &str) {
        if self.aliases.insert(root.to_owned(), id.to_owned()).as_deref() != Some(id) {
            self.hold(id, Held::Alias(root.to_owned()));
        }
    }

    fn remember_started(&mut self, root: &str, n: u32) {
        if self.started.insert(root.to_owned(), n).is_none() {
            self.started_order.push_back(root.to_owned());
            if self.started_order.len() > MAX_REMEMBERED_ROOTS
                && let Some(old) = self.started_order.pop_front()
            {
                self.started.remove(&old);
            }
        }
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
        let previous = self
            .response_owner
            .insert(response_id.to_owned(), trajectory_id.to_owned());
        if previous.as_deref() != Some(trajectory_id) {
            self.hold(trajectory_id, Held::Response(response_id.to_owned()));
        }
    }

    /// A closed trajectory is never resolved to again through cross-call state (its run count is kept). Only
    /// the keys that name it are visited; a key another trajectory took over since stays with that one.
    pub fn forget(&mut self, trajectory_id: &str) {
        let Some(keys) = self.held.remove(trajectory_id) else {
            return;
        };
        fn remove_owned(map: &mut HashMap<String, String>, key: &str, id: &str) {
            if map.get(key).is_some_and(|owner| owner == id) {
                map.remove(key);
            }
        }
        for key in keys {
            match key {
                Held::Response(k) => remove_owned(&mut self.response_owner, &k, trajectory_id),
                Held::Alias(k) => remove_owned(&mut self.aliases, &k, trajectory_id),
                Held::FailedRoot(k) => remove_owned(&mut self.failed_roots, &k, trajectory_id),
                Held::Run(k) => remove_from_queue(&mut self.runs, &k, |r| r.id == trajectory_id),
                Held::History(k) => remove_from_queue(&mut self.history, &k, |(t, _)| t == trajectory_id),
            }
        }
    }
}

/// Remove the first entry of `map[key]` that `is_it` picks (the oldest, which is the one usually closed),
/// and the key once its queue is empty.
fn remove_from_queue<T>(map: &mut HashMap<String, VecDeque<T>>, key: &str, is_it: impl Fn(&T) -> bool) {
    if let Some(queue) = map.get_mut(key) {
        if let Some(i) = queue.iter().position(is_it) {
            queue.remove(i);
        }
        if queue.is_empty() {
            map.remove(key);
        }
    }
}

/// Context compaction (Claude Code's `/compact` and auto-compact): a request that carries a conversation's
/// history (at least one assistant turn) and ends with a user turn asking for a summary of the conversation,
/// under a system prompt about summarizing. Text is the only signal the protocol gives, so both the instruction
/// and the system prompt must say so.
pub fn is_compaction_request(call: &NormalizedCall) -> bool {
    let Some(last) = call.messages.last() else {
        return false;
    };
    if last.role != Role::User || !call.messages.iter().any(|m| m.role == Role::Assistant) {
        return false;
    }
    let ask = last.text().to_lowercase();
    let system = call.system.as_deref().unwrap_or("").to_lowercase();
    ask.contains("summary") && ask.contains("conversation") && system.contains("summar")
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
        let by_conv = r.resolve("", None, &c, CallIds::Stable, |_| false).id;
        assert_eq!(by_conv, format!("tr_{}", short_hash("conv\u{1}conv_1".as_bytes())));
        c.conversation_id = None;
        c.previous_response_id = Some("resp_9".into());
        // An unknown previous response is named by itself; a known one by its trajectory.
        assert_eq!(
            r.resolve("", None, &c, CallIds::Stable, |_| false).id,
            format!("tr_{}", short_hash("resp\u{1}resp_9".as_bytes()))
        );
        r.remember_response("resp_9", "tr_owner");
        assert_eq!(r.resolve("", None, &c, CallIds::Stable, |_| false).id, "tr_owner");
        r.forget("tr_owner");
        assert_ne!(r.resolve("", None, &c, CallIds::Stable, |_| false).id, "tr_owner");
    }

    #[test]
    fn a_retry_of_a_failed_first_call_joins_its_trajectory() {
        let mut r = Resolver::default();
        let failed = call("sys", vec![user("task")], Output::default());
        let failed_id = r.resolve("", None, &failed, CallIds::Stable, |_| false).id;
        assert_eq!(
            failed_id,
            format!("tr_{}", root_keys("", &failed, CallIds::Stable).root)
        );
        let retry = call("sys", vec![user("task")], text_out("answer"));
        let open = failed_id.clone();
        assert_eq!(
            r.resolve("", None, &retry, CallIds::Stable, |id| id == open).id,
            failed_id
        );
        // Later calls echo the retry's answer: the alias keeps them in the failed call's trajectory.
        let later = call(
            "sys",
            vec![user("task"), assistant("answer"), user("more")],
            text_out("x"),
        );
        assert_eq!(
            r.resolve("", None, &later, CallIds::Stable, |id| id == open).id,
            failed_id
        );
    }

    #[test]
    fn a_warmup_is_its_own_trajectory() {
        let mut r = Resolver::default();
        let mut c = call("sys", vec![user("task")], text_out("a"));
        let real = r.resolve("", None, &c, CallIds::Stable, |_| false).id;
        c.max_output_tokens = Some(1);
        assert!(is_warmup(&c));
        let warm = r.resolve("", None, &c, CallIds::Stable, |_| false).id;
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

    #[test]
    fn closing_every_run_leaves_no_state_behind_and_a_taken_over_key_stays() {
        let mut r = Resolver::default();
        let c = call("sys", vec![user("task")], text_out("a"));
        let ids: Vec<String> = (0..500)
            .map(|_| r.resolve("", None, &c, CallIds::Stable, |_| false).id)
            .collect();
        assert_eq!(
            ids.iter().collect::<std::collections::HashSet<_>>().len(),
            500,
            "identical root calls are separate runs"
        );
        r.remember_response("resp_1", &ids[0]);
        r.remember_response("resp_1", &ids[1]);
        r.alias("root_x", &ids[2]);
        for id in &ids[..450] {
            if id != &ids[1] {
                r.forget(id);
            }
        }
        assert_eq!(
            r.response_owner.get("resp_1"),
            Some(&ids[1]),
            "taken over by another run"
        );
        assert_eq!(r.runs.values().map(VecDeque::len).sum::<usize>(), 51);
        for id in &ids {
            r.forget(id);
        }
        assert!(r.response_owner.is_empty() && r.aliases.is_empty() && r.failed_roots.is_empty());
        assert!(r.runs.is_empty() && r.history.is_empty() && r.held.is_empty());
        // The run count is kept: the next identical call is run 501, not a reuse of a closed id.
        let next = r.resolve("", None, &c, CallIds::Stable, |_| false).id;
        assert!(!ids.contains(&next));
    }
}
