//! Trajectory formats users already have: opentraces TraceRecord (seed 001, schema 0.2.0), ATIF v1.7
//! trajectories (Harbor RFC) and Invariant traces (seed 003). One trajectory in memory at a time; what a format has no slot for goes in its
//! extension field (`metadata` / `extra`), never dropped.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::model::step::{Step, StepRole, TrajectorySummary};

/// A trajectory with its steps (step_index order) and the trajectories it started.
pub struct TrajectoryData {
    pub summary: TrajectorySummary,
    pub steps: Vec<Step>,
    pub children: Vec<TrajectoryData>,
}

fn duration_s(a: &str, b: &str) -> Option<f64> {
    let a = chrono::DateTime::parse_from_rfc3339(a).ok()?;
    let b = chrono::DateTime::parse_from_rfc3339(b).ok()?;
    Some((b - a).num_milliseconds() as f64 / 1000.0)
}

/// A UUID (RFC 9562 v8, custom) derived from the trajectory id, so re-exports keep the same trace_id.
fn derived_uuid(id: &str) -> String {
    let d = Sha256::digest(format!("opentraces\u{1}{id}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    uuid::Builder::from_custom_bytes(b).into_uuid().to_string()
}

fn strip_nulls(v: &mut Value) {
    if let Value::Object(m) = v {
        m.retain(|_, x| !x.is_null());
    }
}

/// Facts beyond the seed's Step fields, kept per step under the record's `metadata`.
fn step_extras(s: &Step) -> Value {
    let mut v = json!({
        "step_id": s.step_id,
        "provider_trace_id": s.provider_trace_id,
        "provider": s.provider,
        "response_id": s.response_id,
        "finish_reason": s.finish_reason,
        "status": s.status,
        "error": s.error,
        "timings": s.timings,
        "reasoning_tokens": s.reasoning_tokens,
        "prefix_reuse_estimated": s.token_usage.prefix_reuse_estimated,
        "parent_trajectory_id": s.parent_trajectory_id,
        "parent_tool_call_id": s.parent_tool_call_id,
    });
    strip_nulls(&mut v);
    v
}

pub fn opentraces(t: &TrajectoryData) -> Value {
    let s = &t.summary;
    let children: BTreeMap<u32, Vec<&str>> = t.children.iter().fold(BTreeMap::new(), |mut m, c| {
        if let Some(p) = c.summary.parent_step {
            m.entry(p).or_default().push(c.summary.trajectory_id.as_str());
        }
        m
    });
    let mut extras = Map::new();
    let mut inline_snippets = Vec::new();
    let steps: Vec<Value> = t
        .steps
        .iter()
        .map(|st| {
            extras.insert(st.step_index.to_string(), step_extras(st));
            let (with_path, inline): (Vec<_>, Vec<_>) = st.snippets.iter().partition(|sn| sn.file_path.is_some());
            inline_snippets.extend(inline.into_iter().map(|sn| json!({"step_index": st.step_index, "snippet": sn})));
            let mut v = json!({
                "step_index": st.step_index,
                "role": st.role,
                "content": st.content,
                "reasoning_content": st.reasoning_content,
                "model": st.model,
                "system_prompt_hash": st.system_prompt_hash,
                "agent_role": st.agent_role,
                "parent_step": st.parent_step,
                "call_type": st.call_type,
                "subagent_trajectory_ref": children.get(&st.step_index).and_then(|c| c.first()),
                "tools_available": st.tools_available,
                "tool_calls": st.tool_calls.iter().map(|c| {
                    let mut v = json!({"tool_call_id": c.tool_call_id, "tool_name": c.tool_name, "input": c.input, "duration_ms": c.duration_ms});
                    strip_nulls(&mut v);
                    v
                }).collect::<Vec<_>>(),
                "observations": st.observations,
                "snippets": with_path,
                "token_usage": {
                    "input_tokens": st.token_usage.input_tokens,
                    "output_tokens": st.token_usage.output_tokens,
                    "cache_read_tokens": st.token_usage.cache_read_tokens,
                    "cache_write_tokens": st.token_usage.cache_write_tokens,
                    "prefix_reuse_tokens": st.token_usage.prefix_reuse_tokens,
                },
                "timestamp": st.timestamp,
            });
            strip_nulls(&mut v);
            v
        })
        .collect();
    let agent_steps = t.steps.iter().filter(|x| x.role == StepRole::Agent).count() as u64;
    let cache_hit_rate = if s.input_tokens > 0 {
        s.cache_read_tokens as f64 / s.input_tokens as f64
    } else {
        0.0
    };
    let mut record = json!({
        "schema_version": "0.2.0",
        "trace_id": derived_uuid(&s.trajectory_id),
        "session_id": s.trajectory_id,
        "timestamp_start": s.started_at,
        "timestamp_end": s.ended_at,
        "execution_context": "runtime",
        "agent": {"name": s.agent.clone().unwrap_or_else(|| "unknown".into()), "model": t.steps.iter().find_map(|x| x.model.clone())},
        "system_prompts": s.system_prompts,
        "tool_definitions": s.tool_definitions,
        "steps": steps,
        "metrics": {
            "total_steps": t.steps.len(),
            "total_input_tokens": s.input_tokens,
            "total_output_tokens": s.output_tokens,
            "total_duration_s": duration_s(&s.started_at, &s.ended_at),
            "cache_hit_rate": cache_hit_rate,
        },
        "metadata": {
            "source": "llmtap",
            "trajectory_id": s.trajectory_id,
            "session_id": s.session_id,
            "llm_calls": s.llm_calls,
            "agent_steps": agent_steps,
            "call_types": s.call_types,
            "parent_trajectory_id": s.parent_trajectory_id,
            "parent_step": s.parent_step,
            "continues": s.continues,
            "steps": extras,
            "inline_snippets": inline_snippets,
        },
    });
    if let Some(m) = record.get_mut("metadata") {
        strip_nulls(m);
    }
    if let Some(a) = record.get_mut("agent") {
        strip_nulls(a);
    }
    // content_hash: SHA-256 of the record without trace_id and content_hash (the seed's definition).
    let hash: String = Sha256::digest(record.to_string().as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if let Value::Object(m) = &mut record {
        m.insert("content_hash".into(), Value::String(hash));
    }
    record
}

// === ATIF ===

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
        .children
        .iter()
        .filter_map(|c| {
            let call = c.steps.iter().find_map(|x| x.parent_tool_call_id.as_deref())?;
            Some(((c.summary.parent_step?, call), c.summary.trajectory_id.as_str()))
        })
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
    if !t.children.is_empty() {
        out["subagent_trajectories"] = Value::Array(t.children.iter().map(atif).collect());
    }
    out
}

// === Invariant ===

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
