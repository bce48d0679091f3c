//! Derivation: provider traces → agent trajectories and steps.
//!
//! The `Deriver` runs on the pipeline thread and owns all cross-call state, so it needs no locks. Most facts
//! are functions of one exchange: trajectory id (`identity`), step index and user steps (`steps`). The
//! cross-call facts need the previous calls this process saw (`state`):
//! - observations (`observe`): tool results in request N+1 are joined to the tool calls of step N by call id
//!   (globally, because a handoff carries the parent's call into the child's request), with the time in
//!   between as an upper bound on the tool's duration;
//! - sub-agents and compaction (`subagent`): a new root that carries another trajectory's call id (handoff),
//!   or whose first user turn or system prompt contains an argument of another trajectory's outstanding call
//!   (Task/transfer tools); a new root whose first user turn summarizes a trajectory continues it;
//! - retries (`identity::Resolver`): a new root whose first call failed before producing any turn is adopted
//!   by the next root with the same system prompt and first user turn;
//! - prefix reuse (`prefix`): how much of this prompt repeats the previous call's prompt and output.
//!
//! Steps are emitted at once and re-emitted (upserted by `step_id`) when late facts arrive; trajectories close
//! after the idle timeout, when dangling calls get an `error: "no_result"` observation.

pub mod identity;
mod observe;
mod prefix;
pub mod snippets;
pub mod stable_hash;
mod state;
mod steps;
mod subagent;
#[cfg(test)]
pub(crate) mod testkit;

use crate::config::DeriveConfig;
use crate::model::call::NormalizedCall;
use crate::model::exchange::UnixMicros;
use crate::model::record::Record;
use crate::model::step::{CallType, Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use identity::{CallIds, Resolver, system_prompt_hash};
use prefix::LastCall;
use state::{CallFacts, Origin, State, Trajectory};
use steps::{StepBase, StepIndexes};

pub struct Deriver {
    config: DeriveConfig,
    state: State,
    resolver: Resolver,
}

/// What one call adds to its own trajectory.
struct CallSteps {
    user: Vec<Step>,
    agent: Step,
    summary: TrajectorySummary,
}

impl Deriver {
    pub fn new(config: DeriveConfig) -> Deriver {
        Deriver {
            config,
            state: State::default(),
            resolver: Resolver::default(),
        }
    }

    /// Turn one processed exchange into store records, in this order: the trace, earlier steps updated by this
    /// request's tool results, new user steps, the call's agent step, the trajectory summary.
    pub fn observe(&mut self, mut trace: ProviderTrace, call: Option<NormalizedCall>) -> Vec<Record> {
        let Some(call) = call else {
            return vec![Record::Trace(Box::new(trace))];
        };
        let ids = CallIds::of(trace.api);
        let traj_id = self.resolve(&trace, &call, ids);
        trace.trajectory_id = Some(traj_id.clone());
        // Parent and continuation are looked up before results are attached: a handoff's call is still open.
        let origin = self.origin_of_new_root(&traj_id, &trace, &call);
        let new_turns = observe::new_turns_start(&call.messages);
        let updated = self
            .state
            .attach_results(&traj_id, &call.messages[new_turns..], trace.timings.start);
        let steps = self.add_call(&traj_id, &trace, &call, ids, new_turns, origin);
        if let Some(rid) = &call.response_id {
            self.resolver.remember_response(rid, &traj_id);
        }

        let mut out = Vec::with_capacity(updated.len() + steps.user.len() + 3);
        out.push(Record::Trace(Box::new(trace)));
        out.extend(updated.into_iter().map(|s| Record::Step(Box::new(s))));
        out.extend(steps.user.into_iter().map(|s| Record::Step(Box::new(s))));
        out.push(Record::Step(Box::new(steps.agent)));
        out.push(Record::Trajectory(Box::new(steps.summary)));
        out
    }

    fn resolve(&mut self, trace: &ProviderTrace, call: &NormalizedCall, ids: CallIds) -> String {
        let scope = trace.meta.session.as_deref().unwrap_or("");
        let open = &self.state.trajectories;
        self.resolver.resolve(scope, call, ids, |id| open.contains_key(id))
    }

    /// None for a call of a trajectory already open; for a new root, what started it or what it continues.
    fn origin_of_new_root(&self, traj_id: &str, trace: &ProviderTrace, call: &NormalizedCall) -> Option<Origin> {
        if self.state.trajectories.contains_key(traj_id) {
            return None;
        }
        let parent = self.state.find_parent(traj_id, call);
        let continues = match parent {
            Some(_) => None,
            None => self.state.find_compacted(traj_id, trace.meta.session.as_deref(), call),
        };
        Some(Origin { parent, continues })
    }

    /// Open the trajectory if `origin` says it is new, add the call's steps to it and index its tool calls.
    fn add_call(
        &mut self,
        traj_id: &str,
        trace: &ProviderTrace,
        call: &NormalizedCall,
        ids: CallIds,
        new_turns: usize,
        origin: Option<Origin>,
    ) -> CallSteps {
        let is_new = origin.is_some();
        let traj = self
            .state
            .trajectories
            .entry(traj_id.to_owned())
            .or_insert_with(|| Trajectory::new(traj_id, trace, origin.unwrap_or_default()));
        let steps = call_steps(traj, traj_id, trace, call, ids, new_turns, is_new);
        // A warmup's output is never used, so its tool calls never wait for results.
        if steps.agent.call_type != Some(CallType::Warmup) {
            self.state
                .index_open_calls(traj_id, &call.output.tool_calls, trace.timings.end);
        }
        steps
    }

    /// Close trajectories idle for longer than the configured timeout, in id order.
    pub fn close_idle(&mut self, now: UnixMicros) -> Vec<Record> {
        let idle_us = self.config.idle_timeout.as_micros() as i64;
        let mut idle: Vec<String> = self
            .state
            .trajectories
            .iter()
            .filter(|(_, t)| now - t.last_seen_us > idle_us)
            .map(|(id, _)| id.clone())
            .collect();
        idle.sort_unstable();
        idle.into_iter().flat_map(|id| self.close(&id)).collect()
    }

    /// Close every open trajectory (at shutdown), in id order.
    pub fn close_all(&mut self) -> Vec<Record> {
        let mut ids: Vec<String> = self.state.trajectories.keys().cloned().collect();
        ids.sort_unstable();
        ids.into_iter().flat_map(|id| self.close(&id)).collect()
    }

    /// The steps that got `no_result` observations or still had unsent ones, then the closed summary.
    fn close(&mut self, id: &str) -> Vec<Record> {
        let Some(mut t) = self.state.trajectories.remove(id) else {
            return Vec::new();
        };
        for call_id in t.mark_unanswered() {
            self.state.forget_call(&call_id);
        }
        let mut out: Vec<Record> = std::mem::take(&mut t.steps)
            .into_values()
            .filter(|s| !s.observations.is_empty())
            .map(|s| Record::Step(Box::new(s)))
            .collect();
        self.resolver.forget(id);
        t.summary.closed = true;
        out.push(Record::Trajectory(Box::new(t.summary)));
        out
    }
}

/// The steps of one call and the trajectory's bookkeeping for the next call.
fn call_steps(
    traj: &mut Trajectory,
    traj_id: &str,
    trace: &ProviderTrace,
    call: &NormalizedCall,
    ids: CallIds,
    new_turns: usize,
    is_new: bool,
) -> CallSteps {
    let start = if steps::is_native_chain(call) {
        traj.next_index
    } else {
        0
    };
    let indexes = StepIndexes::count(call, new_turns, start);
    traj.next_index = traj.next_index.max(indexes.agent + 1);
    let sp_hash = call.system.as_deref().map(system_prompt_hash);
    // Learned whether or not the trajectory is new (no short-circuit).
    let learned = traj.learn_definitions(call, sp_hash.as_deref());
    let heavy_changed = is_new || learned;
    let prompt = prefix::prompt_fingerprints(&call.messages, ids);
    let reuse = prefix::reuse(traj.last.as_ref(), &prompt, sp_hash.as_deref());
    let attempt = traj.next_attempt(indexes.agent);
    let call_type = steps::call_type(call, traj.parent.as_ref());
    let base = StepBase {
        traj_id,
        trace,
        sp_hash: sp_hash.clone(),
        tools: call.tools.iter().map(|t| t.name.clone()).collect(),
        parent: traj.parent.as_ref(),
        call_type,
    };
    let user = indexes
        .user
        .into_iter()
        .map(|(i, text)| base.user_step(i, text))
        .collect();
    let agent = base.agent_step(call, indexes.agent, attempt, reuse);
    if call_type != CallType::Warmup {
        traj.await_results(&call.output.tool_calls, indexes.agent);
    }
    traj.last = Some(LastCall::new(call, prompt, sp_hash, ids));
    let facts = CallFacts {
        trace,
        call,
        model: steps::answering_model(trace, call),
        call_type,
        agent_index: indexes.agent,
    };
    let summary = traj.record_call(&facts, heavy_changed);
    traj.keep_live_steps(&agent);
    CallSteps { user, agent, summary }
}

#[cfg(test)]
mod tests {
    use crate::model::exchange::Api;
    use crate::model::step::CallType;
    use crate::store::Record;
    use serde_json::json;

    use super::testkit::*;

    #[test]
    fn every_call_of_one_conversation_gets_the_same_trajectory() {
        let mut h = Harness::new(Api::OpenAiChat);
        let read = tool_call("call_1", "read", json!({"path": "a.rs"}));
        let a = h.send(call(
            "sys",
            vec![user("fix it")],
            calls_out(std::slice::from_ref(&read)),
        ));
        let b = h.send(call(
            "sys",
            vec![
                user("fix it"),
                calls(std::slice::from_ref(&read)),
                result("call_1", "x"),
            ],
            text_out("done"),
        ));
        let c = h.send(call(
            "sys",
            vec![
                user("fix it"),
                calls(&[read]),
                result("call_1", "x"),
                assistant("done"),
                user("thanks"),
            ],
            text_out(":)"),
        ));
        assert!(a.trajectory_id.starts_with("tr_") && a.trajectory_id.len() == 19);
        assert_eq!(
            (b.trajectory_id.as_str(), c.trajectory_id.as_str()),
            (a.trajectory_id.as_str(), a.trajectory_id.as_str())
        );
        let indexes: Vec<(u32, crate::model::step::StepRole)> = [&a, &b, &c]
            .iter()
            .flat_map(|o| o.steps.iter().map(|s| (s.step_index, s.role)))
            .collect();
        use crate::model::step::StepRole::{Agent, User};
        // a: user 0, agent 1; b: step 1 updated, agent 2; c: user 3, agent 4.
        assert_eq!(
            indexes,
            [(0, User), (1, Agent), (1, Agent), (2, Agent), (3, User), (4, Agent)]
        );
        assert_eq!((c.summary.llm_calls, c.summary.steps), (3, 5));
        // Exact prefix reuse: c extends b's prompt and output.
        assert_eq!(c.agent().token_usage.prefix_reuse_tokens, 110);
        assert!(!c.agent().token_usage.prefix_reuse_estimated);
    }

    #[test]
    fn the_same_call_sent_twice_keeps_both_attempts() {
        let mut h = Harness::new(Api::OpenAiChat);
        let first = h.send(call("", vec![user("hi")], text_out("hello")));
        let again = h.send(call("", vec![user("hi")], text_out("hello")));
        assert_eq!(again.trajectory_id, first.trajectory_id);
        assert_eq!(first.agent().step_id, format!("{}/1", first.trajectory_id));
        assert_eq!(again.agent().step_id, format!("{}/1#2", first.trajectory_id));
    }

    #[test]
    fn a_warmup_is_a_one_call_side_trajectory_whose_calls_wait_for_nothing() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let mut warm = call(
            "sys",
            vec![user("task")],
            calls_out(&[tool_call("toolu_w", "read", json!({}))]),
        );
        warm.max_output_tokens = Some(1);
        let w = h.send(warm);
        assert_eq!(w.agent().call_type, Some(CallType::Warmup));
        assert_eq!(w.summary.call_types, ["warmup"]);
        let real = h.send(call("sys", vec![user("task")], text_out("working")));
        assert_ne!(real.trajectory_id, w.trajectory_id);
        assert_eq!(real.agent().call_type, Some(CallType::Main));
        // At close the warmup's tool call is not reported as unanswered.
        let closed = split_all(h.deriver.close_all());
        let no_result: Vec<_> = closed.iter().filter(|r| matches!(r, Record::Step(_))).collect();
        assert!(no_result.is_empty());
    }

    #[test]
    fn idle_close_marks_unanswered_calls_no_result_in_call_order() {
        let mut h = Harness::new(Api::OpenAiChat);
        let calls = [tool_call("call_b", "f", json!({})), tool_call("call_a", "g", json!({}))];
        let out = h.send(call("", vec![user("go")], calls_out(&calls)));
        let last_end = T0 + 1_000_000;
        let idle = 30 * 60 * 1_000_000;
        assert!(
            h.deriver.close_idle(last_end + idle).is_empty(),
            "not idle yet at exactly the timeout"
        );
        let records = h.deriver.close_idle(last_end + idle + 1);
        let [Record::Step(step), Record::Trajectory(summary)] = &records[..] else {
            panic!(
                "expected the step and the closed summary, got {} records",
                records.len()
            );
        };
        assert_eq!(step.step_id, out.agent().step_id);
        let got: Vec<(&str, Option<&str>, Option<&str>)> = step
            .observations
            .iter()
            .map(|o| (o.source_call_id.as_str(), o.content.as_deref(), o.error.as_deref()))
            .collect();
        assert_eq!(
            got,
            [("call_b", None, Some("no_result")), ("call_a", None, Some("no_result"))]
        );
        assert!(summary.closed);
        assert_eq!(summary.trajectory_id, out.trajectory_id);
        assert!(h.deriver.close_all().is_empty());
        // A result arriving after close is joined to nothing.
        assert!(h.deriver.state.call_owner.is_empty());
    }

    #[test]
    fn a_trace_without_a_call_passes_through() {
        let mut d = super::Deriver::new(crate::config::DeriveConfig::default());
        let records = d.observe(trace(Api::Other, T0, T0 + 1), None);
        let [Record::Trace(t)] = &records[..] else {
            panic!("expected the trace alone");
        };
        assert_eq!(t.trajectory_id, None);
    }

    fn split_all(records: Vec<Record>) -> Vec<Record> {
        records
            .into_iter()
            .filter(|r| !matches!(r, Record::Trajectory(_)))
            .collect()
    }
}
