//! ATIF v1.7 trajectories (Harbor RFC 0001): system/user/agent steps numbered from 1, observations in the step of
//! their calls, sub-agents embedded and referenced; every non-ATIF fact under `extra`.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::{TrajectoryData, step_extras, strip_nulls};
use crate::model::step::StepRole;

fn atif_tool_definitions(defs: &[Value]) -> Vec<Value> {
    defs.iter()
        .map(|d| {
            let mut f =
                json!({"name": d.get("name"), "description": d.get("description"), "parameters": d.get("parameters")});
            strip_nulls(&mut f);
            json!({"type": "function", "function": f})
        })
        .collect()
}

pub fn atif(t: &TrajectoryData) -> Value {
    let s = &t.summary;
    let mut steps: Vec<Value> = Vec::new();
    let mut last_system: Option<&str> = None;
    let child_for_call: BTreeMap<(u32, &str), &str> = t
        .children_by_call()
        .into_iter()
        .map(|(k, c)| (k, c.summary.trajectory_id.as_str()))
        .collect();
    for st in &t.steps {
        // A system step when the system prompt first appears and whenever it changes.
        if let Some(h) = st.system_prompt_hash.as_deref()
            && last_system != Some(h)
            && let Some(text) = s.system_prompts.get(h)
        {
            last_system = Some(h);
            steps.push(
                json!({"step_id": steps.len() + 1, "timestamp": st.timestamp, "source": "system", "message": text}),
            );
        }
        match st.role {
            StepRole::User | StepRole::System => {
                let source = if st.role == StepRole::User { "user" } else { "system" };
                steps.push(
                    json!({"step_id": steps.len() + 1, "timestamp": st.timestamp, "source": source,
                    "message": st.content.clone().unwrap_or_default()}),
                );
            }
            StepRole::Agent => {
                let mut results: Vec<Value> = st
                    .observations
                    .iter()
                    .map(|o| {
                        let mut r = json!({"source_call_id": o.source_call_id,
                            "content": o.content.clone().unwrap_or_else(|| format!("[error: {}]", o.error.as_deref().unwrap_or("no_result")))});
                        let mut extra = Map::new();
                        if let Some(e) = &o.error {
                            extra.insert("error".into(), json!(e));
                        }
                        if let Some(c) = child_for_call.get(&(st.step_index, o.source_call_id.as_str())) {
                            r["subagent_trajectory_ref"] = json!([{"trajectory_id": c}]);
                        }
                        if !extra.is_empty() {
                            r["extra"] = Value::Object(extra);
                        }
                        r
                    })
                    .collect();
                // A sub-agent started by a call whose result never came back still gets its reference.
                for ((idx, call), child) in &child_for_call {
                    if *idx == st.step_index && !st.observations.iter().any(|o| o.source_call_id == *call) {
                        results.push(json!({"source_call_id": call, "content": "", "subagent_trajectory_ref": [{"trajectory_id": child}]}));
                    }
                }
                let mut step = json!({
                    "step_id": steps.len() + 1,
                    "timestamp": st.timestamp,
                    "source": "agent",
                    "model_name": st.model,
                    "message": st.content.clone().unwrap_or_default(),
                    "reasoning_content": st.reasoning_content,
                    "tool_calls": st.tool_calls.iter().map(|c| {
                        let mut v = json!({"tool_call_id": c.tool_call_id, "function_name": c.tool_name,
                            "arguments": if c.input.is_object() { c.input.clone() } else { json!({"value": c.input}) }});
                        if let Some(d) = c.duration_ms {
                            v["extra"] = json!({"duration_ms": d, "duration_estimated": true});
                        }
                        v
                    }).collect::<Vec<_>>(),
                    "metrics": {
                        "prompt_tokens": st.token_usage.input_tokens,
                        "completion_tokens": st.token_usage.output_tokens,
                        "cached_tokens": st.token_usage.cache_read_tokens,
                        "extra": {
                            "cache_creation_input_tokens": st.token_usage.cache_write_tokens,
                            "reasoning_tokens": st.token_usage.reasoning_tokens,
                            "prefix_reuse_tokens": st.token_usage.prefix_reuse_tokens,
                            "prefix_reuse_estimated": st.token_usage.prefix_reuse_estimated,
                        },
                    },
                    "llm_call_count": 1,
                    "extra": {
                        "step_index": st.step_index,
                        "call_type": st.call_type,
                        "purpose": st.purpose,
                        "agent_role": st.agent_role,
                        "parent_step": st.parent_step,
                        "system_prompt_hash": st.system_prompt_hash,
                        "tools_available": st.tools_available,
                        "snippets": st.snippets,
                        "llmtap": step_extras(st),
                    },
                });
                if !results.is_empty() {
                    step["observation"] = json!({"results": results});
                }
                if st.tool_calls.is_empty()
                    && let Value::Object(m) = &mut step
                {
                    m.remove("tool_calls");
                }
                strip_nulls(&mut step);
                if let Some(e) = step.get_mut("extra") {
                    strip_nulls(e);
                }
                steps.push(step);
            }
        }
    }
    if steps.is_empty() {
        // ATIF requires at least one step; an empty trajectory still says what it was.
        steps.push(json!({"step_id": 1, "source": "system", "message": ""}));
    }
    let mut out = json!({
        "schema_version": "ATIF-v1.7",
        "session_id": s.session_id.clone().unwrap_or_else(|| s.trajectory_id.clone()),
        "trajectory_id": s.trajectory_id,
        "agent": {
            "name": s.agent.clone().unwrap_or_else(|| "unknown".into()),
            "version": "unknown",
            "model_name": s.models.first(),
            "tool_definitions": atif_tool_definitions(&s.tool_definitions),
        },
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": s.input_tokens,
            "total_completion_tokens": s.output_tokens,
            "total_cached_tokens": s.cache_read_tokens,
            "total_steps": t.steps.len(),
        },
        "extra": {
            "source": "llmtap",
            "llm_calls": s.llm_calls,
            "call_types": s.call_types,
            "parent_trajectory_id": s.parent_trajectory_id,
            "parent_step": s.parent_step,
            "continues": s.continues,
            "started_at": s.started_at,
            "ended_at": s.ended_at,
        },
    });
    if let Some(a) = out.get_mut("agent") {
        strip_nulls(a);
    }
    if let Some(e) = out.get_mut("extra") {
        strip_nulls(e);
    }
    // ATIF has no field for what people said about a run: its extension field holds them.
    if !t.annotations.is_empty() {
        out["extra"]["annotations"] = Value::Array(t.annotations.iter().map(|a| a.to_json()).collect());
    }
    if !t.children.is_empty() {
        out["subagent_trajectories"] = Value::Array(t.children.iter().map(atif).collect());
    }
    out
}
