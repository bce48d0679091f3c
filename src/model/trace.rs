//! `ProviderTrace`: one captured HTTP exchange, bodies decoded and streams reassembled.

use serde::Serialize;
use serde_json::{Value, json};

use super::call::{CallError, FinishReason, NormalizedCall};
use super::exchange::{Api, ExchangeMeta, Outcome, Timings, UnixMicros};
use crate::model::cost::CostBreakdown;
use crate::model::json::JsonText;
use crate::model::usage::Usage;

#[derive(Debug, Clone)]
pub struct ProviderTrace {
    pub id: String,
    pub upstream: String,
    pub api: Api,
    pub method: String,
    pub path: String,
    pub status: Option<u16>,
    pub outcome: Outcome,
    pub error: Option<String>,
    pub streamed: bool,
    pub timings: Timings,
    pub request_headers: Vec<(String, String)>,
    pub response_headers: Vec<(String, String)>,
    /// The request body as JSON text (a JSON string holding the text if it was not JSON; null if empty).
    pub request: JsonText,
    /// The response as a non-streamed call would have returned it, as JSON text (null when there was none).
    pub response: JsonText,
    /// The decoded stream text exactly as received, for streamed responses.
    pub raw_response: Option<String>,
    pub meta: ExchangeMeta,
    pub request_bytes: u64,
    pub response_bytes: u64,
    pub model: Option<String>,
    pub usage: Option<Usage>,
    /// What the provider adapter read from the call, kept so that exports need not read the bodies again
    /// (None: not a call an adapter reads, or a store written before facts were kept).
    pub facts: Option<CallFacts>,
    /// What the call cost, priced on the pipeline thread from `model`, `usage` and the start time; `None` when
    /// unknown (no price for the model, no usage reported), never a zero.
    pub cost: Option<CostBreakdown>,
    /// Set by derivation: the trajectory this call belongs to.
    pub trajectory_id: Option<String>,
    /// Set by derivation: the session of that trajectory (native or derived, see `derive::session`).
    pub session_id: Option<String>,
}

/// The per-call facts exports use, read from the bodies once, on the pipeline thread.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CallFacts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_requested: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_response: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<FinishReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CallError>,
}

impl CallFacts {
    pub fn of(call: &NormalizedCall) -> CallFacts {
        CallFacts {
            model_requested: call.model_requested.clone(),
            model_response: call.model_response.clone(),
            response_id: call.response_id.clone(),
            finish_reason: call.finish_reason,
            max_output_tokens: call.max_output_tokens,
            error: call.error.clone(),
        }
    }
}

/// What a live listener needs about a finished call, without its bodies or headers.
#[derive(Debug, Clone)]
pub struct TraceHead {
    pub id: String,
    pub trajectory_id: Option<String>,
    pub session: Option<String>,
    pub agent: Option<String>,
    pub upstream: String,
    pub api: Api,
    pub model: Option<String>,
    pub status: Option<u16>,
    pub outcome: Outcome,
    pub timings: Timings,
    pub streamed: bool,
    pub usage: Option<Usage>,
    pub cost: Option<CostBreakdown>,
    pub error: Option<String>,
}

impl ProviderTrace {
    /// Bytes of body text held: request, response, and the raw stream.
    pub fn body_bytes(&self) -> u64 {
        (self.request.byte_len() + self.response.byte_len() + self.raw_response.as_ref().map_or(0, String::len)) as u64
    }

    /// The call's session: its own session id, or else the session header the client sent. The store keeps this
    /// in the trace's `session_id` column.
    pub fn session(&self) -> Option<&String> {
        self.session_id.as_ref().or(self.meta.session.as_ref())
    }

    pub fn head(&self) -> TraceHead {
        TraceHead {
            id: self.id.clone(),
            trajectory_id: self.trajectory_id.clone(),
            session: self.session().cloned(),
            agent: self.meta.agent.clone(),
            upstream: self.upstream.clone(),
            api: self.api,
            model: self.model.clone(),
            status: self.status,
            outcome: self.outcome,
            timings: self.timings,
            streamed: self.streamed,
            usage: self.usage,
            cost: self.cost,
            error: self.error.clone(),
        }
    }
}

pub fn rfc3339(us: UnixMicros) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .unwrap_or_default()
}

fn headers_json(h: &[(String, String)]) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in h {
        match m.get_mut(k) {
            Some(Value::String(existing)) => {
                existing.push_str(", ");
                existing.push_str(v);
            }
            _ => {
                m.insert(k.clone(), Value::String(v.clone()));
            }
        }
    }
    Value::Object(m)
}

/// The `provider-traces` export record (one JSON object per line).
#[derive(Serialize)]
struct TraceExport<'a> {
    id: &'a str,
    upstream: &'a str,
    api: &'a str,
    method: &'a str,
    path: &'a str,
    status: Option<u16>,
    streamed: bool,
    outcome: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    timings: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<&'a Usage>,
    /// Always present: null when the cost is unknown (never 0).
    cost_usd: Option<&'a CostBreakdown>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trajectory_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a str>,
    request: &'a JsonText,
    response: &'a JsonText,
    headers: Value,
    metadata: &'a ExchangeMeta,
    bytes: Value,
}

impl ProviderTrace {
    pub fn to_export_json(&self) -> Value {
        let t = &self.timings;
        let timings = json!({
            "start": rfc3339(t.start),
            "first_byte": t.first_byte.map(rfc3339),
            "end": rfc3339(t.end),
            "duration_ms": (t.end - t.start) as f64 / 1000.0,
            "time_to_first_byte_ms": t.first_byte.map(|f| (f - t.start) as f64 / 1000.0),
        });
        let rec = TraceExport {
            id: &self.id,
            upstream: &self.upstream,
            api: self.api.as_str(),
            method: &self.method,
            path: &self.path,
            status: self.status,
            streamed: self.streamed,
            outcome: self.outcome.as_str(),
            error: self.error.as_deref(),
            timings,
            model: self.model.as_deref(),
            usage: self.usage.as_ref(),
            cost_usd: self.cost.as_ref(),
            trajectory_id: self.trajectory_id.as_deref(),
            session_id: self.session_id.as_deref(),
            request: &self.request,
            response: &self.response,
            headers: json!({"request": headers_json(&self.request_headers), "response": headers_json(&self.response_headers)}),
            metadata: &self.meta,
            bytes: json!({"request": self.request_bytes, "response": self.response_bytes}),
        };
        serde_json::to_value(rec).unwrap_or(Value::Null)
    }
}
