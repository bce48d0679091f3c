//! TurnWise conversations (seed 000): one conversation per top-level trajectory, sub-agents included under their
//! own `agent_name`. Messages follow the user turns: a `system` message for the system prompt, a `user` message
//! per new user text, and one `assistant` message per turn spanning every LLM call until the next user message.
//! Inside it, a call with k tool calls becomes k steps `{thinking (first only), tool_call, tool_result}` (TurnWise
//! tool calls have no ids, so the result rides in the step of its call; the id is kept in `meta`), and a call
//! without tool calls becomes one step with `output_content` (and `output_structured` when the text is a JSON
//! object). A sub-agent's steps sit between the call that started it and that call's result. Tokens, latency,
//! ids and status, which TurnWise has no slot for, go in `meta`.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::{TrajectoryData, duration_s, strip_nulls};
use crate::model::step::{Step, StepRole};

fn agent_name(t: &TrajectoryData) -> String {
    let s = &t.summary;
    match (&s.agent, s.parent_trajectory_id.is_some()) {
        (Some(a), _) => a.clone(),
        (None, false) => "main".into(),
        (None, true) => {
            let role = t.steps.iter().find_map(|x| x.agent_role.clone());
            format!("subagent:{}", role.unwrap_or_else(|| s.trajectory_id.clone()))
        }
    }
}

fn step_meta(st: &Step) -> Map<String, Value> {
    let u = &st.token_usage;
    let mut m = json!({
        "step_id": st.step_id,
        "trajectory_id": st.trajectory_id,
        "step_index": st.step_index,
        "timestamp": st.timestamp,
        "latency_ms": st.timings.as_ref().map(|t| t.duration_ms),
        "time_to_first_token_ms": st.timings.as_ref().and_then(|t| t.time_to_first_token_ms),
        "call_type": st.call_type,
        "finish_reason": st.finish_reason,
        "status": st.status,
        "error": st.error,
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_read_tokens": u.cache_read_tokens,
        "cache_write_tokens": u.cache_write_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "prefix_reuse_tokens": u.prefix_reuse_tokens,
        "provider_trace_id": st.provider_trace_id,
    });
    strip_nulls(&mut m);
    match m {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// Builds the messages of one conversation, walking a trajectory and, at the calls that started them, its
/// sub-agents.
struct Conversation<'a> {
    messages: Vec<Value>,
    /// Steps of the assistant message being built (the current user turn).
    turn_steps: Vec<Value>,
    turn_text: Option<String>,
    turn_meta: Map<String, Value>,
    last_system: Option<&'a str>,
    pending_input: Option<String>,
}

impl<'a> Conversation<'a> {
    fn close_turn(&mut self) {
        if self.turn_steps.is_empty() {
            return;
        }
        let mut m = json!({
            "role": "assistant",
            "content": self.turn_text.take().unwrap_or_default(),
            "steps": std::mem::take(&mut self.turn_steps),
        });
        if !self.turn_meta.is_empty() {
            m["meta"] = Value::Object(std::mem::take(&mut self.turn_meta));
        }
        self.messages.push(m);
    }

    fn walk(&mut self, t: &'a TrajectoryData, top_level: bool) {
        let s = &t.summary;
        let agent = agent_name(t);
        let children = t.children_by_call();
        for st in &t.steps {
            // Only the top-level agent's prompt and user turns shape the conversation; a sub-agent's instructions
            // arrive as its first user text and are kept in the step meta instead.
            if top_level
                && let Some(h) = st.system_prompt_hash.as_deref()
                && self.last_system != Some(h)
                && let Some(text) = s.system_prompts.get(h)
            {
                self.last_system = Some(h);
                self.close_turn();
                self.messages
                    .push(json!({"role": "system", "content": text, "meta": {"system_prompt_hash": h}}));
            }
            match st.role {
                StepRole::User | StepRole::System if top_level => {
                    self.close_turn();
                    let role = if st.role == StepRole::User { "user" } else { "system" };
                    self.messages
                        .push(json!({"role": role, "content": st.content.clone().unwrap_or_default(),
                        "meta": {"step_id": st.step_id, "timestamp": st.timestamp}}));
                }
                // A sub-agent's own user text is its task, already visible as the parent's tool call arguments; it
                // is kept in the meta of the sub-agent's next step.
                StepRole::User | StepRole::System => self.pending_input = st.content.clone(),
                StepRole::Agent => self.agent_step(t, st, &agent, &children),
            }
        }
    }

    fn agent_step(
        &mut self,
        t: &'a TrajectoryData,
        st: &Step,
        agent: &str,
        children: &BTreeMap<(u32, &str), &'a TrajectoryData>,
    ) {
        let model = st.model.clone().unwrap_or_else(|| "unknown".into());
        let thinking = st.reasoning_content.clone().filter(|r| !r.is_empty());
        let content = st.content.clone().filter(|c| !c.is_empty());
        let mut meta = step_meta(st);
        if let Some(input) = self.pending_input.take() {
            meta.insert("input".into(), json!(input));
        }
        // The assistant message says what the user got: the turn's last text, which after a handoff is the
        // sub-agent's (a Task-style parent that answers afterwards overrides it).
        if let Some(c) = &content {
            self.turn_text = Some(c.clone());
        }
        for k in ["input_tokens", "output_tokens"] {
            let add = meta.get(k).and_then(Value::as_u64).unwrap_or(0);
            let total = self.turn_meta.get(k).and_then(Value::as_u64).unwrap_or(0) + add;
            self.turn_meta.insert(k.into(), json!(total));
        }
        let calls = self.turn_meta.get("llm_calls").and_then(Value::as_u64).unwrap_or(0) + 1;
        self.turn_meta.insert("llm_calls".into(), json!(calls));
        if st.tool_calls.is_empty() {
            let mut step = json!({"model_name": model, "agent_name": agent, "thinking": thinking,
                "output_content": content.clone().unwrap_or_default(), "meta": meta});
            if let Some(obj) = content
                .as_deref()
                .and_then(|c| serde_json::from_str::<Value>(c.trim()).ok())
                .filter(Value::is_object)
            {
                step["output_structured"] = obj;
            }
            strip_nulls(&mut step);
            self.turn_steps.push(step);
            return;
        }
        for (i, call) in st.tool_calls.iter().enumerate() {
            let observation = st.observations.iter().find(|o| o.source_call_id == call.tool_call_id);
            let mut meta = if i == 0 { meta.clone() } else { Map::new() };
            meta.insert("tool_call_id".into(), json!(call.tool_call_id));
            if let Some(d) = call.duration_ms {
                meta.insert("tool_duration_ms".into(), json!(d));
                meta.insert("tool_duration_estimated".into(), json!(true));
            }
            let arguments = if call.input.is_object() {
                call.input.clone()
            } else {
                json!({"value": call.input})
            };
            let mut step = json!({"model_name": model, "agent_name": agent,
                "tool_call": {"name": call.tool_name, "arguments": arguments}});
            if i == 0 {
                if let Some(th) = &thinking {
                    step["thinking"] = json!(th);
                }
                if let Some(c) = &content {
                    step["output_content"] = json!(c);
                }
            }
            let child = children.get(&(st.step_index, call.tool_call_id.as_str()));
            let result = observation.map(|o| {
                if let Some(e) = &o.error {
                    meta.insert("tool_error".into(), json!(e));
                }
                o.content
                    .clone()
                    .unwrap_or_else(|| format!("[error: {}]", o.error.as_deref().unwrap_or("no_result")))
            });
            match (child, result) {
                // The sub-agent ran between the call and its result: call, the sub-agent's steps, then the result.
                (Some(child), result) => {
                    meta.insert("subagent_trajectory_id".into(), json!(child.summary.trajectory_id));
                    step["meta"] = Value::Object(meta);
                    self.turn_steps.push(step);
                    self.walk(child, false);
                    if let Some(r) = result {
                        self.turn_steps
                            .push(json!({"model_name": model, "agent_name": agent, "tool_result": r,
                            "meta": {"tool_call_id": call.tool_call_id, "trajectory_id": t.summary.trajectory_id}}));
                    }
                }
                (None, result) => {
                    if let Some(r) = result {
                        step["tool_result"] = json!(r);
                    }
                    step["meta"] = Value::Object(meta);
                    self.turn_steps.push(step);
                }
            }
        }
    }
}

fn agents(t: &TrajectoryData, out: &mut Vec<Value>) {
    let name = agent_name(t);
    if !out.iter().any(|a| a["name"] == name.as_str()) {
        let tools: Map<String, Value> = t
            .summary
            .tool_definitions
            .iter()
            .filter_map(|d| Some((d.get("name")?.as_str()?.to_owned(), d.clone())))
            .collect();
        let role = t.steps.iter().find_map(|x| x.agent_role.clone());
        let mut a = json!({"name": name, "tools": tools,
            "meta": {"trajectory_id": t.summary.trajectory_id, "agent_role": role, "models": t.summary.models}});
        if let Some(m) = a.get_mut("meta") {
            strip_nulls(m);
        }
        out.push(a);
    }
    for c in &t.children {
        agents(c, out);
    }
}

/// One TurnWise conversation for a top-level trajectory and the sub-agents it started.
pub fn turnwise_conversation(t: &TrajectoryData) -> Value {
    let mut conv = Conversation {
        messages: Vec::new(),
        turn_steps: Vec::new(),
        turn_text: None,
        turn_meta: Map::new(),
        last_system: None,
        pending_input: None,
    };
    conv.walk(t, true);
    conv.close_turn();
    let s = &t.summary;
    let mut agent_list = Vec::new();
    agents(t, &mut agent_list);
    let first_user = t
        .steps
        .iter()
        .find(|x| x.role == StepRole::User)
        .and_then(|x| x.content.as_deref())
        .map(|c| c.chars().take(200).collect::<String>());
    let mut meta = json!({
        "source": "llmtap",
        "trajectory_id": s.trajectory_id,
        "session_id": s.session_id,
        "models": s.models,
        "started_at": s.started_at,
        "ended_at": s.ended_at,
        "duration_s": duration_s(&s.started_at, &s.ended_at),
        "llm_calls": s.llm_calls,
        "input_tokens": s.input_tokens,
        "output_tokens": s.output_tokens,
        "cache_read_tokens": s.cache_read_tokens,
        "continues": s.continues,
        "subagent_trajectory_ids": t.children.iter().map(|c| c.summary.trajectory_id.clone()).collect::<Vec<_>>(),
    });
    strip_nulls(&mut meta);
    let mut out = json!({
        "name": s.trajectory_id,
        "description": first_user,
        "agents": agent_list,
        "messages": conv.messages,
        "meta": meta,
    });
    strip_nulls(&mut out);
    out
}
