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

pub mod context;
mod hash_memo;
pub mod identity;
mod observe;
mod prefix;
mod purpose;
pub mod session;
mod shared;
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
use crate::model::step::{CallType, Purpose, Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use identity::{CallIds, Resolved, Resolver, system_prompt_hash};
use prefix::LastCall;
use shared::Shared;
use state::{CallFacts, Origin, State, Trajectory};
use steps::{StepBase, StepIndexes};

/// The most trajectories kept open at once. Every open trajectory holds what its later calls need until its idle
/// timeout (30 minutes by default): ~1.5 KB for a one-call trajectory, more for steps waiting for tool results
/// (docs/performance.md, "Memory held by open trajectories"). A flood of one-shot calls (each its own run) would
/// otherwise hold memory for all of them; beyond this the least recently seen are closed early, as if idle (a
/// later call of a closed conversation finds it again by its root, like a call seen after the timeout).
pub const MAX_OPEN_TRAJECTORIES: usize = 10_000;

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
        let scope = session::native_scope(&trace, &call);
        let resolved = self.resolve(&scope, &trace, &call, ids);
        let traj_id = resolved.id;
        trace.trajectory_id = Some(traj_id.clone());
        // Parent and continuation are looked up before results are attached: a handoff's call is still open.
        let summarizes = match resolved.summarizes {
            None if purpose::intrinsic(&call) == Some(Purpose::Compaction) => {
                self.state
                    .find_summarized(&traj_id, &call, ids, trace.meta.agent.as_deref())
            }
            found => found,
        };
        let origin = self.origin_of_new_root(&traj_id, &scope, &trace, &call, summarizes);
        let new_turns = observe::new_turns_start(&call.messages);
        let updated = self
            .state
            .attach_results(&traj_id, &call.messages[new_turns..], trace.timings.start);
        let steps = self.add_call(&traj_id, &trace, &call, ids, new_turns, origin);
        if let Some(rid) = &call.response_id {
            self.resolver.remember_response(rid, &traj_id);
        }
        trace.session_id = steps.summary.session_id.clone();

        let mut out = Vec::with_capacity(updated.len() + steps.user.len() + 3);
        out.push(Record::Trace(Box::new(trace)));
        out.extend(updated.into_iter().map(|s| Record::Step(Box::new(s))));
        out.extend(steps.user.into_iter().map(|s| Record::Step(Box::new(s))));
        out.push(Record::Step(Box::new(steps.agent)));
        out.push(Record::Trajectory(Box::new(steps.summary)));
        out
    }

    fn resolve(&mut self, scope: &str, trace: &ProviderTrace, call: &NormalizedCall, ids: CallIds) -> Resolved {
        let state = &self.state;
        let answered = observe::answered_call_ids(&call.messages);
        let may_resume = |id: &str| {
            !answered
                .iter()
                .any(|c| state.call_owner.get(*c).is_some_and(|o| o == id))
        };
        self.resolver.resolve_with(
            scope,
            trace.meta.agent.as_deref(),
            call,
            ids,
            |id| state.trajectories.contains_key(id),
            may_resume,
        )
    }

    /// None for a call of a trajectory already open; for a new root, what started it or what it continues or
    /// summarizes, its purpose and its session.
    fn origin_of_new_root(
        &self,
        traj_id: &str,
        scope: &str,
        trace: &ProviderTrace,
        call: &NormalizedCall,
        summarizes: Option<String>,
    ) -> Option<Origin> {
        if self.state.trajectories.contains_key(traj_id) {
            return None;
        }
        let intrinsic = purpose::intrinsic(call);
        let parent = match intrinsic {
            Some(Purpose::Compaction) => None,
            _ => self.state.find_parent(traj_id, call),
        };
        let continues = match (&parent, intrinsic) {
            (None, None) => self.state.find_compacted(traj_id, scope, call),
            _ => None,
        };
        let purpose = self.state.root_purpose(call, scope, parent.as_ref());
        let linked = [
            parent.as_ref().map(|p| p.trajectory_id.as_str()),
            summarizes.as_deref(),
            continues.as_deref(),
        ];
        let session = self
            .state
            .root_session(call, scope, trace.meta.agent.as_deref(), &linked);
        Some(Origin {
            parent,
            continues,
            summarizes,
            purpose: Some(purpose),
            scope: scope.to_owned(),
            session,
        })
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
            .or_insert_with(|| Box::new(Trajectory::new(trace, origin.unwrap_or_default())));
        let steps = call_steps(
            traj,
            &mut self.state.shared,
            traj_id,
            trace,
            call,
            ids,
            new_turns,
            is_new,
        );
        // A warmup's output is never used, so its tool calls never wait for results.
        if steps.agent.call_type != Some(CallType::Warmup) {
            self.state
                .index_open_calls(traj_id, &call.output.tool_calls, trace.timings.end);
        }
        steps
    }

    /// Close trajectories idle for longer than the configured timeout, least recently seen first (then by id);
    /// then, while more than `MAX_OPEN_TRAJECTORIES` are open, the least recently seen ones. Oldest first is the
    /// order the resolver's queues hold them in: `Resolver::forget` finds each at the front of the queue it may
    /// share with thousands of one-shot calls that started alike, rather than by a scan.
    pub fn close_idle(&mut self, now: UnixMicros) -> Vec<Record> {
        let idle_us = self.config.idle_timeout.as_micros() as i64;
        let idle = self.oldest_first(|t| now - t.last_seen_us > idle_us);
        let mut out: Vec<Record> = idle.into_iter().flat_map(|id| self.close(&id)).collect();
        let over = self.state.trajectories.len().saturating_sub(MAX_OPEN_TRAJECTORIES);
        if over > 0 {
            for id in self.oldest_first(|_| true).into_iter().take(over) {
                out.extend(self.close(&id));
            }
        }
        if !out.is_empty() {
            self.state.shared.sweep();
        }
        out
    }

    /// The ids of the open trajectories `pick` selects, least recently seen first, then by id.
    fn oldest_first(&self, pick: impl Fn(&Trajectory) -> bool) -> Vec<String> {
        let mut picked: Vec<(UnixMicros, &String)> = self
            .state
            .trajectories
            .iter()
            .filter(|(_, t)| pick(t))
            .map(|(id, t)| (t.last_seen_us, id))
            .collect();
        picked.sort_unstable();
        picked.into_iter().map(|(_, id)| id.clone()).collect()
    }

    /// How many trajectories are open.
    pub fn open_trajectories(&self) -> usize {
        self.state.trajectories.len()
    }

    /// Close every open trajectory (at shutdown), least recently seen first, as `close_idle` does.
    pub fn close_all(&mut self) -> Vec<Record> {
        let out = self
            .oldest_first(|_| true)
            .into_iter()
            .flat_map(|id| self.close(&id))
            .collect();
        self.state.shared.sweep();
        out
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
            .map(Record::Step)
            .collect();
        self.resolver.forget(id);
        let mut summary = t.summary(id, true);
        summary.closed = true;
        out.push(Record::Trajectory(Box::new(summary)));
        out
    }
}

/// The steps of one call and the trajectory's bookkeeping for the next call.
#[allow(clippy::too_many_arguments)]
fn call_steps(
    traj: &mut Trajectory,
    shared: &mut Shared,
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
    let learned = traj.learn_definitions(call, sp_hash.as_deref(), shared);
    let heavy_changed = is_new || learned;
    if is_new || traj.purpose == Purpose::Title {
        traj.learn_title(call);
    }
    let prompt = prefix::prompt_fingerprints(&call.messages, ids);
    let reuse = prefix::reuse(traj.last.as_ref(), &prompt, sp_hash.as_deref());
    let attempt = traj.next_attempt(indexes.agent);
    let purpose = purpose::intrinsic(call).unwrap_or(traj.purpose);
    let call_type = purpose.call_type();
    traj.add_indexes(indexes.user.iter().map(|(i, _)| *i).chain([indexes.agent]));
    let base = StepBase {
        traj_id,
        trace,
        session: Some(traj.session_id(traj_id)),
        sp_hash: sp_hash.clone(),
        tools: call.tools.iter().map(|t| t.name.clone()).collect(),
        parent: traj.parent.as_ref(),
        linked: traj.linked(),
        call_type,
        purpose,
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
    };
    let summary = traj.record_call(traj_id, &facts, heavy_changed, shared);
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
        let root = h.send(call("", vec![user("hi")], text_out("hello")));
        let turn = || vec![user("hi"), assistant("hello"), user("more")];
        let first = h.send(call("", turn(), text_out("sure")));
        let again = h.send(call("", turn(), text_out("sure")));
        assert_eq!(first.trajectory_id, root.trajectory_id);
        assert_eq!(again.trajectory_id, root.trajectory_id);
        assert_eq!(first.agent().step_id, format!("{}/3", root.trajectory_id));
        assert_eq!(again.agent().step_id, format!("{}/3#2", root.trajectory_id));
    }

    fn session_call(
        session: &str,
        system: &str,
        messages: Vec<crate::model::call::Message>,
        out: crate::model::call::Output,
    ) -> crate::model::call::NormalizedCall {
        let mut c = call(system, messages, out);
        c.client_session = Some(session.into());
        c
    }

    #[test]
    fn a_resumed_conversation_with_another_system_prompt_continues_its_trajectory() {
        for session in [None, Some("3f6c-cc")] {
            let mut h = Harness::new(Api::AnthropicMessages);
            let mk = |system: &str, messages, out| match session {
                Some(s) => session_call(s, system, messages, out),
                None => call(system, messages, out),
            };
            let first = h.send(mk("model: a", vec![user("fix it")], text_out("fixed")));
            let resumed = h.send(mk(
                "model: b, date changed",
                vec![user("fix it"), assistant("fixed"), user("and the tests")],
                text_out("done"),
            ));
            assert_eq!(resumed.trajectory_id, first.trajectory_id, "{session:?}");
            let user_steps: Vec<u32> = resumed
                .steps
                .iter()
                .filter(|s| s.role == crate::model::step::StepRole::User)
                .map(|s| s.step_index)
                .collect();
            assert_eq!(user_steps, [2]);
            assert_eq!(resumed.summary.steps, 4);
            let expected_session = session.map_or(first.trajectory_id.clone(), str::to_owned);
            assert_eq!(resumed.summary.session_id.as_deref(), Some(expected_session.as_str()));
        }
    }

    #[test]
    fn two_runs_that_start_alike_are_two_trajectories() {
        let mut h = Harness::new(Api::OpenAiChat);
        let run = |h: &mut Harness| {
            let a = h.send(call("sys", vec![user("2+2?")], text_out("4")));
            let b = h.send(call(
                "sys",
                vec![user("2+2?"), assistant("4"), user("times 3?")],
                text_out("12"),
            ));
            assert_eq!(a.trajectory_id, b.trajectory_id);
            a.trajectory_id
        };
        let first = run(&mut h);
        let second = run(&mut h);
        assert_ne!(first, second);
        // The first run's id is a function of the content alone; a later run's is numbered.
        assert_eq!(
            first,
            format!(
                "tr_{}",
                super::identity::root_keys(
                    "",
                    &call("sys", vec![user("2+2?")], text_out("4")),
                    super::identity::CallIds::Stable
                )
                .root
            )
        );
        // A new native session separates runs without any counting.
        let mut h2 = Harness::new(Api::OpenAiChat);
        let a = h2.send(session_call("s-1", "sys", vec![user("2+2?")], text_out("4")));
        let b = h2.send(session_call("s-2", "sys", vec![user("2+2?")], text_out("4")));
        assert_ne!(a.trajectory_id, b.trajectory_id);
        assert_eq!(
            (a.summary.session_id.as_deref(), b.summary.session_id.as_deref()),
            (Some("s-1"), Some("s-2"))
        );
    }

    #[test]
    fn gemini_runs_whose_call_ids_repeat_stay_apart() {
        let mut h = Harness::new(Api::GeminiGenerateContent);
        let weather = tool_call("gemini:1:0", "get_weather", json!({"city": "Paris"}));
        let run = |h: &mut Harness| {
            let a = h.send(call(
                "",
                vec![user("weather?")],
                calls_out(std::slice::from_ref(&weather)),
            ));
            let b = h.send(call(
                "",
                vec![
                    user("weather?"),
                    calls(std::slice::from_ref(&weather)),
                    result("gemini:1:0", "sunny"),
                ],
                text_out("sunny"),
            ));
            assert_eq!(a.trajectory_id, b.trajectory_id);
            assert_eq!(b.steps[0].observations[0].content.as_deref(), Some("sunny"));
            a.trajectory_id
        };
        let first = run(&mut h);
        let second = run(&mut h);
        assert_ne!(first, second);
    }

    #[test]
    fn concurrent_identical_runs_advance_in_turn() {
        let mut h = Harness::new(Api::OpenAiChat);
        let a1 = h.send(call("sys", vec![user("go")], text_out("step")));
        let b1 = h.send(call("sys", vec![user("go")], text_out("step")));
        assert_ne!(a1.trajectory_id, b1.trajectory_id);
        let next = || {
            call(
                "sys",
                vec![user("go"), assistant("step"), user("again")],
                text_out("done"),
            )
        };
        let a2 = h.send(next());
        let b2 = h.send(next());
        assert_eq!(a2.trajectory_id, a1.trajectory_id);
        assert_eq!(b2.trajectory_id, b1.trajectory_id);
        assert_eq!(
            (a2.agent().step_id.contains('#'), b2.agent().step_id.contains('#')),
            (false, false)
        );
    }

    #[test]
    fn one_session_through_two_derivers_gets_the_same_ids() {
        let calls = || {
            vec![
                session_call("sess-9", "model: a", vec![user("port it")], text_out("ported")),
                session_call(
                    "sess-9",
                    "model: b",
                    vec![user("port it"), assistant("ported"), user("test it")],
                    text_out("ok"),
                ),
            ]
        };
        let mut a = Harness::new(Api::AnthropicMessages);
        let mut b = Harness::new(Api::AnthropicMessages);
        let mut sent = calls().into_iter().map(|c| a.send(c));
        let (a1, a2) = (sent.next().unwrap(), sent.next().unwrap());
        // The second process sees only the resumed call: same trajectory, same step ids, same session.
        let b2 = b.send(calls().pop().unwrap());
        assert_eq!(a1.trajectory_id, a2.trajectory_id);
        assert_eq!(b2.trajectory_id, a2.trajectory_id);
        assert_eq!(b2.agent().step_id, a2.agent().step_id);
        assert_eq!(b2.summary.session_id, a2.summary.session_id);
    }

    #[test]
    fn system_messages_in_the_history_are_context_not_user_steps() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let system = crate::model::call::Message {
            role: crate::model::call::Role::System,
            parts: vec![crate::model::call::Part::Text {
                text: "Available agents: explorer".into(),
            }],
        };
        let out = h.send(call("sys", vec![system.clone(), user("hi")], text_out("hello")));
        let indexes: Vec<(u32, crate::model::step::StepRole)> =
            out.steps.iter().map(|s| (s.step_index, s.role)).collect();
        use crate::model::step::StepRole::{Agent, User};
        assert_eq!(indexes, [(0, User), (1, Agent)]);
        let later = h.send(call(
            "sys",
            vec![system.clone(), user("hi"), assistant("hello"), system, user("bye")],
            text_out("ciao"),
        ));
        assert_eq!(later.trajectory_id, out.trajectory_id);
        assert_eq!(later.agent().step_index, 3);
    }

    #[test]
    fn a_compaction_call_is_linked_to_the_trajectory_it_summarizes() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let main = h.send(session_call(
            "s",
            "You are a coding agent.",
            vec![user("port the parser")],
            text_out("ok"),
        ));
        let mut compact = session_call(
            "s",
            "You are a helpful AI assistant tasked with summarizing conversations.",
            vec![
                user("port the parser"),
                assistant("ok"),
                user("Your task is to create a detailed summary of the conversation so far."),
            ],
            text_out("Summary: parser ported."),
        );
        compact.tools.clear();
        let c = h.send(compact);
        assert_ne!(c.trajectory_id, main.trajectory_id);
        assert_eq!(c.agent().purpose, Some(crate::model::step::Purpose::Compaction));
        assert_eq!(c.agent().call_type, Some(CallType::Main));
        assert_eq!(
            c.summary.parent_trajectory_id.as_deref(),
            Some(main.trajectory_id.as_str())
        );
        assert_eq!(c.summary.session_id.as_deref(), Some("s"));
        assert_eq!(
            c.summary.steps, 2,
            "the summary request and the summary, not one step per history turn"
        );
    }

    /// An older Claude Code without a session header auto-compacts inside a tool loop: the summarizing call has
    /// its own system prompt, leaves the injected context out of the first user turn, answers the run's open
    /// tool call and ends asking for a summary. It is still linked to the run, in the run's session.
    #[test]
    fn a_compaction_call_without_a_session_is_linked_to_the_run_it_summarizes() {
        use crate::model::call::{Message, Part, Role};
        use crate::model::step::Purpose;
        let mut h = Harness::new(Api::AnthropicMessages);
        let injected_first = Message {
            role: Role::User,
            parts: vec![
                Part::Text {
                    text: "<system-reminder>\n# claudeMd\nUse tabs.\n</system-reminder>".into(),
                },
                Part::Text {
                    text: "port the parser".into(),
                },
            ],
        };
        let read = tool_call("toolu_read_1", "Read", json!({"file_path": "src/parse.rs"}));
        let main = h.send(call(
            "You are a coding agent.",
            vec![injected_first],
            calls_out(std::slice::from_ref(&read)),
        ));
        // Another run of the agent, more recently active: not the one summarized (its latest answer is not the
        // assistant turn the summarizing call carries).
        let other = h.send(call(
            "You are a coding agent.",
            vec![user("write docs")],
            text_out("ok"),
        ));
        let mut compact = call(
            "You are a helpful AI assistant tasked with summarizing conversations.",
            vec![
                user("port the parser"),
                calls(&[read]),
                result("toolu_read_1", "fn parse() {}"),
                user("Your task is to create a detailed summary of the conversation so far."),
            ],
            text_out("Summary: the parser is being ported."),
        );
        compact.tools.clear();
        let c = h.send(compact);
        assert_eq!(c.agent().purpose, Some(Purpose::Compaction));
        assert_ne!(c.trajectory_id, main.trajectory_id);
        assert_eq!(
            c.summary.parent_trajectory_id.as_deref(),
            Some(main.trajectory_id.as_str()),
            "not linked (other run: {})",
            other.trajectory_id
        );
        assert_eq!(c.summary.session_id, main.summary.session_id);
        assert_eq!(c.summary.title, None);
    }

    #[test]
    fn helper_calls_of_a_sessions_agent_are_side_and_title_calls() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let mut main = session_call(
            "s",
            "You are a coding agent.",
            vec![user("fix the bug")],
            text_out("looking"),
        );
        main.tools = vec![crate::model::call::ToolDef {
            name: "Bash".into(),
            description: None,
            parameters: None,
        }];
        let m = h.send(main);
        let topic = h.send(session_call(
            "s",
            "Analyze if this message starts a new topic.",
            vec![user("fix the bug")],
            text_out("{}"),
        ));
        let title = h.send(session_call(
            "s",
            "Write a 5-10 word title for the conversation.",
            vec![user("fix the bug")],
            text_out("Bug fix"),
        ));
        use crate::model::step::Purpose;
        assert_eq!(m.agent().purpose, Some(Purpose::Main));
        assert_eq!(topic.agent().purpose, Some(Purpose::Side));
        assert_eq!(title.agent().purpose, Some(Purpose::Title));
        assert_eq!(topic.summary.session_id.as_deref(), Some("s"));
        // A one-token probe without tools is a quota check, with the agent's tools a warmup.
        let mut probe = session_call("s", "", vec![user("quota")], text_out(""));
        probe.max_output_tokens = Some(1);
        assert_eq!(h.send(probe).agent().purpose, Some(Purpose::Quota));
    }

    #[test]
    fn trajectories_are_titled_by_the_title_call_or_the_first_user_text_without_injected_context() {
        use crate::model::step::{Purpose, session_title};
        let mut h = Harness::new(Api::AnthropicMessages);
        let first_user = crate::model::call::Message {
            role: crate::model::call::Role::User,
            parts: vec![
                crate::model::call::Part::Text {
                    text: "<system-reminder>\n# claudeMd\nUse tabs.\n</system-reminder>".into(),
                },
                crate::model::call::Part::Text {
                    text: "Port the parser to Rust".into(),
                },
            ],
        };
        let mut main = session_call("s", "You are a coding agent.", vec![first_user], text_out("ok"));
        main.tools = vec![crate::model::call::ToolDef {
            name: "Bash".into(),
            description: None,
            parameters: None,
        }];
        let m = h.send(main);
        assert_eq!(m.summary.title.as_deref(), Some("Port the parser to Rust"));
        let mut warm = session_call("s", "You are a coding agent.", vec![user("Warmup")], text_out(""));
        warm.max_output_tokens = Some(1);
        let w = h.send(warm);
        assert_eq!(w.summary.title, None);
        assert_eq!(session_title([&m.summary, &w.summary]), Some("Port the parser to Rust"));
        let t = h.send(session_call(
            "s",
            "Generate a concise, sentence-case title (3-7 words). Return JSON with a single \"title\" field.",
            vec![user("<session>Port the parser to Rust</session>")],
            text_out("{\"title\": \"Port parser to Rust\"}"),
        ));
        assert_eq!(t.agent().purpose, Some(Purpose::Title));
        assert_eq!(t.summary.title.as_deref(), Some("Port parser to Rust"));
        // The title call names the session, whatever the order of the rows.
        assert_eq!(
            session_title([&m.summary, &t.summary, &w.summary]),
            Some("Port parser to Rust")
        );
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
    fn trajectories_close_least_recently_seen_first() {
        let mut h = Harness::new(Api::OpenAiChat);
        // Identical one-shot calls: each is a run of its own, all queued under one root key in the resolver.
        let sent: Vec<String> = (0..8)
            .map(|_| {
                h.send(call("sys", vec![user("same task")], text_out("done")))
                    .trajectory_id
            })
            .collect();
        let closed = |records: Vec<Record>| -> Vec<String> {
            records
                .into_iter()
                .filter_map(|r| match r {
                    Record::Trajectory(t) if t.closed => Some(t.trajectory_id),
                    _ => None,
                })
                .collect()
        };
        // Call i was last seen at T0 + i + 1 s; the clock is at T0 + 8 s: calls 0 to 4 are past the timeout.
        let idle_at = h.now + crate::config::DeriveConfig::default().idle_timeout.as_micros() as i64 - 2_500_000;
        assert_eq!(
            closed(h.deriver.close_idle(idle_at)),
            sent[..5],
            "the five idle ones, oldest first"
        );
        assert_eq!(closed(h.deriver.close_all()), sent[5..]);
    }

    #[test]
    fn beyond_the_open_limit_the_least_recently_seen_trajectories_close() {
        let mut h = Harness::new(Api::OpenAiChat);
        let mut first = None;
        for n in 0..=super::MAX_OPEN_TRAJECTORIES {
            let out = h.send(call("", vec![user(&format!("task {n}"))], text_out("done")));
            first.get_or_insert(out.trajectory_id);
        }
        assert_eq!(h.deriver.state.trajectories.len(), super::MAX_OPEN_TRAJECTORIES + 1);
        let records = h.deriver.close_idle(T0 + 1);
        let closed: Vec<&str> = records
            .iter()
            .filter_map(|r| match r {
                Record::Trajectory(t) if t.closed => Some(t.trajectory_id.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(closed, [first.unwrap().as_str()], "only the oldest closes, early");
        assert_eq!(h.deriver.state.trajectories.len(), super::MAX_OPEN_TRAJECTORIES);
    }

    #[test]
    fn open_one_call_trajectories_keep_no_step_and_share_their_definitions_until_closed() {
        let mut h = Harness::new(Api::OpenAiChat);
        let one_call = || {
            let mut c = call("You are a helpful assistant.", vec![user("hi")], text_out("hello"));
            c.tools = vec![crate::model::call::ToolDef {
                name: "read".into(),
                description: Some("Read a file".into()),
                parameters: Some(json!({"type": "object"})),
            }];
            c
        };
        let a = h.send(one_call());
        let b = h.send(one_call());
        assert_ne!(a.trajectory_id, b.trajectory_id);
        let open: Vec<&super::state::Trajectory> = h.deriver.state.trajectories.values().map(|t| &**t).collect();
        assert_eq!(open.len(), 2);
        // A step that waits for no tool result can no longer change: it is not kept.
        assert!(open.iter().all(|t| t.steps.is_empty()));
        // Both summaries carry the definitions, from one shared copy.
        assert_eq!(a.summary.tool_definitions, b.summary.tool_definitions);
        assert_eq!(a.summary.tool_definitions.len(), 1);
        let closed: Vec<crate::model::step::TrajectorySummary> = h
            .deriver
            .close_all()
            .into_iter()
            .filter_map(|r| match r {
                Record::Trajectory(t) => Some(*t),
                _ => None,
            })
            .collect();
        assert_eq!(closed.len(), 2);
        for t in &closed {
            assert!(t.closed);
            assert_eq!(t.tool_definitions, a.summary.tool_definitions);
            assert_eq!(
                t.system_prompts.values().collect::<Vec<_>>(),
                ["You are a helpful assistant."]
            );
            assert_eq!(
                (t.models.as_slice(), t.call_types.as_slice()),
                (&["m-1".to_owned()][..], &["main".to_owned()][..])
            );
        }
        assert!(
            h.deriver.state.shared.is_empty(),
            "closed trajectories leave nothing shared behind"
        );
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
