//! Invariant Labs traces (seed 003): a JSON array of OpenAI-style events per trajectory, metadata first.

use serde_json::{Value, json};

use super::{TrajectoryData, strip_nulls};
use crate::model::step::StepRole;

/// One Invariant trace: `[{"metadata": …}, system?, user, assistant{content, tool_calls}, tool{…}, …]`.
/// Usage, model and everything Invariant has no slot for (reasoning, timings, call types) go in the leading
/// metadata element, as invariant-gateway does.
pub fn invariant(t: &TrajectoryData) -> Value {
    let s = &t.summary;
    let mut events = Vec::new();
    let mut per_step = Vec::new();
    let mut last_system: Option<&str> = None;
    for st in &t.steps {
        if let Some(h) = st.system_prompt_hash.as_deref()
            && last_system != Some(h)
            && let Some(text) = s.system_prompts.get(h)
        {
            last_system = Some(h);
            events.push(json!({"role": "system", "content": text}));
        }
        match st.role {
            StepRole::User | StepRole::System => {
                let role = if st.role == StepRole::User { "user" } else { "system" };
                events.push(json!({"role": role, "content": st.content.clone().unwrap_or_default()}));
            }
            StepRole::Agent => {
                let mut e = json!({"role": "assistant", "content": st.content});
                if !st.tool_calls.is_empty() {
                    e["tool_calls"] = Value::Array(
                        st.tool_calls
                            .iter()
                            .map(|c| {
                                json!({"id": c.tool_call_id, "type": "function",
                                "function": {"name": c.tool_name, "arguments": c.input}})
                            })
                            .collect(),
                    );
                }
                events.push(e);
                for o in &st.observations {
                    let content = o
                        .content
                        .clone()
                        .unwrap_or_else(|| format!("[error: {}]", o.error.as_deref().unwrap_or("no_result")));
                    events.push(json!({"role": "tool", "tool_call_id": o.source_call_id, "content": content}));
                }
                let mut m = json!({"step_index": st.step_index, "model": st.model, "reasoning_content": st.reasoning_content,
                    "call_type": st.call_type, "finish_reason": st.finish_reason, "status": st.status,
                    "usage": st.token_usage, "timestamp": st.timestamp});
                strip_nulls(&mut m);
                per_step.push(m);
            }
        }
    }
    let mut metadata = json!({
        "source": "llmtap",
        "trajectory_id": s.trajectory_id,
        "session_id": s.session_id,
        "agent": s.agent,
        "model": s.models.first(),
        "models": s.models,
        "usage": {"input_tokens": s.input_tokens, "output_tokens": s.output_tokens, "cache_read_tokens": s.cache_read_tokens},
        "parent_trajectory_id": s.parent_trajectory_id,
        "parent_step": s.parent_step,
        "started_at": s.started_at,
        "ended_at": s.ended_at,
        "steps": per_step,
    });
    strip_nulls(&mut metadata);
    let mut out = vec![json!({"metadata": metadata})];
    out.extend(events);
    Value::Array(out)
}
