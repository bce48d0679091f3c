//! Derivation: provider traces → agent trajectories and steps.
//!
//! The `Deriver` runs on the pipeline thread and owns all cross-call state, so it needs no locks. Most facts
//! are functions of one exchange (see `identity`): trajectory id, step index, user steps. The cross-call facts
//! need the previous calls this process saw:
//! - observations: tool results in request N+1 are joined to the tool calls of step N by call id (globally,
//!   because a handoff carries the parent's call into the child's request), with the time in between as an
//!   upper bound on the tool's duration;
//! - sub-agents: a new root that carries another trajectory's call id (handoff), or whose first user turn or
//!   system prompt contains an argument of another trajectory's outstanding call (Task/transfer tools);
//! - retries: a new root whose first call failed before producing any turn is adopted by the next root with
//!   the same system prompt and first user turn;
//! - prefix reuse: how much of this prompt repeats the previous call's prompt and output.
//!
//! Steps are emitted at once and re-emitted (upserted by `step_id`) when late facts arrive; trajectories close
//! after the idle timeout, when dangling calls get an `error: "no_result"` observation.

pub mod identity;
pub mod snippets;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::capture::{Outcome, UnixMicros};
use crate::config::DeriveConfig;
use crate::model::call::{NormalizedCall, Part, Role};
use crate::model::step::{
    CallType, Observation, Step, StepRole, StepTimings, StepToolCall, TokenUsage, TrajectorySummary,
};
use crate::model::trace::{ProviderTrace, rfc3339};
use crate::pipeline::process::Processed;
use crate::store::Record;
use identity::{
    CallIds, fingerprint, message_bytes, output_as_message, output_is_empty, root_keys, system_prompt_hash,
};

/// Calls with at most this many output tokens allowed are cache-priming / quota probes.
const WARMUP_MAX_TOKENS: u64 = 1;
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
const OUTPUT_SUMMARY_CHARS: usize = 200;
/// A compaction summary is a real summary, not a one-line question that happens to say "summarize".
const COMPACTION_MIN_CHARS: usize = 200;

struct ParentRef {
    trajectory_id: String,
    step_index: u32,
    tool_call_id: String,
    agent_role: Option<String>,
}

/// What the next call of a trajectory is compared with for prefix reuse.
struct LastCall {
    system_hash: Option<String>,
    /// Request messages followed by the output turn.
    fingerprints: Vec<u64>,
    bytes: Vec<usize>,
    input_tokens: u64,
    output_tokens: u64,
}

struct Trajectory {
    summary: TrajectorySummary,
    /// Agent steps that may still receive late facts, by step index.
    steps: BTreeMap<u32, Step>,
    /// Tool call id → step index, for calls still waiting for their result.
    open_calls: HashMap<String, u32>,
    last: Option<LastCall>,
    last_end_us: UnixMicros,
    last_seen_us: UnixMicros,
    next_index: u32,
    /// How many calls were seen at each agent step index (retries repeat an index).
    attempts: HashMap<u32, u32>,
    parent: Option<(String, u32, String, Option<String>)>,
    models: BTreeSet<String>,
    call_types: BTreeSet<&'static str>,
}

/// Open tool calls that could have started a sub-agent, newest last.
#[derive(Default)]
struct ParentCandidates {
    by_time: BTreeMap<(UnixMicros, u64), String>,
    by_call: HashMap<String, ((UnixMicros, u64), Candidate)>,
    seq: u64,
}

struct Candidate {
    owner: String,
    leaves: Vec<String>,
    delegating: bool,
}

impl ParentCandidates {
    /// Remember a call if it could start a sub-agent: a delegation tool, or any argument long enough to be a
    /// prompt.
    fn add(&mut self, call_id: &str, owner: &str, tool_name: &str, args: &serde_json::Value, at: UnixMicros) {
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

    fn remove(&mut self, call_id: &str) {
        if let Some((key, _)) = self.by_call.remove(call_id) {
            self.by_time.remove(&key);
        }
    }
}

pub struct Deriver {
    config: DeriveConfig,
    candidates: ParentCandidates,
    trajectories: HashMap<String, Trajectory>,
    /// Open tool call id → owning trajectory.
    call_owner: HashMap<String, String>,
    /// Response id → trajectory, for `previous_response_id` chains.
    response_owner: HashMap<String, String>,
    /// Root key → trajectory id, when a root was adopted by an earlier trajectory (retry after failure).
    aliases: HashMap<String, String>,
    /// Prefix key → trajectory id of a first call that failed before producing a turn.
    failed_roots: HashMap<String, String>,
}

impl Deriver {
    pub fn new(config: DeriveConfig) -> Deriver {
        Deriver {
            config,
            trajectories: HashMap::new(),
            candidates: ParentCandidates::default(),
            call_owner: HashMap::new(),
            response_owner: HashMap::new(),
            aliases: HashMap::new(),
            failed_roots: HashMap::new(),
        }
    }

    /// Turn one processed exchange into store records: the trace, its steps, updated earlier steps and the
    /// trajectory summary.
    pub fn observe(&mut self, processed: Processed) -> Vec<Record> {
        let Processed { mut trace, call, .. } = processed;
        let Some(call) = call else {
            return vec![Record::Trace(Box::new(trace))];
        };
        let mut out = Vec::new();
        let ids = call_ids(trace.api);
        let traj_id = self.trajectory_id(&trace, &call, ids);
        trace.trajectory_id = Some(traj_id.clone());
        let is_new = !self.trajectories.contains_key(&traj_id);
        let parent = if is_new {
            self.find_parent(&traj_id, &call)
        } else {
            None
        };
        let continues = if is_new && parent.is_none() {
            self.find_compacted(&traj_id, &trace, &call)
        } else {
            None
        };
        let now = trace.timings.start;

        // Observations: tool results anywhere after the last assistant turn answer earlier calls.
        let last_assistant = call.messages.iter().rposition(|m| m.role == Role::Assistant);
        let delta_start = last_assistant.map_or(0, |i| i + 1);
        // Parallel results update the same step: re-emit each updated step once, in its final state.
        let mut updated: Vec<Step> = Vec::new();
        for m in &call.messages[delta_start..] {
            for p in &m.parts {
                if let Part::ToolResult {
                    call_id,
                    name,
                    content,
                    is_error,
                } = p
                    && let Some(step) =
                        self.attach_observation(&traj_id, call_id, name.as_deref(), content, *is_error, now)
                {
                    match updated.iter_mut().find(|s| s.step_id == step.step_id) {
                        Some(existing) => *existing = step,
                        None => updated.push(step),
                    }
                }
            }
        }
        out.extend(updated.into_iter().map(|s| Record::Step(Box::new(s))));

        let traj = self.trajectories.entry(traj_id.clone()).or_insert_with(|| Trajectory {
            summary: TrajectorySummary {
                trajectory_id: traj_id.clone(),
                session_id: trace.meta.session.clone(),
                agent: trace.meta.agent.clone(),
                started_at: rfc3339(trace.timings.start),
                continues,
                ..TrajectorySummary::default()
            },
            steps: BTreeMap::new(),
            open_calls: HashMap::new(),
            last: None,
            last_end_us: 0,
            last_seen_us: now,
            next_index: 0,
            attempts: HashMap::new(),
            parent: parent.map(|p| (p.trajectory_id, p.step_index, p.tool_call_id, p.agent_role)),
            models: BTreeSet::new(),
            call_types: BTreeSet::new(),
        });

        // Step indexes: from the request itself (replica-independent), except for server-side conversation
        // state where the request carries only the new turn.
        let native_chain = call.previous_response_id.is_some() || call.conversation_id.is_some();
        let mut index: u32 = if native_chain { traj.next_index } else { 0 };
        let mut user_steps = Vec::new();
        for (i, m) in call.messages.iter().enumerate() {
            match m.role {
                Role::Assistant => index += 1,
                Role::User if m.has_user_text() => {
                    if i >= delta_start {
                        user_steps.push((index, m.text()));
                    }
                    index += 1;
                }
                _ => {}
            }
        }
        let agent_index = index;
        traj.next_index = traj.next_index.max(agent_index + 1);

        let call_type = if is_warmup(&call) {
            CallType::Warmup
        } else if traj.parent.is_some() {
            CallType::Subagent
        } else {
            CallType::Main
        };
        let sp_hash = call.system.as_deref().map(system_prompt_hash);
        let mut heavy_changed = is_new;
        if let (Some(h), Some(text)) = (&sp_hash, &call.system)
            && !traj.summary.system_prompts.contains_key(h)
        {
            traj.summary.system_prompts.insert(h.clone(), text.clone());
            heavy_changed = true;
        }
        if traj.summary.tool_definitions.is_empty() && !call.tools.is_empty() {
            heavy_changed = true;
            traj.summary.tool_definitions = call.tools.iter().filter_map(|t| serde_json::to_value(t).ok()).collect();
        }
        let (parent_traj, parent_step, parent_call, agent_role) = match &traj.parent {
            Some((t, s, c, r)) => (
                Some(t.clone()),
                Some(*s),
                Some(c.clone()),
                r.clone().or(Some("subagent".into())),
            ),
            None => (None, None, None, Some("main".to_owned())),
        };
        let timestamp = rfc3339(trace.timings.start);
        let base = StepBase {
            traj_id: &traj_id,
            session: trace.meta.session.clone(),
            agent: trace.meta.agent.clone(),
            sp_hash: sp_hash.clone(),
            tools: call.tools.iter().map(|t| t.name.clone()).collect(),
            agent_role,
            parent_step,
            parent_traj,
            parent_call,
            call_type,
            timestamp: timestamp.clone(),
        };

        for (idx, text) in user_steps {
            let mut s = base.step(idx, StepRole::User);
            s.content = Some(text);
            s.model = None;
            out.push(Record::Step(Box::new(s)));
        }

        // The agent step.
        let usage = call.usage.unwrap_or_default();
        let mut fps: Vec<u64> = call.messages.iter().map(|m| fingerprint(m, ids)).collect();
        let (prefix_reuse, estimated) = prefix_reuse(traj.last.as_ref(), &fps, sp_hash.as_deref());
        let model = trace.model.clone().or(call.model_requested.clone());
        let mut step = base.step(agent_index, StepRole::Agent);
        // The same call sent again (a retry at the same point of the conversation) keeps both attempts.
        let attempt = traj.attempts.entry(agent_index).or_insert(0);
        *attempt += 1;
        if *attempt > 1 {
            step.step_id = format!("{}#{attempt}", step.step_id);
        }
        step.content = call.output.text.clone().or(call.output.refusal.clone());
        step.reasoning_content = call.output.reasoning.clone();
        step.model = model.as_ref().map(|m| format!("{}/{m}", trace.upstream));
        step.tool_calls = call
            .output
            .tool_calls
            .iter()
            .map(|c| StepToolCall {
                tool_call_id: c.id.clone(),
                tool_name: c.name.clone(),
                input: c.arguments.clone(),
                duration_ms: None,
            })
            .collect();
        step.snippets = step
            .content
            .as_deref()
            .map(|t| snippets::fenced_blocks(t, agent_index))
            .unwrap_or_default();
        step.token_usage = TokenUsage {
            input_tokens: usage.input,
            output_tokens: usage.output,
            cache_read_tokens: usage.cache_read.unwrap_or(0),
            cache_write_tokens: usage.cache_write.unwrap_or(0),
            prefix_reuse_tokens: prefix_reuse,
            reasoning_tokens: usage.reasoning.unwrap_or(0),
            prefix_reuse_estimated: estimated,
        };
        step.reasoning_tokens = usage.reasoning;
        step.provider_trace_id = Some(trace.id.clone());
        step.provider = Some(trace.upstream.clone());
        step.response_id = call.response_id.clone();
        step.finish_reason = call.finish_reason.map(|f| f.as_str().to_owned());
        let (status, error) = step_status(&trace, &call);
        step.status = status.to_owned();
        step.error = error;
        step.timings = Some(StepTimings {
            started_at: timestamp,
            first_token_at: trace.timings.first_byte.map(rfc3339),
            ended_at: rfc3339(trace.timings.end),
            duration_ms: (trace.timings.end - trace.timings.start) as f64 / 1000.0,
            time_to_first_token_ms: trace
                .timings
                .first_byte
                .map(|f| (f - trace.timings.start) as f64 / 1000.0),
        });

        // A warmup's output is never used, so its tool calls never wait for results.
        if call_type != CallType::Warmup {
            for c in &call.output.tool_calls {
                traj.open_calls.insert(c.id.clone(), agent_index);
                self.call_owner.insert(c.id.clone(), traj_id.clone());
                self.candidates
                    .add(&c.id, &traj_id, &c.name, &c.arguments, trace.timings.end);
            }
        }
        if let Some(rid) = &call.response_id {
            self.response_owner.insert(rid.clone(), traj_id.clone());
        }

        // Bookkeeping for the next call.
        let mut bytes: Vec<usize> = call.messages.iter().map(message_bytes).collect();
        let out_msg = output_as_message(&call.output);
        fps.push(fingerprint(&out_msg, ids));
        bytes.push(message_bytes(&out_msg));
        traj.last = Some(LastCall {
            system_hash: sp_hash,
            fingerprints: fps,
            bytes,
            input_tokens: usage.input,
            output_tokens: usage.output,
        });
        traj.last_end_us = trace.timings.end;
        traj.last_seen_us = trace.timings.end.max(now);
        if let Some(m) = &model {
            traj.models.insert(m.clone());
        }
        traj.call_types.insert(call_type.as_str());
        let s = &mut traj.summary;
        s.llm_calls += 1;
        s.input_tokens += usage.input;
        s.output_tokens += usage.output;
        s.cache_read_tokens += usage.cache_read.unwrap_or(0);
        s.ended_at = rfc3339(trace.timings.end);
        s.steps = s.steps.max(agent_index + 1);
        s.models = traj.models.iter().cloned().collect();
        s.call_types = traj.call_types.iter().map(|c| (*c).to_owned()).collect();
        if s.agent.is_none() {
            s.agent = trace.meta.agent.clone();
        }
        if let Some((pt, ps, pc, _)) = &traj.parent {
            s.parent_trajectory_id = Some(pt.clone());
            s.parent_step = Some(*ps);
            s.parent_tool_call_id = Some(pc.clone());
        }
        // System prompt texts and tool definitions are large and rarely change: send them only when they do
        // (the store keeps the last ones it was given).
        let summary = if heavy_changed {
            s.clone()
        } else {
            s.without_heavy_parts()
        };

        // Keep only steps that can still change: those with open calls, and the latest.
        let open: BTreeSet<u32> = traj.open_calls.values().copied().collect();
        traj.steps.retain(|idx, _| open.contains(idx));
        traj.steps.insert(agent_index, step.clone());

        out.insert(0, Record::Trace(Box::new(trace)));
        out.push(Record::Step(Box::new(step)));
        out.push(Record::Trajectory(Box::new(summary)));
        out
    }

    fn trajectory_id(&mut self, trace: &ProviderTrace, call: &NormalizedCall, ids: CallIds) -> String {
        if let Some(prev) = &call.previous_response_id {
            if let Some(t) = self.response_owner.get(prev) {
                return t.clone();
            }
            return format!("tr_{}", crate::model::short_hash(format!("resp\u{1}{prev}").as_bytes()));
        }
        if let Some(conv) = &call.conversation_id {
            return format!("tr_{}", crate::model::short_hash(format!("conv\u{1}{conv}").as_bytes()));
        }
        let scope = trace.meta.session.as_deref().unwrap_or("");
        let keys = root_keys(scope, call, ids);
        if is_warmup(call) {
            // A priming/quota probe is a side call: its own one-call trajectory, never a step of the real one.
            return format!(
                "tr_{}",
                crate::model::short_hash(format!("warmup\u{1}{}", keys.root).as_bytes())
            );
        }
        if let Some(t) = self.aliases.get(&keys.root) {
            return t.clone();
        }
        let id = format!("tr_{}", keys.root);
        if self.trajectories.contains_key(&id) {
            return id;
        }
        // A first call that produced no turn: remember it so its retry joins the same trajectory.
        if !keys.has_assistant && output_is_empty(&call.output) {
            self.failed_roots.insert(keys.prefix, id.clone());
            return id;
        }
        if let Some(failed) = self.failed_roots.remove(&keys.prefix)
            && self.trajectories.contains_key(&failed)
        {
            self.aliases.insert(keys.root, failed.clone());
            return failed;
        }
        id
    }

    /// For a new root: the outstanding tool call that started it, if any.
    fn find_parent(&self, traj_id: &str, call: &NormalizedCall) -> Option<ParentRef> {
        // 1. Handoff: the new root's request carries a call id owned by another trajectory.
        for m in &call.messages {
            for p in &m.parts {
                let id = match p {
                    Part::ToolCall(c) => &c.id,
                    Part::ToolResult { call_id, .. } => call_id,
                    _ => continue,
                };
                if let Some(owner) = self.call_owner.get(id).filter(|o| *o != traj_id) {
                    return self.parent_ref(owner, id);
                }
            }
        }
        // 2. Task/transfer tools: an outstanding call's argument appears in the new root's first user turn or
        //    system prompt, or the first user turn appears in the arguments. A sub-agent starts right after its
        //    parent's call, so only the most recent candidate calls are examined (bounded work per new root).
        let first_user = call
            .messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| m.text())
            .unwrap_or_default();
        let first_user = first_user.trim();
        let system = call.system.as_deref().unwrap_or("");
        for call_id in self.candidates.by_time.values().rev().take(MAX_PARENT_CANDIDATES) {
            let Some((_, c)) = self.candidates.by_call.get(call_id) else {
                continue;
            };
            if c.owner == traj_id {
                continue;
            }
            let arg_hit = c.leaves.iter().any(|s| {
                let long_enough = s.len() >= MIN_LONG_ARG_LEN || (c.delegating && s.len() >= MIN_ARG_MATCH_LEN);
                long_enough && (first_user.contains(s.as_str()) || system.contains(s.as_str()))
            });
            let prompt_hit =
                first_user.len() >= MIN_PROMPT_MATCH_LEN && c.leaves.iter().any(|s| s.contains(first_user));
            if arg_hit || prompt_hit {
                return self.parent_ref(&c.owner, call_id);
            }
        }
        None
    }

    /// Compaction: a new root in the same session, with the same system prompt as an open trajectory, whose
    /// first user turn is a summary of the conversation so far, continues that trajectory. Agents word the
    /// summary turn differently; what they share is saying it is a summary ("summary", "summarized") of a
    /// conversation that is being continued, and being long.
    fn find_compacted(&self, traj_id: &str, trace: &ProviderTrace, call: &NormalizedCall) -> Option<String> {
        let first_user = call.messages.iter().find(|m| m.role == Role::User)?.text();
        let lower = first_user.to_lowercase();
        let summary_like =
            lower.contains("summar") && (lower.contains("continu") || lower.contains("previous conversation"));
        if !summary_like || first_user.len() < COMPACTION_MIN_CHARS {
            return None;
        }
        let sp_hash = call.system.as_deref().map(system_prompt_hash);
        self.trajectories
            .iter()
            .filter(|(id, t)| {
                *id != traj_id
                    && t.summary.session_id == trace.meta.session
                    && t.last.as_ref().is_some_and(|l| l.system_hash == sp_hash)
            })
            .max_by_key(|(_, t)| t.last_seen_us)
            .map(|(id, _)| id.clone())
    }

    fn parent_ref(&self, owner: &str, call_id: &str) -> Option<ParentRef> {
        let t = self.trajectories.get(owner)?;
        let idx = *t.open_calls.get(call_id)?;
        let step = t.steps.get(&idx)?;
        let tc = step.tool_calls.iter().find(|c| c.tool_call_id == call_id)?;
        let role = ["subagent_type", "agent_name", "agent", "assistant", "name"]
            .iter()
            .find_map(|k| tc.input.get(*k).and_then(|v| v.as_str()).map(str::to_owned))
            .or_else(|| tc.tool_name.strip_prefix("transfer_to_").map(str::to_owned))
            .or_else(|| Some(tc.tool_name.clone()));
        Some(ParentRef {
            trajectory_id: owner.to_owned(),
            step_index: idx,
            tool_call_id: call_id.to_owned(),
            agent_role: role,
        })
    }

    /// Link a tool result to its call, by id, else (for client-assigned ids) by tool name to the earliest
    /// open call of that name in the result's own trajectory. Returns the updated step to re-emit.
    fn attach_observation(
        &mut self,
        traj_id: &str,
        result_id: &str,
        name: Option<&str>,
        content: &str,
        is_error: bool,
        at: UnixMicros,
    ) -> Option<Step> {
        let (owner, call_id) = match self.call_owner.get(result_id) {
            Some(owner) => (owner.clone(), result_id.to_owned()),
            None => {
                let t = self.trajectories.get(traj_id)?;
                let name = name?;
                let mut open: Vec<(u32, usize, &String)> = t
                    .open_calls
                    .iter()
                    .filter_map(|(id, idx)| {
                        let pos = t
                            .steps
                            .get(idx)?
                            .tool_calls
                            .iter()
                            .position(|c| &c.tool_call_id == id && c.tool_name == name)?;
                        Some((*idx, pos, id))
                    })
                    .collect();
                open.sort();
                (traj_id.to_owned(), open.first()?.2.clone())
            }
        };
        self.call_owner.remove(&call_id);
        self.candidates.remove(&call_id);
        let call_id = call_id.as_str();
        let t = self.trajectories.get_mut(&owner)?;
        let idx = t.open_calls.remove(call_id)?;
        let last_end = t.last_end_us;
        let step = t.steps.get_mut(&idx)?;
        let ended = step
            .timings
            .as_ref()
            .and_then(|tm| chrono::DateTime::parse_from_rfc3339(&tm.ended_at).ok())
            .map(|d| d.timestamp_micros())
            .unwrap_or(last_end);
        let mut read_snippet = None;
        if let Some(tc) = step.tool_calls.iter_mut().find(|c| c.tool_call_id == call_id) {
            tc.duration_ms = Some(((at - ended).max(0) / 1000) as u64);
            if snippets::is_read_tool(&tc.tool_name) {
                read_snippet = snippets::from_read_tool(&tc.input, content, idx);
            }
        }
        step.snippets.extend(read_snippet);
        step.observations.push(Observation {
            source_call_id: call_id.to_owned(),
            content: Some(content.to_owned()),
            output_summary: Some(summarize(content)),
            error: is_error.then(|| "tool_error".to_owned()),
        });
        let updated = step.clone();
        if !t.open_calls.values().any(|i| *i == idx) && t.steps.keys().next_back() != Some(&idx) {
            t.steps.remove(&idx);
        }
        Some(updated)
    }

    /// Close trajectories idle for longer than the configured timeout.
    pub fn close_idle(&mut self, now: UnixMicros) -> Vec<Record> {
        let idle_us = self.config.idle_timeout.as_micros() as i64;
        let idle: Vec<String> = self
            .trajectories
            .iter()
            .filter(|(_, t)| now - t.last_seen_us > idle_us)
            .map(|(id, _)| id.clone())
            .collect();
        idle.into_iter().flat_map(|id| self.close(&id)).collect()
    }

    pub fn close_all(&mut self) -> Vec<Record> {
        let ids: Vec<String> = self.trajectories.keys().cloned().collect();
        ids.into_iter().flat_map(|id| self.close(&id)).collect()
    }

    fn close(&mut self, id: &str) -> Vec<Record> {
        let Some(mut t) = self.trajectories.remove(id) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (call_id, idx) in t.open_calls.drain() {
            self.call_owner.remove(&call_id);
            self.candidates.remove(&call_id);
            if let Some(step) = t.steps.get_mut(&idx) {
                step.observations.push(Observation {
                    source_call_id: call_id,
                    content: None,
                    output_summary: None,
                    error: Some("no_result".into()),
                });
            }
        }
        for (_, step) in t.steps {
            if !step.observations.is_empty() {
                out.push(Record::Step(Box::new(step)));
            }
        }
        self.response_owner.retain(|_, owner| owner != id);
        self.aliases.retain(|_, owner| owner != id);
        self.failed_roots.retain(|_, owner| owner != id);
        t.summary.closed = true;
        out.push(Record::Trajectory(Box::new(t.summary)));
        out
    }
}

/// Fields every step of one call shares.
struct StepBase<'a> {
    traj_id: &'a str,
    session: Option<String>,
    agent: Option<String>,
    sp_hash: Option<String>,
    tools: Vec<String>,
    agent_role: Option<String>,
    parent_step: Option<u32>,
    parent_traj: Option<String>,
    parent_call: Option<String>,
    call_type: CallType,
    timestamp: String,
}

impl StepBase<'_> {
    fn step(&self, index: u32, role: StepRole) -> Step {
        Step {
            step_id: format!("{}/{index}", self.traj_id),
            trajectory_id: self.traj_id.to_owned(),
            session_id: self.session.clone(),
            step_index: index,
            role,
            content: None,
            reasoning_content: None,
            model: None,
            system_prompt_hash: self.sp_hash.clone(),
            agent_role: self.agent_role.clone(),
            parent_step: self.parent_step,
            call_type: Some(self.call_type),
            tools_available: if role == StepRole::Agent {
                self.tools.clone()
            } else {
                Vec::new()
            },
            tool_calls: Vec::new(),
            observations: Vec::new(),
            snippets: Vec::new(),
            token_usage: TokenUsage::default(),
            timestamp: self.timestamp.clone(),
            agent: self.agent.clone(),
            parent_trajectory_id: self.parent_traj.clone(),
            parent_tool_call_id: self.parent_call.clone(),
            provider_trace_id: None,
            provider: None,
            response_id: None,
            finish_reason: None,
            status: "ok".into(),
            error: None,
            timings: None,
            reasoning_tokens: None,
        }
    }
}

fn is_delegation_tool(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    DELEGATION_TOOL_WORDS.iter().any(|w| lower.contains(w))
}

fn is_warmup(call: &NormalizedCall) -> bool {
    call.max_output_tokens.is_some_and(|m| m <= WARMUP_MAX_TOKENS)
}

fn call_ids(api: crate::capture::Api) -> CallIds {
    match api {
        crate::capture::Api::GeminiGenerateContent => CallIds::ClientAssigned,
        _ => CallIds::Stable,
    }
}

fn step_status(trace: &ProviderTrace, call: &NormalizedCall) -> (&'static str, Option<String>) {
    if trace.outcome == Outcome::ClientGone {
        return (
            "cancelled",
            Some("client disconnected before the response ended".into()),
        );
    }
    if let Some(e) = &call.error {
        return ("error", Some(format!("{}: {}", e.kind, e.message)));
    }
    if let Some(e) = &trace.error {
        return ("error", Some(e.clone()));
    }
    match trace.status {
        Some(s) if s >= 400 => ("error", Some(format!("http_{s}"))),
        _ => ("ok", None),
    }
}

/// Prefix reuse against the previous call of the trajectory: exact when this prompt extends the previous
/// prompt plus its output turn; otherwise estimated from the bytes of the common message prefix.
fn prefix_reuse(last: Option<&LastCall>, fps: &[u64], sp_hash: Option<&str>) -> (u64, bool) {
    let Some(last) = last else { return (0, false) };
    if last.system_hash.as_deref() != sp_hash {
        return (0, false);
    }
    let common = fps.iter().zip(&last.fingerprints).take_while(|(a, b)| a == b).count();
    let prev_total = last.input_tokens + last.output_tokens;
    if common == last.fingerprints.len() && fps.len() > common {
        return (prev_total, false);
    }
    if common == 0 {
        return (0, true);
    }
    let total: usize = last.bytes.iter().sum();
    let shared: usize = last.bytes[..common].iter().sum();
    (((prev_total as f64) * shared as f64 / total.max(1) as f64) as u64, true)
}

fn string_leaves(v: &serde_json::Value) -> Vec<String> {
    match v {
        serde_json::Value::String(s) => vec![s.clone()],
        serde_json::Value::Array(a) => a.iter().flat_map(string_leaves).collect(),
        serde_json::Value::Object(o) => o.values().flat_map(string_leaves).collect(),
        _ => Vec::new(),
    }
}

fn summarize(content: &str) -> String {
    let line = content.trim();
    if line.chars().count() <= OUTPUT_SUMMARY_CHARS {
        return line.to_owned();
    }
    let cut: String = line.chars().take(OUTPUT_SUMMARY_CHARS).collect();
    format!("{cut}…")
}
