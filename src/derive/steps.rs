//! Building steps from one call: step indexes, user steps, the agent step (content, tool calls, usage,
//! status, timings) and its call type.

use crate::model::call::{NormalizedCall, Role};
use crate::model::exchange::Outcome;
use crate::model::step::{CallType, Purpose, Step, StepRole, StepTimings, StepToolCall, TokenUsage};
use crate::model::trace::{ProviderTrace, rfc3339};

use super::prefix::Reuse;
use super::snippets;
use super::state::ParentLink;

/// Where this call's steps sit in the trajectory.
#[derive(Debug, PartialEq)]
pub struct StepIndexes {
    /// New user turns (after the last assistant turn) with their indexes.
    pub user: Vec<(u32, String)>,
    /// The index of the call's own agent step.
    pub agent: u32,
}

impl StepIndexes {
    /// Step index = the number of assistant turns and user text turns before it in the request, so every
    /// replica computes it from the request alone. `start` is 0, except for server-side conversation state
    /// (the request carries only the new turn), where it is where the trajectory's previous call left off.
    pub fn count(call: &NormalizedCall, new_turns_start: usize, start: u32) -> StepIndexes {
        let mut index = start;
        let mut user = Vec::new();
        for (i, m) in call.messages.iter().enumerate() {
            match m.role {
                Role::Assistant => index += 1,
                Role::User if m.has_user_text() => {
                    if i >= new_turns_start {
                        user.push((index, m.text()));
                    }
                    index += 1;
                }
                _ => {}
            }
        }
        StepIndexes { user, agent: index }
    }
}

/// Whether the request continues server-side conversation state (its index cannot be counted from it).
pub fn is_native_chain(call: &NormalizedCall) -> bool {
    call.previous_response_id.is_some() || call.conversation_id.is_some()
}

/// Fields every step of one call shares.
pub struct StepBase<'a> {
    pub traj_id: &'a str,
    pub trace: &'a ProviderTrace,
    pub session: Option<&'a str>,
    pub sp_hash: Option<String>,
    pub tools: Vec<String>,
    pub parent: Option<&'a ParentLink>,
    /// The trajectory this one is linked to without a tool call (the one a compaction call summarizes).
    pub linked: Option<&'a str>,
    pub call_type: CallType,
    pub purpose: Purpose,
}

impl StepBase<'_> {
    pub fn step(&self, index: u32, role: StepRole) -> Step {
        let agent_role = match self.parent {
            _ if matches!(self.purpose, Purpose::Side | Purpose::Title | Purpose::Compaction) => {
                Some(self.purpose.as_str().to_owned())
            }
            Some(p) => p.agent_role.clone().or(Some("subagent".into())),
            None => Some("main".to_owned()),
        };
        Step {
            step_id: format!("{}/{index}", self.traj_id),
            trajectory_id: self.traj_id.to_owned(),
            session_id: self.session.map(str::to_owned),
            step_index: index,
            role,
            content: None,
            reasoning_content: None,
            model: None,
            system_prompt_hash: self.sp_hash.clone(),
            agent_role,
            parent_step: self.parent.map(|p| p.step_index),
            call_type: Some(self.call_type),
            purpose: Some(self.purpose),
            tools_available: if role == StepRole::Agent {
                self.tools.clone()
            } else {
                Vec::new()
            },
            tool_calls: Vec::new(),
            observations: Vec::new(),
            snippets: Vec::new(),
            token_usage: TokenUsage::default(),
            timestamp: rfc3339(self.trace.timings.start),
            agent: self.trace.meta.agent.clone(),
            parent_trajectory_id: self
                .parent
                .map(|p| p.trajectory_id.clone())
                .or_else(|| self.linked.map(str::to_owned)),
            parent_tool_call_id: self.parent.map(|p| p.tool_call_id.clone()),
            provider_trace_id: None,
            provider: None,
            response_id: None,
            finish_reason: None,
            status: "ok".into(),
            error: None,
            timings: None,
            reasoning_tokens: None,
            cost_usd: None,
        }
    }

    pub fn user_step(&self, index: u32, text: String) -> Step {
        let mut s = self.step(index, StepRole::User);
        s.content = Some(text);
        s
    }

    /// The call's own step. `attempt` > 1 is the same call sent again (a retry at the same point of the
    /// conversation): it gets its own step id so both attempts are kept.
    pub fn agent_step(&self, call: &NormalizedCall, index: u32, attempt: u32, reuse: Reuse) -> Step {
        let trace = self.trace;
        let mut step = self.step(index, StepRole::Agent);
        if attempt > 1 {
            step.step_id = format!("{}#{attempt}", step.step_id);
        }
        step.content = call.output.text.clone().or(call.output.refusal.clone());
        step.reasoning_content = call.output.reasoning.clone();
        step.model = answering_model(trace, call).map(|m| format!("{}/{m}", trace.upstream));
        step.tool_calls = call.output.tool_calls.iter().map(step_tool_call).collect();
        step.snippets = step
            .content
            .as_deref()
            .map(|t| snippets::fenced_blocks(t, index))
            .unwrap_or_default();
        step.token_usage = token_usage(call, reuse);
        step.reasoning_tokens = call.usage.and_then(|u| u.reasoning);
        step.provider_trace_id = Some(trace.id.clone());
        step.cost_usd = trace.cost;
        step.provider = Some(trace.upstream.clone());
        step.response_id = call.response_id.clone();
        step.finish_reason = call.finish_reason.map(|f| f.as_str().to_owned());
        let (status, error) = status(trace, call);
        step.status = status.to_owned();
        step.error = error;
        step.timings = Some(timings(trace));
        step
    }
}

/// The model that answered, else the one requested.
pub fn answering_model<'a>(trace: &'a ProviderTrace, call: &'a NormalizedCall) -> Option<&'a str> {
    trace.model.as_deref().or(call.model_requested.as_deref())
}

fn step_tool_call(c: &crate::model::call::ToolCall) -> StepToolCall {
    StepToolCall {
        tool_call_id: c.id.clone(),
        tool_name: c.name.clone(),
        input: c.arguments.clone(),
        duration_ms: None,
    }
}

fn token_usage(call: &NormalizedCall, reuse: Reuse) -> TokenUsage {
    let usage = call.usage.unwrap_or_default();
    TokenUsage {
        input_tokens: usage.input,
        output_tokens: usage.output,
        cache_read_tokens: usage.cache_read.unwrap_or(0),
        cache_write_tokens: usage.cache_write.unwrap_or(0),
        prefix_reuse_tokens: reuse.tokens,
        reasoning_tokens: usage.reasoning.unwrap_or(0),
        prefix_reuse_estimated: reuse.estimated,
    }
}

fn timings(trace: &ProviderTrace) -> StepTimings {
    let t = &trace.timings;
    StepTimings {
        started_at: rfc3339(t.start),
        first_token_at: t.first_byte.map(rfc3339),
        ended_at: rfc3339(t.end),
        duration_ms: (t.end - t.start) as f64 / 1000.0,
        time_to_first_token_ms: t.first_byte.map(|f| (f - t.start) as f64 / 1000.0),
    }
}

/// `ok`, `cancelled` (the client left) or `error`, with what went wrong: the provider's error first, then the
/// transport's, then the HTTP status.
pub fn status(trace: &ProviderTrace, call: &NormalizedCall) -> (&'static str, Option<String>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::derive::testkit::*;
    use crate::model::call::CallError;
    use crate::model::exchange::Api;
    use serde_json::json;

    #[test]
    fn step_index_counts_assistant_and_user_turns_and_user_steps_are_only_new_text() {
        let c = call(
            "",
            vec![
                user("task"),
                calls(&[tool_call("c1", "read", json!({}))]),
                result("c1", "x"),
                user("also check b.rs"),
            ],
            text_out("ok"),
        );
        // user 0, assistant 1, tool result (no step), user 2, this call's agent step 3.
        let idx = StepIndexes::count(&c, 3, 0);
        assert_eq!(
            idx,
            StepIndexes {
                user: vec![(2, "also check b.rs".into())],
                agent: 3
            }
        );
        // Server-side state: the request holds only the new turn, counted from where the trajectory is.
        assert_eq!(StepIndexes::count(&c, 3, 10).agent, 13);
        // The first call of a conversation: its user turn is a step.
        let first = call("", vec![user("task")], text_out("ok"));
        assert_eq!(StepIndexes::count(&first, 0, 0).user, vec![(0, "task".to_owned())]);
    }

    #[test]
    fn status_prefers_cancellation_then_provider_error_then_http_status() {
        let mut t = trace(Api::OpenAiChat, T0, T0 + 1);
        let mut c = call("", vec![user("x")], text_out("y"));
        assert_eq!(status(&t, &c), ("ok", None));
        t.status = Some(429);
        assert_eq!(status(&t, &c), ("error", Some("http_429".into())));
        c.error = Some(CallError {
            kind: "rate_limit_exceeded".into(),
            message: "slow down".into(),
        });
        assert_eq!(status(&t, &c), ("error", Some("rate_limit_exceeded: slow down".into())));
        t.outcome = Outcome::ClientGone;
        assert_eq!(status(&t, &c).0, "cancelled");
    }

    #[test]
    fn call_type_follows_purpose() {
        assert_eq!(Purpose::Quota.call_type(), CallType::Warmup);
        assert_eq!(Purpose::Subagent.call_type(), CallType::Subagent);
        assert_eq!(Purpose::Side.call_type(), CallType::Main);
        assert_eq!(Purpose::Compaction.call_type(), CallType::Main);
    }

    #[test]
    fn agent_step_carries_the_call_and_a_retry_gets_its_own_id() {
        let t = trace(Api::OpenAiChat, T0, T0 + 1_500_000);
        let c = call("", vec![user("x")], text_out("Here:\n```rust\nfn a() {}\n```"));
        let base = StepBase {
            traj_id: "tr_1",
            trace: &t,
            session: Some("tr_1"),
            sp_hash: None,
            tools: vec!["read".into()],
            parent: None,
            linked: None,
            call_type: CallType::Main,
            purpose: Purpose::Main,
        };
        let reuse = Reuse {
            tokens: 7,
            estimated: true,
        };
        let s = base.agent_step(&c, 1, 1, reuse);
        assert_eq!(s.step_id, "tr_1/1");
        assert_eq!(s.model.as_deref(), Some("openai/m-1"));
        assert_eq!(s.agent_role.as_deref(), Some("main"));
        assert_eq!(s.tools_available, ["read"]);
        assert_eq!(
            (s.token_usage.input_tokens, s.token_usage.prefix_reuse_tokens),
            (100, 7)
        );
        assert!(s.token_usage.prefix_reuse_estimated);
        assert_eq!(s.snippets[0].language.as_deref(), Some("rust"));
        assert_eq!(s.timings.as_ref().map(|t| t.duration_ms), Some(1500.0));
        assert_eq!(base.agent_step(&c, 1, 2, reuse).step_id, "tr_1/1#2");
        let u = base.user_step(0, "x".into());
        assert_eq!((u.role, u.content.as_deref()), (StepRole::User, Some("x")));
        assert!(u.tools_available.is_empty());
    }
}
