//! Where a new root comes from: a sub-agent started by another trajectory's tool call (handoff, Task,
//! transfer), the continuation of a trajectory after context compaction, or the run a compaction call summarizes.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::model::call::{NormalizedCall, Part, Role};
use crate::model::exchange::UnixMicros;
use crate::model::step::{Purpose, StepToolCall};

use super::identity::{CallIds, system_prompt_hash};
use super::prefix;
use super::state::{ParentLink, State};

/// Argument values shorter than this are too common to identify a sub-agent by, even for a delegation tool.
const MIN_ARG_MATCH_LEN: usize = 6;
/// A first user turn at least this long found inside a call's arguments means the call started it.
const MIN_PROMPT_MATCH_LEN: usize = 16;
/// How many of the most recent open candidate calls a new root is compared with.
const MAX_PARENT_CANDIDATES: usize = 64;
/// Any tool's argument this long appearing verbatim in a new root's prompt means the call started it.
const MIN_LONG_ARG_LEN: usize = 24;
/// Name fragments of tools that start other agents (Claude Code `Task`, ADK `transfer_to_agent`, handoffs).
const DELEGATION_TOOL_WORDS: &[&str] = &["task", "agent", "transfer", "handoff", "delegate", "spawn", "dispatch"];
/// Argument names that say which agent a delegation starts, most specific first.
const ROLE_ARGS: &[&str] = &["subagent_type", "agent_name", "agent", "assistant", "name"];
/// A compaction summary is a real summary, not a one-line question that happens to say "summarize".
const COMPACTION_MIN_CHARS: usize = 200;

/// Open tool calls that could have started a sub-agent, newest last. Bounded by the open calls: a call leaves
/// when its result arrives or its trajectory closes.
#[derive(Default)]
pub struct ParentCandidates {
    by_time: BTreeMap<(UnixMicros, u64), String>,
    by_call: HashMap<String, ((UnixMicros, u64), Candidate)>,
    /// Orders calls that end in the same microsecond.
    seq: u64,
}

struct Candidate {
    owner: String,
    /// String arguments long enough to identify a prompt by.
    leaves: Vec<String>,
    delegating: bool,
}

impl ParentCandidates {
    /// Remember a call if it could start a sub-agent: a delegation tool, or any argument long enough to be a
    /// prompt.
    pub fn add(&mut self, call_id: &str, owner: &str, tool_name: &str, args: &Value, at: UnixMicros) {
        let delegating = is_delegation_tool(tool_name);
        let leaves: Vec<String> = string_leaves(args)
            .into_iter()
            .filter(|s| s.len() >= MIN_ARG_MATCH_LEN)
            .collect();
        if !delegating && !leaves.iter().any(|s| s.len() >= MIN_PROMPT_MATCH_LEN) {
            return;
        }
        self.seq += 1;
        let key = (at, self.seq);
        self.by_time.insert(key, call_id.to_owned());
        let candidate = Candidate {
            owner: owner.to_owned(),
            leaves,
            delegating,
        };
        if let Some((old, _)) = self.by_call.insert(call_id.to_owned(), (key, candidate)) {
            self.by_time.remove(&old);
        }
    }

    pub fn remove(&mut self, call_id: &str) {
        if let Some((key, _)) = self.by_call.remove(call_id) {
            self.by_time.remove(&key);
        }
    }

    /// The most recent call of another trajectory whose arguments and the new root's prompt contain each
    /// other. A sub-agent starts right after its parent's call, so only the newest candidates are examined
    /// (bounded work per new root).
    fn matching(&self, traj_id: &str, first_user: &str, system: &str) -> Option<(&str, &str, bool)> {
        for call_id in self.by_time.values().rev().take(MAX_PARENT_CANDIDATES) {
            let Some((_, c)) = self.by_call.get(call_id) else {
                continue;
            };
            if c.owner != traj_id && c.matches(first_user, system) {
                return Some((c.owner.as_str(), call_id.as_str(), c.delegating));
            }
        }
        None
    }
}

impl Candidate {
    /// An argument appears in the first user turn or system prompt, or the first user turn in an argument.
    fn matches(&self, first_user: &str, system: &str) -> bool {
        let arg_hit = self.leaves.iter().any(|s| {
            let long_enough = s.len() >= MIN_LONG_ARG_LEN || (self.delegating && s.len() >= MIN_ARG_MATCH_LEN);
            long_enough && (first_user.contains(s.as_str()) || system.contains(s.as_str()))
        });
        arg_hit || (first_user.len() >= MIN_PROMPT_MATCH_LEN && self.leaves.iter().any(|s| s.contains(first_user)))
    }
}

impl State {
    /// For a new root: the outstanding tool call that started it, if any.
    pub fn find_parent(&self, traj_id: &str, call: &NormalizedCall) -> Option<ParentLink> {
        if let Some((owner, call_id)) = self.handoff(traj_id, call) {
            return self.parent_link(owner, call_id, true);
        }
        let first_user = first_user_text(call).unwrap_or_default();
        let system = call.system.as_deref().unwrap_or("");
        let (owner, call_id, delegated) = self.candidates.matching(traj_id, first_user.trim(), system)?;
        self.parent_link(owner, call_id, delegated)
    }

    /// A handoff: the new root's request carries a call id owned by another trajectory.
    fn handoff<'a>(&'a self, traj_id: &str, call: &'a NormalizedCall) -> Option<(&'a str, &'a str)> {
        let ids = call.messages.iter().flat_map(|m| &m.parts).filter_map(|p| match p {
            Part::ToolCall(c) => Some(c.id.as_str()),
            Part::ToolResult { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        });
        for id in ids {
            if let Some(owner) = self.call_owner.get(id).filter(|o| *o != traj_id) {
                return Some((owner.as_str(), id));
            }
        }
        None
    }

    fn parent_link(&self, owner: &str, call_id: &str, delegated: bool) -> Option<ParentLink> {
        let t = self.trajectories.get(owner)?;
        let idx = *t.open_calls.get(call_id)?;
        let tc = t
            .steps
            .get(&idx)?
            .tool_calls
            .iter()
            .find(|c| c.tool_call_id == call_id)?;
        Some(ParentLink {
            trajectory_id: owner.to_owned(),
            step_index: idx,
            tool_call_id: call_id.to_owned(),
            agent_role: Some(agent_role(tc)),
            delegated,
        })
    }

    /// Compaction: a new root in the same session, with the same system prompt as an open trajectory, whose
    /// first user turn is a summary of the conversation so far, continues that trajectory (the most recently
    /// active one; ties broken by id so every run picks the same).
    pub fn find_compacted(&self, traj_id: &str, scope: &str, call: &NormalizedCall) -> Option<String> {
        if !is_compaction_summary(&first_user_text(call)?) {
            return None;
        }
        let sp_hash = call.system.as_deref().map(system_prompt_hash);
        self.trajectories
            .iter()
            .filter(|(id, t)| {
                *id != traj_id
                    && t.scope == scope
                    && t.last.as_ref().is_some_and(|l| l.system_hash() == sp_hash.as_deref())
            })
            .max_by_key(|(id, t)| (t.last_seen_us, *id))
            .map(|(id, _)| id.clone())
    }

    /// The trajectory a compaction call summarizes, when the resolver found none by root or history: clients
    /// rebuild the history for the summarizing call (Claude Code leaves the context it injects into the first
    /// user turn out, and the call answers the run's open tool calls), so outside a native session nothing but
    /// the conversation itself ties it to its run. That is the open trajectory whose latest answer is the last
    /// assistant turn the call carries (compared with tool call ids where the provider assigns them), of the same
    /// agent; the most recently active, ties broken by id.
    pub fn find_summarized(
        &self,
        traj_id: &str,
        call: &NormalizedCall,
        ids: CallIds,
        agent: Option<&str>,
    ) -> Option<String> {
        let last = call.messages.iter().rev().find(|m| m.role == Role::Assistant)?;
        let echoed = prefix::fingerprint(last, ids);
        self.trajectories
            .iter()
            .filter(|(id, t)| {
                *id != traj_id
                    && matches!(t.purpose, Purpose::Main | Purpose::Subagent)
                    && t.agent() == agent
                    && t.last.as_ref().and_then(|l| l.output_fingerprint()) == Some(echoed)
            })
            .max_by_key(|(id, t)| (t.last_seen_us, *id))
            .map(|(id, _)| id.clone())
    }
}

/// Agents word the summary turn differently; what they share is saying it is a summary ("summary",
/// "summarized") of a conversation that is being continued, and being long.
fn is_compaction_summary(first_user: &str) -> bool {
    let lower = first_user.to_lowercase();
    let summary_like =
        lower.contains("summar") && (lower.contains("continu") || lower.contains("previous conversation"));
    summary_like && first_user.len() >= COMPACTION_MIN_CHARS
}

fn first_user_text(call: &NormalizedCall) -> Option<String> {
    call.messages.iter().find(|m| m.role == Role::User).map(|m| m.text())
}

/// The sub-agent's role: named by an argument, else by a `transfer_to_<agent>` tool name, else the tool.
fn agent_role(tc: &StepToolCall) -> String {
    ROLE_ARGS
        .iter()
        .find_map(|k| tc.input.get(*k).and_then(Value::as_str))
        .or_else(|| tc.tool_name.strip_prefix("transfer_to_"))
        .unwrap_or(&tc.tool_name)
        .to_owned()
}

fn is_delegation_tool(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    DELEGATION_TOOL_WORDS.iter().any(|w| lower.contains(w))
}

fn string_leaves(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().flat_map(string_leaves).collect(),
        Value::Object(o) => o.values().flat_map(string_leaves).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use crate::derive::testkit::*;
    use crate::model::exchange::Api;
    use crate::model::step::CallType;
    use serde_json::json;

    const PROMPT: &str = "Find every caller of parse_token in src/ and list them";

    #[test]
    fn a_new_root_whose_prompt_is_a_delegation_tools_argument_is_its_sub_agent() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let task = tool_call(
            "toolu_t",
            "Task",
            json!({"subagent_type": "explorer", "prompt": PROMPT}),
        );
        let parent = h.send(call(
            "main agent",
            vec![user("refactor parse_token")],
            calls_out(&[task]),
        ));
        let child = h.send(call("explorer agent", vec![user(PROMPT)], text_out("3 callers")));
        assert_ne!(child.trajectory_id, parent.trajectory_id);
        let s = child.agent();
        assert_eq!(s.call_type, Some(CallType::Subagent));
        assert_eq!(s.parent_trajectory_id.as_deref(), Some(parent.trajectory_id.as_str()));
        assert_eq!(s.parent_step, Some(1));
        assert_eq!(s.parent_tool_call_id.as_deref(), Some("toolu_t"));
        assert_eq!(s.agent_role.as_deref(), Some("explorer"));
        assert_eq!(child.summary.parent_trajectory_id, s.parent_trajectory_id);
        // The child's later calls stay sub-agent steps.
        let again = h.send(call(
            "explorer agent",
            vec![user(PROMPT), assistant("3 callers"), user("and tests?")],
            text_out("none"),
        ));
        assert_eq!(again.trajectory_id, child.trajectory_id);
        assert_eq!(again.agent().call_type, Some(CallType::Subagent));
    }

    #[test]
    fn a_short_argument_of_an_ordinary_tool_starts_nothing() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let grep = tool_call("toolu_g", "grep", json!({"pattern": "parse_token"}));
        h.send(call(
            "main agent",
            vec![user("refactor parse_token")],
            calls_out(&[grep]),
        ));
        let other = h.send(call("", vec![user("what is parse_token for?")], text_out("tokens")));
        assert_eq!(other.agent().call_type, Some(CallType::Main));
        assert_eq!(other.agent().parent_trajectory_id, None);
        assert_eq!(other.agent().agent_role.as_deref(), Some("main"));
    }

    #[test]
    fn a_handoff_carrying_the_parents_call_id_links_to_it() {
        let mut h = Harness::new(Api::OpenAiResponses);
        let handoff = tool_call("call_h", "transfer_to_recipe_editor", json!({}));
        let parent = h.send(call(
            "triage",
            vec![user("make it vegan")],
            calls_out(std::slice::from_ref(&handoff)),
        ));
        let child = h.send(call(
            "recipe editor",
            vec![
                user("make it vegan"),
                calls(&[handoff]),
                result("call_h", "{\"assistant\": \"editor\"}"),
            ],
            text_out("done"),
        ));
        assert_ne!(child.trajectory_id, parent.trajectory_id);
        assert_eq!(child.agent().agent_role.as_deref(), Some("recipe_editor"));
        assert_eq!(child.agent().parent_step, Some(1));
        // The handoff's result is the parent step's observation.
        assert_eq!(child.steps[0].step_id, format!("{}/1", parent.trajectory_id));
        assert_eq!(child.steps[0].observations[0].source_call_id, "call_h");
    }

    #[test]
    fn a_summary_of_the_previous_conversation_continues_that_trajectory() {
        let mut h = Harness::new(Api::AnthropicMessages);
        h.session = Some("s1".into());
        let before = h.send(call("coder", vec![user("port the parser")], text_out("ok")));
        let summary = format!(
            "This session is being continued from a previous conversation that ran out of context. The \
             conversation is summarized below: {}",
            "the user asked to port the parser; the lexer is done, the tests fail on tokens. ".repeat(3)
        );
        let after = h.send(call("coder", vec![user(&summary)], text_out("continuing")));
        assert_ne!(after.trajectory_id, before.trajectory_id);
        assert_eq!(after.summary.continues.as_deref(), Some(before.trajectory_id.as_str()));
        // Too short to be a summary, or another system prompt: a new conversation.
        let short = h.send(call("coder", vec![user("summarize and continue")], text_out("?")));
        assert_eq!(short.summary.continues, None);
        let other = h.send(call("reviewer", vec![user(&format!("{summary} "))], text_out("?")));
        assert_eq!(other.summary.continues, None);
    }

    #[test]
    fn a_one_shot_call_quoting_an_ordinary_tools_argument_is_a_side_call() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let bash = tool_call(
            "toolu_b",
            "Bash",
            json!({"command": "cargo test --workspace --all-features"}),
        );
        let parent = h.send(call("main agent", vec![user("run the tests")], calls_out(&[bash])));
        let summary = h.send(call(
            "Summarize the command output.",
            vec![user("Command: cargo test --workspace --all-features\nOutput: 3 passed")],
            text_out("3 tests passed"),
        ));
        let s = summary.agent();
        assert_eq!(s.purpose, Some(crate::model::step::Purpose::Side));
        assert_eq!(s.call_type, Some(CallType::Main));
        assert_eq!(s.agent_role.as_deref(), Some("side"));
        assert_eq!(s.parent_trajectory_id.as_deref(), Some(parent.trajectory_id.as_str()));
        assert_eq!(
            summary.summary.session_id.as_deref(),
            Some(parent.trajectory_id.as_str())
        );
    }

    #[test]
    fn agent_role_comes_from_arguments_then_tool_name() {
        let tc = |name: &str, input| crate::model::step::StepToolCall {
            tool_call_id: "c".into(),
            tool_name: name.into(),
            input,
            duration_ms: None,
        };
        assert_eq!(
            super::agent_role(&tc("Task", json!({"subagent_type": "explorer", "name": "x"}))),
            "explorer"
        );
        assert_eq!(
            super::agent_role(&tc("transfer_to_weather_agent", json!({}))),
            "weather_agent"
        );
        assert_eq!(super::agent_role(&tc("delegate", json!({"agent": 3}))), "delegate");
    }
}
