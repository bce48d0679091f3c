//! opentraces.ai TraceRecord (seed 001, schema 0.2.0): one record per trajectory, steps nearly 1:1.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::{TrajectoryData, derived_uuid, duration_s, step_extras, strip_nulls};
use crate::model::step::StepRole;

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
        "trace_id": derived_uuid("opentraces", &s.trajectory_id),
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
    annotate(&mut record, t);
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

/// People's annotations: every one under `metadata.annotations`, and the latest score on the trajectory itself
/// (else on its session) as the record's `outcome`, the seed's place for a human reward signal
/// (`signal_confidence: annotated`, `reward_source: human_annotation`) with its note as the description.
fn annotate(record: &mut Value, t: &TrajectoryData) {
    use crate::model::annotation::AnnotationTarget;
    if t.annotations.is_empty() {
        return;
    }
    record["metadata"]["annotations"] = Value::Array(t.annotations.iter().map(|a| a.to_json()).collect());
    let scored = |target: AnnotationTarget| {
        t.annotations
            .iter()
            .rev()
            .find(|a| a.target == target && a.score.is_some())
    };
    if let Some(a) = scored(AnnotationTarget::Trajectory).or_else(|| scored(AnnotationTarget::Session)) {
        let mut outcome = json!({
            "signal_source": "human",
            "signal_confidence": "annotated",
            "reward": a.score,
            "reward_source": "human_annotation",
            "description": a.note,
        });
        strip_nulls(&mut outcome);
        record["outcome"] = outcome;
    }
}
