//! Letta steps (seed 004): one JSON line per LLM call with the four shapes Letta's step API returns for it —
//! `step` (Step), `metrics` (StepMetrics), `provider_trace` (ProviderTrace, the raw request/response JSON) and
//! `messages` (the LettaMessage union of `GET /v1/steps/{id}/messages`) — plus `extra` for what Letta has no slot
//! for (trajectory and step ids, call type, parent links, prefix reuse, snippets).
//!
//! Decisions: `run_id` is the trajectory id (Letta's run = one agent loop); ids take Letta's prefixed form with
//! a UUID derived from llmtap's own ids, so re-exports are stable; user text and system prompts found in the
//! request become `user_message` / `system_message` of the step that answered them; tool results, which a proxy
//! sees in the *next* request, are returned in the step of their call (Letta runs tools inside the step).

use serde_json::{Map, Value, json};

use super::{TrajectoryData, derived_uuid, step_extras, strip_nulls};
use crate::model::step::{CallType, Purpose, Step, StepRole};
use crate::model::trace::ProviderTrace;

fn letta_id(prefix: &str, id: &str) -> String {
    format!("{prefix}-{}", derived_uuid(prefix, id))
}

/// Letta `StopReasonType` from the canonical finish reason and status. A tool call leaves it unset: the loop
/// goes on (`no_tool_call` means something else in Letta).
fn stop_reason(s: &Step) -> Option<&'static str> {
    match s.status.as_str() {
        "cancelled" => return Some("cancelled"),
        "error" => return Some("llm_api_error"),
        _ => {}
    }
    match s.finish_reason.as_deref()? {
        "stop" => Some("end_turn"),
        "length" => Some("max_tokens_exceeded"),
        "content_filter" => Some("invalid_llm_response"),
        "error" => Some("llm_api_error"),
        _ => None,
    }
}

fn step_status(s: &Step) -> &'static str {
    match s.status.as_str() {
        "error" => "failed",
        "cancelled" => "cancelled",
        _ => "success",
    }
}

fn bare_model(s: &Step) -> Option<&str> {
    s.model
        .as_deref()
        .map(|m| m.split_once('/').map_or(m, |(_, name)| name))
}

fn unix_ns(rfc3339: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .ok()?
        .timestamp_nanos_opt()
}

/// The request parameters Letta keeps in `llm_config`, read from the provider request when present.
fn llm_config(s: &Step, trace: Option<&ProviderTrace>) -> Value {
    let req = trace.map(|t| t.request.view());
    let pick = |keys: &[&str]| -> Option<Value> {
        let req = req.as_ref()?;
        keys.iter().find_map(|k| {
            let v = k.split('.').try_fold(req, |v, part| v.get(part))?;
            (!v.is_null()).then(|| v.to_value())
        })
    };
    let mut c = json!({
        "model": bare_model(s),
        "model_endpoint_type": s.provider,
        "model_endpoint": trace.map(|t| format!("/{}{}", t.upstream, t.path)),
        "max_tokens": pick(&["max_tokens", "max_completion_tokens", "max_output_tokens", "generationConfig.maxOutputTokens"]),
        "temperature": pick(&["temperature", "generationConfig.temperature"]),
        "reasoning_effort": pick(&["reasoning_effort", "reasoning.effort"]),
        "stream": trace.map(|t| t.streamed),
    });
    strip_nulls(&mut c);
    c
}

/// Letta wants objects for request_json / response_json; anything else (a non-JSON body) is wrapped.
fn as_object(v: &Value) -> Value {
    match v {
        Value::Object(_) => v.clone(),
        Value::Null => json!({}),
        other => json!({ "body": other }),
    }
}

/// Everything a trajectory needs to emit its Letta records.
pub struct LettaContext<'a> {
    /// The OTLP trace id (hex) of the trajectory tree: Letta's `Step.trace_id`.
    pub otel_trace_id: &'a str,
}

/// Calls `emit` once per LLM call of the trajectory, in order. `trace_for` loads a provider trace by id (one
/// at a time, so a long trajectory never holds every request body in memory).
pub fn letta(
    t: &TrajectoryData,
    ctx: &LettaContext<'_>,
    mut trace_for: impl FnMut(&str) -> Option<ProviderTrace>,
    mut emit: impl FnMut(Value),
) {
    let s = &t.summary;
    let run_id = s.trajectory_id.as_str();
    let agent_id = s.agent.as_deref();
    let mut seq: i64 = 0;
    let mut pending: Vec<Value> = Vec::new();
    let mut last_system: Option<&str> = None;
    let mut records: Vec<Value> = Vec::new();
    let mut message = |kind: &str, step_id: Option<&str>, date: &str, key: &str, fields: Value| -> Value {
        seq += 1;
        let mut m = json!({
            "id": letta_id("message", &format!("{run_id}\u{1}{key}")),
            "date": date,
            "message_type": kind,
            "name": agent_id,
            "step_id": step_id,
            "run_id": run_id,
            "seq_id": seq,
        });
        if let (Value::Object(m), Value::Object(f)) = (&mut m, fields) {
            m.extend(f);
        }
        strip_nulls(&mut m);
        m
    };
    for st in &t.steps {
        let letta_step = (st.role == StepRole::Agent).then(|| letta_id("step", &st.step_id));
        if let Some(h) = st.system_prompt_hash.as_deref()
            && last_system != Some(h)
            && let Some(text) = s.system_prompts.get(h)
        {
            last_system = Some(h);
            pending.push(message(
                "system_message",
                None,
                &st.timestamp,
                &format!("{}/system", st.step_id),
                json!({"content": text}),
            ));
        }
        let Some(step_id) = letta_step else {
            let kind = if st.role == StepRole::User {
                "user_message"
            } else {
                "system_message"
            };
            pending.push(message(
                kind,
                None,
                &st.timestamp,
                &st.step_id,
                json!({"content": st.content.clone().unwrap_or_default()}),
            ));
            continue;
        };
        // The input messages belong to the step that answered them.
        let mut messages: Vec<Value> = pending
            .drain(..)
            .map(|mut m| {
                m["step_id"] = json!(step_id);
                m
            })
            .collect();
        let date = st
            .timings
            .as_ref()
            .map_or(st.timestamp.as_str(), |t| t.ended_at.as_str());
        if let Some(r) = st.reasoning_content.as_deref().filter(|r| !r.is_empty()) {
            messages.push(message(
                "reasoning_message",
                Some(&step_id),
                date,
                &format!("{}/reasoning", st.step_id),
                json!({"reasoning": r, "source": "reasoner_model"}),
            ));
        }
        if let Some(c) = st.content.as_deref().filter(|c| !c.is_empty()) {
            messages.push(message(
                "assistant_message",
                Some(&step_id),
                date,
                &format!("{}/assistant", st.step_id),
                json!({"content": c}),
            ));
        }
        for c in &st.tool_calls {
            let arguments = match &c.input {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            messages.push(message(
                "tool_call_message",
                Some(&step_id),
                date,
                &format!("{}/call/{}", st.step_id, c.tool_call_id),
                json!({"tool_call": {"name": c.tool_name, "arguments": arguments, "tool_call_id": c.tool_call_id}}),
            ));
        }
        for o in &st.observations {
            let is_err = o.error.is_some();
            let content = o
                .content
                .clone()
                .unwrap_or_else(|| format!("[error: {}]", o.error.as_deref().unwrap_or("no_result")));
            messages.push(message(
                "tool_return_message",
                Some(&step_id),
                date,
                &format!("{}/return/{}", st.step_id, o.source_call_id),
                json!({"tool_return": content, "status": if is_err { "error" } else { "success" },
                       "tool_call_id": o.source_call_id, "is_err": is_err,
                       "name": st.tool_calls.iter().find(|c| c.tool_call_id == o.source_call_id).map(|c| &c.tool_name)}),
            ));
        }
        let trace = st.provider_trace_id.as_deref().and_then(&mut trace_for);
        records.push(step_record(
            st,
            &step_id,
            ctx,
            s.agent.as_deref(),
            run_id,
            trace.as_ref(),
            messages,
        ));
    }
    // Input that no call answered (a trailing user turn) stays with the last step rather than being dropped.
    if !pending.is_empty()
        && let Some(Value::Array(m)) = records.last_mut().and_then(|r| r.get_mut("messages"))
    {
        m.append(&mut pending);
    }
    for r in records {
        emit(r);
    }
}

fn step_record(
    st: &Step,
    step_id: &str,
    ctx: &LettaContext<'_>,
    agent_id: Option<&str>,
    run_id: &str,
    trace: Option<&ProviderTrace>,
    messages: Vec<Value>,
) -> Value {
    let u = &st.token_usage;
    // Steps name models "provider/model" (opentraces); Letta keeps that as the handle and the bare name as model.
    let model_handle = st.model.clone();
    let model = bare_model(st);
    let mut tags = vec![st.call_type.map_or("main", CallType::as_str).to_owned()];
    if let Some(r) = &st.agent_role {
        tags.push(format!("agent_role:{r}"));
    }
    let error = st.error.as_deref().map(|e| {
        let (kind, message) = e.split_once(": ").unwrap_or(("error", e));
        (kind.to_owned(), message.to_owned())
    });
    let mut step = json!({
        "id": step_id,
        "origin": "llmtap",
        "provider_id": trace.map(|t| t.upstream.clone()),
        "run_id": run_id,
        "agent_id": agent_id,
        "provider_name": st.provider,
        "model": model,
        "model_handle": model_handle,
        "model_endpoint": trace.map(|t| format!("/{}{}", t.upstream, t.path)),
        "completion_tokens": u.output_tokens,
        "prompt_tokens": u.input_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "cached_input_tokens": u.cache_read_tokens,
        "cache_write_tokens": u.cache_write_tokens,
        "reasoning_tokens": st.reasoning_tokens,
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": u.cache_read_tokens, "cache_creation_tokens": u.cache_write_tokens},
        "stop_reason": stop_reason(st),
        "tags": tags,
        "trace_id": ctx.otel_trace_id,
        "request_id": st.response_id,
        "error_type": error.as_ref().map(|e| e.0.clone()),
        "error_data": error.as_ref().map(|e| json!({"message": e.1, "finish_reason": st.finish_reason})),
        "status": step_status(st),
    });
    strip_nulls(&mut step);

    let timings = st.timings.as_ref();
    let start_ns = timings.and_then(|t| unix_ns(&t.started_at));
    let llm_ns = timings.map(|t| (t.duration_ms * 1e6) as i64);
    // Parallel calls share one window between response and next request, so the step's tool time is the
    // longest of them (an upper bound: it includes the client's own time).
    let tool_ns = st
        .tool_calls
        .iter()
        .filter_map(|c| c.duration_ms)
        .max()
        .map(|ms| ms as i64 * 1_000_000);
    let mut metrics = json!({
        "id": step_id,
        "provider_id": trace.map(|t| t.upstream.clone()),
        "run_id": run_id,
        "agent_id": agent_id,
        "step_start_ns": start_ns,
        "llm_request_start_ns": start_ns,
        "llm_request_ns": llm_ns,
        "tool_execution_ns": tool_ns,
        "step_ns": llm_ns.map(|l| l + tool_ns.unwrap_or(0)),
    });
    strip_nulls(&mut metrics);

    let provider_trace = trace.map(|t| {
        // Letta's LLMCallType: a compaction call is `summarization` (and carries no llm_config).
        let summarization = st.purpose == Some(Purpose::Compaction);
        let call_type = match st.call_type {
            _ if summarization => "summarization",
            Some(CallType::Warmup) => "warmup",
            _ => "agent_step",
        };
        let mut p = json!({
            "id": letta_id("provider_trace", &t.id),
            "created_at": st.timings.as_ref().map_or(st.timestamp.as_str(), |x| x.started_at.as_str()),
            "request_json": as_object(&t.request.to_value()),
            "response_json": as_object(&t.response.to_value()),
            "step_id": step_id,
            "agent_id": agent_id,
            "agent_tags": st.agent_role.as_ref().map(|r| vec![r.clone()]),
            "call_type": call_type,
            "run_id": run_id,
            "source": "llmtap",
            "llm_config": (!summarization).then(|| llm_config(st, Some(t))),
        });
        strip_nulls(&mut p);
        p
    });

    let mut extra = Map::new();
    extra.insert("trajectory_id".into(), json!(st.trajectory_id));
    extra.insert("step_index".into(), json!(st.step_index));
    extra.insert("call_type".into(), json!(st.call_type));
    extra.insert("purpose".into(), json!(st.purpose));
    extra.insert("agent_role".into(), json!(st.agent_role));
    extra.insert("parent_step".into(), json!(st.parent_step));
    extra.insert("system_prompt_hash".into(), json!(st.system_prompt_hash));
    extra.insert("tools_available".into(), json!(st.tools_available));
    extra.insert("prefix_reuse_tokens".into(), json!(u.prefix_reuse_tokens));
    extra.insert("snippets".into(), json!(st.snippets));
    extra.insert("llmtap".into(), step_extras(st));
    let mut extra = Value::Object(extra);
    strip_nulls(&mut extra);
    json!({
        "step": step,
        "metrics": metrics,
        "provider_trace": provider_trace,
        "messages": messages,
        "extra": extra,
    })
}
