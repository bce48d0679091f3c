//! Store records → OTLP spans in the OpenTelemetry GenAI conventions (v1.41.1).
//!
//! Ids are derived, never random, so that a re-export after a retry or restart produces the same spans:
//! trace id = hash of the root trajectory (sub-agents share their parent's trace), span ids = hash of what the
//! span stands for. Tree: `invoke_agent {agent}` (emitted when the trajectory closes) ⊃ `chat {model}` per call
//! and `execute_tool {name}` per tool result; a sub-agent's `invoke_agent` sits under its parent's tool span.
//! An agent's own W3C `traceparent` wins for its chat spans.

use std::collections::HashMap;

use opentelemetry_proto::tonic::common::v1::{AnyValue, ArrayValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::model::call::{Message, NormalizedCall, Part, Role};
use crate::model::record::ExportKind;
use crate::model::step::{Step, StepSpanFacts, TrajectorySummary};
use crate::model::trace::{CallFacts, ProviderTrace};
use crate::provider::{CallContext, adapter_for};
use crate::semconv as sc;
use crate::store::{StoreError, StoreReader};

pub struct SpanBuilder<'a> {
    pub reader: &'a StoreReader,
    pub capture_content: bool,
    /// Upstream name → (host, port), for server.address / server.port.
    pub servers: &'a HashMap<String, (String, u16)>,
    roots: HashMap<String, String>,
}

fn digest(parts: &[&str]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    h.finalize().into()
}

/// The top of a trajectory's sub-agent tree, the trace it is exported in: parent links followed (at most 16
/// levels, so a corrupt cycle cannot loop).
pub fn root_trajectory(
    trajectory: &str,
    mut parent_of: impl FnMut(&str) -> Result<Option<String>, StoreError>,
) -> Result<String, StoreError> {
    let mut cur = trajectory.to_owned();
    for _ in 0..16 {
        match parent_of(&cur)? {
            Some(p) if p != cur => cur = p,
            _ => break,
        }
    }
    Ok(cur)
}

pub fn trace_id_of(root_trajectory: &str) -> Vec<u8> {
    digest(&["trace", root_trajectory])[..16].to_vec()
}

pub fn agent_span_id(trajectory: &str) -> Vec<u8> {
    digest(&["agent", trajectory])[..8].to_vec()
}

pub fn tool_span_id(trajectory: &str, call_id: &str) -> Vec<u8> {
    digest(&["tool", trajectory, call_id])[..8].to_vec()
}

pub fn chat_span_id(trace_id: &str) -> Vec<u8> {
    digest(&["chat", trace_id])[..8].to_vec()
}

fn kv(key: &str, v: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(v) }),
        ..KeyValue::default()
    }
}
fn s(key: &str, v: impl Into<String>) -> KeyValue {
    kv(key, any_value::Value::StringValue(v.into()))
}
fn i(key: &str, v: u64) -> KeyValue {
    kv(key, any_value::Value::IntValue(v as i64))
}
fn f(key: &str, v: f64) -> KeyValue {
    kv(key, any_value::Value::DoubleValue(v))
}
fn b(key: &str, v: bool) -> KeyValue {
    kv(key, any_value::Value::BoolValue(v))
}
fn strings(key: &str, v: &[String]) -> KeyValue {
    kv(
        key,
        any_value::Value::ArrayValue(ArrayValue {
            values: v
                .iter()
                .map(|x| AnyValue {
                    value: Some(any_value::Value::StringValue(x.clone())),
                })
                .collect(),
        }),
    )
}

fn nanos(us: i64) -> u64 {
    (us.max(0) as u64) * 1000
}

fn rfc_nanos(t: &str) -> u64 {
    chrono::DateTime::parse_from_rfc3339(t)
        .map(|d| nanos(d.timestamp_micros()))
        .unwrap_or(0)
}

/// `00-<32 hex trace>-<16 hex span>-<flags>` → (trace id, span id).
fn parse_traceparent(tp: &str) -> Option<(Vec<u8>, Vec<u8>)> {
    let parts: Vec<&str> = tp.trim().split('-').collect();
    if parts.len() < 4 || parts[1].len() != 32 || parts[2].len() != 16 {
        return None;
    }
    let hex = |s: &str| -> Option<Vec<u8>> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
            .collect()
    };
    let (t, sp) = (hex(parts[1])?, hex(parts[2])?);
    if t.iter().all(|x| *x == 0) || sp.iter().all(|x| *x == 0) {
        return None;
    }
    Some((t, sp))
}

/// `gen_ai.usage.cost` (the total) and `llmtap.cost.<part>_usd`, as doubles (attributes have no decimal type);
/// on a chat span (`inference`) also the proposed `gen_ai.usage.cost.amount` / `.currency` / `.source` (llmtap
/// prices calls itself: `local`). The proposal puts them on inference spans only, so that a back end summing
/// them over a trace does not count an agent's calls twice.
fn cost_attributes(attrs: &mut Vec<KeyValue>, cost: &crate::model::cost::CostBreakdown, inference: bool) {
    attrs.push(f(sc::GEN_AI_USAGE_COST, cost.total_f64()));
    if inference {
        attrs.push(f(sc::GEN_AI_USAGE_COST_AMOUNT, cost.total_f64()));
        attrs.push(s(sc::GEN_AI_USAGE_COST_CURRENCY, "USD"));
        attrs.push(s(sc::GEN_AI_USAGE_COST_SOURCE, "local"));
    }
    for (part, usd) in cost.parts() {
        let usd = rust_decimal::prelude::ToPrimitive::to_f64(&usd).unwrap_or(f64::NAN);
        attrs.push(f(&format!("{}{part}_usd", sc::LLMTAP_COST_PREFIX), usd));
    }
}

fn usage_attributes(attrs: &mut Vec<KeyValue>, u: &crate::model::usage::Usage) {
    attrs.push(i(sc::GEN_AI_USAGE_INPUT_TOKENS, u.input));
    attrs.push(i(sc::GEN_AI_USAGE_OUTPUT_TOKENS, u.output));
    if let Some(v) = u.cache_read {
        attrs.push(i(sc::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, v));
    }
    if let Some(v) = u.cache_write {
        attrs.push(i(sc::GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS, v));
        attrs.push(i(sc::GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, v));
    }
    if let Some(v) = u.reasoning {
        attrs.push(i(sc::GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, v));
    }
}

/// The response's facts; the span's error status when the provider answered with an error.
fn facts_attributes(attrs: &mut Vec<KeyValue>, c: &CallFacts) -> Option<Status> {
    if let Some(m) = &c.model_response {
        attrs.push(s(sc::GEN_AI_RESPONSE_MODEL, m.clone()));
    }
    if let Some(id) = &c.response_id {
        attrs.push(s(sc::GEN_AI_RESPONSE_ID, id.clone()));
    }
    if let Some(fr) = c.finish_reason {
        attrs.push(strings(sc::GEN_AI_RESPONSE_FINISH_REASONS, &[fr.as_str().to_owned()]));
    }
    if let Some(m) = c.max_output_tokens {
        attrs.push(i(sc::GEN_AI_REQUEST_MAX_TOKENS, m));
    }
    c.error.as_ref().map(|e| {
        attrs.push(s(sc::ERROR_TYPE, e.kind.clone()));
        Status {
            code: StatusCode::Error as i32,
            message: e.message.chars().take(512).collect(),
        }
    })
}

/// Prompt, output and tool definitions (opt-in: `capture_content`).
fn content_attributes(attrs: &mut Vec<KeyValue>, c: &NormalizedCall) {
    if let Some(sys) = &c.system {
        attrs.push(s(
            sc::GEN_AI_SYSTEM_INSTRUCTIONS,
            json!([{"type": "text", "content": sys}]).to_string(),
        ));
    }
    attrs.push(s(sc::GEN_AI_INPUT_MESSAGES, otel_messages(&c.messages).to_string()));
    let out = crate::derive::identity::output_as_message(&c.output);
    let out = json!([{"role": "assistant", "parts": otel_parts(&out.parts),
        "finish_reason": c.finish_reason.map(|f| f.as_str())}]);
    attrs.push(s(sc::GEN_AI_OUTPUT_MESSAGES, out.to_string()));
    if !c.tools.is_empty() {
        attrs.push(s(
            sc::GEN_AI_TOOL_DEFINITIONS,
            serde_json::to_string(&c.tools).unwrap_or_default(),
        ));
    }
}

/// What derivation knows about the call's step.
fn step_attributes(attrs: &mut Vec<KeyValue>, st: &StepSpanFacts) {
    attrs.push(i(sc::LLMTAP_STEP_INDEX, st.step_index as u64));
    if let Some(ct) = st.call_type {
        attrs.push(s(sc::LLMTAP_CALL_TYPE, ct.as_str()));
    }
    if let Some(p) = st.purpose {
        attrs.push(s(sc::LLMTAP_PURPOSE, p.as_str()));
    }
    attrs.push(i(sc::LLMTAP_PREFIX_REUSE_TOKENS, st.token_usage.prefix_reuse_tokens));
    attrs.push(b(
        sc::LLMTAP_PREFIX_REUSE_ESTIMATED,
        st.token_usage.prefix_reuse_estimated,
    ));
    if let Some(r) = &st.agent_role {
        attrs.push(s(sc::LLMTAP_AGENT_ROLE, r.clone()));
    }
}

fn otel_messages(messages: &[Message]) -> Value {
    Value::Array(
        messages
            .iter()
            .map(|m| {
                let role = match m.role {
                    Role::User => "user",
                    Role::Assistant => "assistant",
                    Role::Tool => "tool",
                    Role::System => "system",
                };
                json!({"role": role, "parts": otel_parts(&m.parts)})
            })
            .collect(),
    )
}

fn otel_parts(parts: &[Part]) -> Vec<Value> {
    parts
        .iter()
        .map(|p| match p {
            Part::Text { text } => json!({"type": "text", "content": text}),
            Part::Reasoning { text } => json!({"type": "reasoning", "content": text}),
            Part::Media { reference, media_type } => json!({"type": "uri", "uri": reference, "mime_type": media_type}),
            Part::ToolCall(c) => json!({"type": "tool_call", "id": c.id, "name": c.name, "arguments": c.arguments}),
            Part::ToolResult { call_id, content, .. } => {
                json!({"type": "tool_call_response", "id": call_id, "response": content})
            }
        })
        .collect()
}

impl<'a> SpanBuilder<'a> {
    pub fn new(reader: &'a StoreReader, capture_content: bool, servers: &'a HashMap<String, (String, u16)>) -> Self {
        SpanBuilder {
            reader,
            capture_content,
            servers,
            roots: HashMap::new(),
        }
    }

    /// The outermost trajectory of a sub-agent chain (its trace holds the whole tree).
    fn root_of(&mut self, trajectory: &str) -> Result<String, StoreError> {
        if let Some(r) = self.roots.get(trajectory) {
            return Ok(r.clone());
        }
        let reader = self.reader;
        let cur = root_trajectory(trajectory, |t| reader.parent_trajectory(t))?;
        self.roots.insert(trajectory.to_owned(), cur.clone());
        Ok(cur)
    }

    /// Spans for one export-log entry (empty when its records are gone, e.g. evicted).
    pub fn spans_for(&mut self, kind: ExportKind, reference: &str) -> Result<Vec<Span>, StoreError> {
        match kind {
            ExportKind::Chat => {
                // The stored facts make the span; the bodies are read only for content (opt-in) or for a row
                // written before facts were kept.
                let Some(mut trace) = self.reader.trace_without_bodies(reference)? else {
                    return Ok(Vec::new());
                };
                if self.capture_content || trace.facts.is_none() {
                    match self.reader.trace(reference)? {
                        Some(t) => trace = t,
                        None => return Ok(Vec::new()),
                    }
                }
                let step = self.reader.step_span_facts_for_trace(reference)?;
                Ok(vec![self.chat_span(&trace, step.as_ref())?])
            }
            ExportKind::Tools => match self.reader.step(reference)? {
                Some(step) => self.tool_spans(&step),
                None => Ok(Vec::new()),
            },
            ExportKind::Agent => match self.reader.trajectory_light(reference)? {
                Some(t) => Ok(vec![self.agent_span(&t)?]),
                None => Ok(Vec::new()),
            },
            // Ship-log entries never reach a span sink (it reads the export log).
            ExportKind::Trace | ExportKind::Step | ExportKind::Trajectory => Ok(Vec::new()),
        }
    }

    fn chat_span(&mut self, trace: &ProviderTrace, step: Option<&StepSpanFacts>) -> Result<Span, StoreError> {
        let content: Option<NormalizedCall> = if self.capture_content || trace.facts.is_none() {
            adapter_for(trace.api).and_then(|a| {
                let path = trace.path.split('?').next().unwrap_or(&trace.path);
                let ctx = CallContext {
                    path,
                    status: trace.status,
                };
                a.normalize(&ctx, &trace.request.view(), &trace.response.view()).ok()
            })
        } else {
            None
        };
        let facts = trace.facts.clone().or_else(|| content.as_ref().map(CallFacts::of));
        let traj = trace.trajectory_id.clone().unwrap_or_else(|| trace.id.clone());
        let (trace_id, parent) = match trace.meta.traceparent.as_deref().and_then(parse_traceparent) {
            Some((t, p)) => (t, p),
            None => (trace_id_of(&self.root_of(&traj)?), agent_span_id(&traj)),
        };
        let model = facts
            .as_ref()
            .and_then(|c| c.model_requested.clone())
            .or_else(|| trace.model.clone())
            .unwrap_or_default();
        let mut attrs = vec![
            s(sc::GEN_AI_OPERATION_NAME, sc::OP_CHAT),
            s(
                sc::GEN_AI_PROVIDER_NAME,
                crate::provider::otel_provider_name(trace.api, &trace.upstream, &trace.path, trace.model.as_deref()),
            ),
            s(sc::GEN_AI_CONVERSATION_ID, traj.clone()),
            s(sc::LLMTAP_TRAJECTORY_ID, traj.clone()),
            s(sc::LLMTAP_PROVIDER_TRACE_ID, trace.id.clone()),
            s(sc::LLMTAP_OUTCOME, trace.outcome.as_str()),
            b(sc::GEN_AI_REQUEST_STREAM, trace.streamed),
        ];
        if !model.is_empty() {
            attrs.push(s(sc::GEN_AI_REQUEST_MODEL, model.clone()));
        }
        if let Some((host, port)) = self.servers.get(&trace.upstream) {
            attrs.push(s(sc::SERVER_ADDRESS, host.clone()));
            attrs.push(i(sc::SERVER_PORT, *port as u64));
        }
        if let Some(session) = &trace.meta.session {
            attrs.push(s(sc::LLMTAP_SESSION_ID, session.clone()));
        }
        if let Some(session) = trace.session() {
            attrs.push(s(sc::SESSION_ID, session.clone()));
        }
        if let (true, Some(fb)) = (trace.streamed, trace.timings.first_byte) {
            attrs.push(f(
                sc::GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK,
                (fb - trace.timings.start) as f64 / 1e6,
            ));
        }
        let mut status = Status::default();
        if let Some(u) = &trace.usage {
            usage_attributes(&mut attrs, u);
        }
        if let Some(cost) = &trace.cost {
            cost_attributes(&mut attrs, cost, true);
        }
        if let Some(error) = facts.as_ref().and_then(|c| facts_attributes(&mut attrs, c)) {
            status = error;
        }
        if let (true, Some(c)) = (self.capture_content, &content) {
            content_attributes(&mut attrs, c);
        }
        if status.code != StatusCode::Error as i32
            && (trace.outcome == crate::model::exchange::Outcome::UpstreamError
                || trace.status.is_some_and(|s| s >= 400))
        {
            let kind = trace
                .status
                .map(|s| format!("http_{s}"))
                .unwrap_or_else(|| "upstream_error".into());
            status = Status {
                code: StatusCode::Error as i32,
                message: trace.error.clone().unwrap_or_default(),
            };
            attrs.push(s(sc::ERROR_TYPE, kind));
        }
        if let Some(st) = step {
            step_attributes(&mut attrs, st);
        }
        Ok(Span {
            trace_id,
            span_id: chat_span_id(&trace.id),
            parent_span_id: parent,
            name: if model.is_empty() {
                sc::OP_CHAT.to_owned()
            } else {
                format!("{} {model}", sc::OP_CHAT)
            },
            kind: SpanKind::Client as i32,
            start_time_unix_nano: nanos(trace.timings.start),
            end_time_unix_nano: nanos(trace.timings.end),
            attributes: attrs,
            status: Some(status),
            ..Span::default()
        })
    }

    fn tool_spans(&mut self, step: &Step) -> Result<Vec<Span>, StoreError> {
        let trace_id = trace_id_of(&self.root_of(&step.trajectory_id)?);
        let start = step
            .timings
            .as_ref()
            .map(|t| rfc_nanos(&t.ended_at))
            .unwrap_or_else(|| rfc_nanos(&step.timestamp));
        let mut out = Vec::new();
        for obs in &step.observations {
            let Some(tc) = step.tool_calls.iter().find(|c| c.tool_call_id == obs.source_call_id) else {
                continue;
            };
            let end = start + tc.duration_ms.unwrap_or(0) * 1_000_000;
            let mut attrs = vec![
                s(sc::GEN_AI_OPERATION_NAME, sc::OP_EXECUTE_TOOL),
                s(sc::GEN_AI_TOOL_NAME, tc.tool_name.clone()),
                s(sc::GEN_AI_TOOL_CALL_ID, tc.tool_call_id.clone()),
                s(sc::GEN_AI_TOOL_TYPE, "function"),
                s(sc::GEN_AI_CONVERSATION_ID, step.trajectory_id.clone()),
                s(sc::LLMTAP_TRAJECTORY_ID, step.trajectory_id.clone()),
                i(sc::LLMTAP_STEP_INDEX, step.step_index as u64),
                b(sc::LLMTAP_TOOL_DURATION_ESTIMATED, true),
            ];
            if self.capture_content {
                attrs.push(s(sc::GEN_AI_TOOL_CALL_ARGUMENTS, tc.input.to_string()));
                if let Some(c) = &obs.content {
                    attrs.push(s(sc::GEN_AI_TOOL_CALL_RESULT, c.clone()));
                }
            }
            let mut status = Status::default();
            if let Some(e) = &obs.error {
                attrs.push(s(sc::ERROR_TYPE, e.clone()));
                status = Status {
                    code: StatusCode::Error as i32,
                    message: e.clone(),
                };
            }
            out.push(Span {
                trace_id: trace_id.clone(),
                span_id: tool_span_id(&step.trajectory_id, &tc.tool_call_id),
                parent_span_id: agent_span_id(&step.trajectory_id),
                name: format!("{} {}", sc::OP_EXECUTE_TOOL, tc.tool_name),
                kind: SpanKind::Internal as i32,
                start_time_unix_nano: start,
                end_time_unix_nano: end.max(start),
                attributes: attrs,
                status: Some(status),
                ..Span::default()
            });
        }
        Ok(out)
    }

    fn agent_span(&mut self, t: &TrajectorySummary) -> Result<Span, StoreError> {
        let trace_id = trace_id_of(&self.root_of(&t.trajectory_id)?);
        let name = t
            .agent
            .clone()
            .or_else(|| t.session_id.clone())
            .unwrap_or_else(|| "agent".into());
        let parent = match (&t.parent_trajectory_id, &t.parent_tool_call_id) {
            (Some(p), Some(c)) => tool_span_id(p, c),
            _ => Vec::new(),
        };
        let mut attrs = vec![
            s(sc::GEN_AI_OPERATION_NAME, sc::OP_INVOKE_AGENT),
            s(sc::GEN_AI_AGENT_NAME, name.clone()),
            s(sc::GEN_AI_CONVERSATION_ID, t.trajectory_id.clone()),
            s(sc::LLMTAP_TRAJECTORY_ID, t.trajectory_id.clone()),
            s(
                sc::SESSION_ID,
                t.session_id.clone().unwrap_or_else(|| t.trajectory_id.clone()),
            ),
            i(sc::GEN_AI_USAGE_INPUT_TOKENS, t.input_tokens),
            i(sc::GEN_AI_USAGE_OUTPUT_TOKENS, t.output_tokens),
            i(sc::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, t.cache_read_tokens),
            strings(sc::LLMTAP_CALL_TYPE, &t.call_types),
        ];
        // A sum with unpriced calls is only a lower bound: the cost attributes carry a known cost or nothing.
        match (&t.cost_usd, t.unpriced_calls) {
            (Some(cost), 0) => cost_attributes(&mut attrs, cost, false),
            (_, n) => attrs.push(i(sc::LLMTAP_COST_UNPRICED_CALLS, u64::from(n))),
        }
        if let Some(p) = &t.parent_trajectory_id {
            attrs.push(s(sc::LLMTAP_PARENT_TRAJECTORY_ID, p.clone()));
        }
        if let Some(c) = &t.continues {
            attrs.push(s(sc::LLMTAP_CONTINUES, c.clone()));
        }
        if let Some(m) = t.models.first() {
            attrs.push(s(sc::GEN_AI_REQUEST_MODEL, m.clone()));
        }
        Ok(Span {
            trace_id,
            span_id: agent_span_id(&t.trajectory_id),
            parent_span_id: parent,
            name: format!("{} {name}", sc::OP_INVOKE_AGENT),
            kind: SpanKind::Internal as i32,
            start_time_unix_nano: rfc_nanos(&t.started_at),
            end_time_unix_nano: rfc_nanos(&t.ended_at),
            attributes: attrs,
            status: Some(Status::default()),
            ..Span::default()
        })
    }
}

pub fn resource_spans(resource: &[(String, String)], spans: Vec<Span>) -> ResourceSpans {
    ResourceSpans {
        resource: Some(Resource {
            attributes: resource.iter().map(|(k, v)| s(k, v.clone())).collect(),
            ..Resource::default()
        }),
        scope_spans: vec![ScopeSpans {
            scope: Some(InstrumentationScope {
                name: "llmtap".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                ..InstrumentationScope::default()
            }),
            spans,
            ..ScopeSpans::default()
        }],
        ..ResourceSpans::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proposed_cost_names_go_on_inference_spans_only() {
        let cost = crate::model::cost::CostBreakdown {
            output: rust_decimal::Decimal::new(5, 3),
            total: rust_decimal::Decimal::new(5, 3),
            ..Default::default()
        };
        let keys = |inference| {
            let mut attrs = Vec::new();
            cost_attributes(&mut attrs, &cost, inference);
            attrs.into_iter().map(|kv| kv.key).collect::<Vec<_>>()
        };
        let chat = keys(true);
        for k in [
            sc::GEN_AI_USAGE_COST,
            sc::GEN_AI_USAGE_COST_AMOUNT,
            sc::GEN_AI_USAGE_COST_CURRENCY,
            sc::GEN_AI_USAGE_COST_SOURCE,
        ] {
            assert!(chat.iter().any(|c| c == k), "{k}");
        }
        let agent = keys(false);
        assert!(agent.iter().any(|c| c == sc::GEN_AI_USAGE_COST));
        assert!(!agent.iter().any(|c| c.starts_with("gen_ai.usage.cost.")), "{agent:?}");
    }
}
