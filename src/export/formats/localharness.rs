//! The localharness `Step` event stream (seed 002, v0.37 wire form), one event per JSON line.
//!
//! A localharness step is a stream event, finer than a canonical step. Each LLM call becomes: a thought delta
//! (when there was reasoning) and a text delta (when there was text), `TEXT_RESPONSE`/ACTIVE with
//! `id` = trajectory id as the SDK's delta constructors do; one `TOOL_CALL` step per tool call (target
//! ENVIRONMENT, status DONE: a proxy never dispatches); then, when the call ends the turn (no tool calls), a
//! terminal step with `is_complete_response` and the turn's `usage_metadata` (Gemini-style, folded the SDK's
//! `merge_round` way: prompt and cached counts from the latest round, output counts summed). A call that failed
//! ends the turn with a SYSTEM→USER ERROR step. Tool results, which arrive with the next request, become
//! `TOOL_CALL` steps carrying `tool_results`. A user turn is a USER-sourced step and resets `step_index`.
//! localharness has no slot for tokens beyond UsageMetadata, timings or ids; those go in an `extra` object
//! (serde ignores unknown keys, so the SDK still reads the events).
//!
//! The same converter serves the export and the live gRPC subscription: it keeps per-trajectory turn state
//! and remembers what it already emitted, so a step re-published with late observations only adds its
//! tool-result events.

use std::collections::{HashMap, HashSet, VecDeque};

use serde_json::{Value, json};

use super::strip_nulls;
use crate::model::step::{Step, StepRole};

#[derive(Default)]
struct TurnUsage {
    prompt: u64,
    cached: u64,
    candidates: u64,
    thoughts: u64,
}

impl TurnUsage {
    fn metadata(&self) -> Value {
        json!({
            "prompt_token_count": self.prompt,
            "cached_content_token_count": self.cached,
            "candidates_token_count": self.candidates,
            "thoughts_token_count": self.thoughts,
            "total_token_count": self.prompt + self.candidates + self.thoughts,
        })
    }
}

#[derive(Default)]
struct TrajectoryState {
    step_index: u32,
    last_system: Option<String>,
    emitted_steps: HashSet<String>,
    emitted_results: HashSet<(String, String)>,
    usage: TurnUsage,
}

impl TrajectoryState {
    /// A new event at the next index of the current turn.
    fn event(&mut self, id: &str, kind: &str, source: &str, target: &str, status: &str) -> Value {
        let index = self.step_index;
        self.step_index += 1;
        event(id, index, kind, source, target, status)
    }

    /// Makes `e` the turn's terminal event: complete, with the turn's usage (which then starts over) and `extra`.
    fn end_turn(&mut self, mut e: Value, extra: Value) -> Value {
        e["is_complete_response"] = json!(true);
        e["usage_metadata"] = self.usage.metadata();
        e["extra"] = extra;
        self.usage = TurnUsage::default();
        e
    }
}

/// How many trajectories the live converter remembers; the oldest is forgotten first.
const MAX_TRAJECTORIES: usize = 4096;

#[derive(Default)]
pub struct LocalharnessStream {
    states: HashMap<String, TrajectoryState>,
    order: VecDeque<String>,
}

fn event(id: &str, index: u32, kind: &str, source: &str, target: &str, status: &str) -> Value {
    json!({"id": id, "step_index": index, "type": kind, "source": source, "target": target, "status": status})
}

impl LocalharnessStream {
    fn state(&mut self, trajectory: &str) -> &mut TrajectoryState {
        if !self.states.contains_key(trajectory) {
            if self.order.len() >= MAX_TRAJECTORIES
                && let Some(old) = self.order.pop_front()
            {
                self.states.remove(&old);
            }
            self.order.push_back(trajectory.to_owned());
        }
        self.states.entry(trajectory.to_owned()).or_default()
    }

    /// The events a step adds to its trajectory's stream. `system_prompt` resolves a system_prompt_hash to its
    /// text when known (the export knows it; the live stream may not).
    pub fn push(&mut self, st: &Step, system_prompt: impl Fn(&str) -> Option<String>, out: &mut Vec<Value>) {
        let traj = st.trajectory_id.as_str();
        let state = self.state(traj);
        let first_time = state.emitted_steps.insert(st.step_id.clone());
        if first_time {
            if let Some(h) = st.system_prompt_hash.as_deref()
                && state.last_system.as_deref() != Some(h)
            {
                state.last_system = Some(h.to_owned());
                let mut e = state.event(&st.step_id, "SYSTEM_MESSAGE", "SYSTEM", "TARGET_UNSPECIFIED", "DONE");
                e["content"] = json!(system_prompt(h).unwrap_or_default());
                e["extra"] = json!({"system_prompt_hash": h});
                out.push(e);
            }
            match st.role {
                StepRole::User => {
                    state.step_index = 0;
                    state.usage = TurnUsage::default();
                    let mut e = state.event(&st.step_id, "TEXT_RESPONSE", "USER", "TARGET_UNSPECIFIED", "DONE");
                    e["content"] = json!(st.content.clone().unwrap_or_default());
                    out.push(e);
                }
                StepRole::System => {
                    let mut e = state.event(&st.step_id, "SYSTEM_MESSAGE", "SYSTEM", "TARGET_UNSPECIFIED", "DONE");
                    e["content"] = json!(st.content.clone().unwrap_or_default());
                    out.push(e);
                }
                StepRole::Agent => Self::agent_events(state, st, out),
            }
        }
        // Tool results: on first sight for an exported step, later for a live step updated by the next request.
        for o in &st.observations {
            if !state
                .emitted_results
                .insert((st.step_id.clone(), o.source_call_id.clone()))
            {
                continue;
            }
            let name = st
                .tool_calls
                .iter()
                .find(|c| c.tool_call_id == o.source_call_id)
                .map_or("", |c| c.tool_name.as_str());
            let mut result = json!({"name": name, "id": o.source_call_id});
            let mut e = state.event(&st.step_id, "TOOL_CALL", "MODEL", "TARGET_ENVIRONMENT", "DONE");
            match (&o.error, &o.content) {
                (Some(err), content) => {
                    let msg = content.clone().unwrap_or_else(|| err.clone());
                    result["error"] = json!(msg);
                    e["error"] = json!(msg);
                }
                (None, content) => result["result"] = json!(content.clone().unwrap_or_default()),
            }
            e["tool_results"] = json!([result]);
            out.push(e);
        }
    }

    /// At the end of a trajectory whose last call asked for tools nobody answered, that call was the
    /// answer: clients such as pydantic-ai return structured output through a final tool. It ends the turn
    /// like localharness's `finish` tool, with the call's arguments as the structured output.
    pub fn end_of_trajectory(&mut self, last: &Step, out: &mut Vec<Value>) {
        let unanswered = !last.tool_calls.is_empty()
            && last.tool_calls.iter().all(|c| {
                last.observations
                    .iter()
                    .all(|o| o.source_call_id != c.tool_call_id || o.error.as_deref() == Some("no_result"))
            });
        if !unanswered || last.status != "ok" || last.tool_calls.iter().any(|c| c.tool_name == "finish") {
            return;
        }
        let state = self.state(&last.trajectory_id);
        let call = &last.tool_calls[0];
        let mut e = state.event(&last.step_id, "FINISH", "MODEL", "TARGET_USER", "DONE");
        e["content"] = json!(last.content.clone().unwrap_or_default());
        e["thinking"] = json!(last.reasoning_content.clone().unwrap_or_default());
        e["structured_output"] = call.input.clone();
        let extra = json!({"trajectory_id": last.trajectory_id, "step_id": last.step_id, "final_tool": call.tool_name});
        out.push(state.end_turn(e, extra));
    }

    fn agent_events(state: &mut TrajectoryState, st: &Step, out: &mut Vec<Value>) {
        let traj = st.trajectory_id.as_str();
        let u = &st.token_usage;
        state.usage.prompt = u.input_tokens;
        state.usage.cached = u.cache_read_tokens;
        state.usage.thoughts += u.reasoning_tokens;
        state.usage.candidates += u.output_tokens.saturating_sub(u.reasoning_tokens);
        let thinking = st.reasoning_content.clone().unwrap_or_default();
        let content = st.content.clone().unwrap_or_default();
        if !thinking.is_empty() {
            let mut e = state.event(traj, "TEXT_RESPONSE", "MODEL", "TARGET_USER", "ACTIVE");
            e["thinking_delta"] = json!(thinking);
            e["is_complete_response"] = json!(false);
            out.push(e);
        }
        if !content.is_empty() {
            let mut e = state.event(traj, "TEXT_RESPONSE", "MODEL", "TARGET_USER", "ACTIVE");
            e["content_delta"] = json!(content);
            e["is_complete_response"] = json!(false);
            out.push(e);
        }
        for c in &st.tool_calls {
            let mut e = state.event(&st.step_id, "TOOL_CALL", "MODEL", "TARGET_ENVIRONMENT", "DONE");
            e["tool_calls"] = json!([{"name": c.tool_name, "args": c.input, "id": c.tool_call_id}]);
            out.push(e);
        }
        let mut extra = json!({
            "trajectory_id": traj,
            "step_id": st.step_id,
            "model": st.model,
            "call_type": st.call_type,
            "finish_reason": st.finish_reason,
            "cache_write_tokens": u.cache_write_tokens,
            "prefix_reuse_tokens": u.prefix_reuse_tokens,
            "timings": st.timings,
            "provider_trace_id": st.provider_trace_id,
        });
        strip_nulls(&mut extra);
        if st.status != "ok" {
            // turn_error: SYSTEM→USER, terminal.
            let status = if st.status == "cancelled" { "CANCELED" } else { "ERROR" };
            let mut e = state.event(&st.step_id, "TEXT_RESPONSE", "SYSTEM", "TARGET_USER", status);
            e["error"] = json!(st.error.clone().unwrap_or_else(|| st.status.clone()));
            out.push(state.end_turn(e, extra));
            return;
        }
        // The `finish` tool ends a localharness turn with structured output; otherwise a call without tool
        // calls does.
        let finish = st.tool_calls.iter().find(|c| c.tool_name == "finish");
        if st.tool_calls.is_empty() || finish.is_some() {
            let kind = if finish.is_some() { "FINISH" } else { "TEXT_RESPONSE" };
            let mut e = state.event(&st.step_id, kind, "MODEL", "TARGET_USER", "DONE");
            e["content"] = json!(content);
            e["thinking"] = json!(thinking);
            if let Some(f) = finish {
                e["structured_output"] = f.input.clone();
                if let Some(summary) = f.input.get("summary") {
                    e["finish_summary"] = summary.clone();
                }
            }
            out.push(state.end_turn(e, extra));
        }
    }
}

/// Every event of one trajectory, in order. `handoff_calls` are the tool call ids that started a sub-agent:
/// such a call is not the trajectory's answer even when its result never came back here.
pub fn localharness(t: &super::TrajectoryData, handoff_calls: &HashSet<String>, mut emit: impl FnMut(Value)) {
    let mut stream = LocalharnessStream::default();
    let mut out = Vec::new();
    if let Some(previous) = &t.summary.continues {
        // This trajectory carries on another after its context was compacted.
        let mut e = event(
            &t.summary.trajectory_id,
            0,
            "COMPACTION",
            "SYSTEM",
            "TARGET_UNSPECIFIED",
            "DONE",
        );
        e["extra"] = json!({"continues": previous});
        emit(e);
    }
    for st in &t.steps {
        stream.push(st, |h| t.summary.system_prompts.get(h).cloned(), &mut out);
        for e in out.drain(..) {
            emit(e);
        }
    }
    if let Some(last) = t.steps.iter().rev().find(|s| s.role == StepRole::Agent)
        && !last.tool_calls.iter().any(|c| handoff_calls.contains(&c.tool_call_id))
    {
        stream.end_of_trajectory(last, &mut out);
        out.into_iter().for_each(emit);
    }
}
