//! How a provider trace is kept in the shared store: its head (everything but the bodies) as one JSON
//! document, and its bodies as one compressed JSON document beside it.

use serde::{Deserialize, Serialize};

use super::StoreError;
use crate::model::cost::CostBreakdown;
use crate::model::exchange::{Api, ExchangeMeta, Outcome, Timings};
use crate::model::json::JsonText;
use crate::model::trace::{CallFacts, ProviderTrace};
use crate::model::usage::Usage;
use crate::store::browse::CallHead;
use crate::store::codec::{compress, decompress};

#[derive(Serialize, Deserialize)]
pub(super) struct TraceHead {
    id: String,
    upstream: String,
    api: Api,
    method: String,
    path: String,
    status: Option<u16>,
    outcome: Outcome,
    error: Option<String>,
    streamed: bool,
    start: i64,
    first_byte: Option<i64>,
    end: i64,
    request_headers: Vec<(String, String)>,
    response_headers: Vec<(String, String)>,
    meta: ExchangeMeta,
    request_bytes: u64,
    response_bytes: u64,
    model: Option<String>,
    usage: Option<Usage>,
    facts: Option<CallFacts>,
    cost: Option<CostBreakdown>,
    trajectory_id: Option<String>,
    session_id: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Bodies {
    /// JSON text as captured (`JsonText`), or null.
    request: Option<String>,
    response: Option<String>,
    raw_response: Option<String>,
}

fn text(j: &JsonText) -> Option<String> {
    (!j.is_null()).then(|| j.as_str().to_owned())
}

/// (head JSON, compressed bodies) of a trace.
pub(super) fn encode(t: &ProviderTrace) -> Result<(String, Vec<u8>), StoreError> {
    let head = TraceHead {
        id: t.id.clone(),
        upstream: t.upstream.clone(),
        api: t.api,
        method: t.method.clone(),
        path: t.path.clone(),
        status: t.status,
        outcome: t.outcome,
        error: t.error.clone(),
        streamed: t.streamed,
        start: t.timings.start,
        first_byte: t.timings.first_byte,
        end: t.timings.end,
        request_headers: t.request_headers.clone(),
        response_headers: t.response_headers.clone(),
        meta: t.meta.clone(),
        request_bytes: t.request_bytes,
        response_bytes: t.response_bytes,
        model: t.model.clone(),
        usage: t.usage,
        facts: t.facts.clone(),
        cost: t.cost,
        trajectory_id: t.trajectory_id.clone(),
        session_id: t.session_id.clone(),
    };
    let bodies = Bodies {
        request: text(&t.request),
        response: text(&t.response),
        raw_response: t.raw_response.clone(),
    };
    let serialize = |what, e: serde_json::Error| StoreError::Serialize { what, source: e };
    let head = serde_json::to_string(&head).map_err(|e| serialize("trace head", e))?;
    let bodies = serde_json::to_string(&bodies).map_err(|e| serialize("trace bodies", e))?;
    Ok((head, compress(&bodies)))
}

pub(super) fn head(id: &str, head: &str) -> Result<TraceHead, StoreError> {
    serde_json::from_str(head).map_err(|e| StoreError::Corrupt {
        id: id.to_owned(),
        what: e.to_string(),
    })
}

/// The trace from its stored head and bodies (None: read without bodies, left null).
pub(super) fn decode(id: &str, stored_head: &str, bodies: Option<Vec<u8>>) -> Result<ProviderTrace, StoreError> {
    let h = head(id, stored_head)?;
    let bodies: Bodies = match bodies {
        Some(b) => {
            let text = decompress(Some(b)).ok_or_else(|| StoreError::Corrupt {
                id: id.to_owned(),
                what: "unreadable bodies".into(),
            })?;
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                id: id.to_owned(),
                what: e.to_string(),
            })?
        }
        None => Bodies {
            request: None,
            response: None,
            raw_response: None,
        },
    };
    Ok(ProviderTrace {
        id: h.id,
        upstream: h.upstream,
        api: h.api,
        method: h.method,
        path: h.path,
        status: h.status,
        outcome: h.outcome,
        error: h.error,
        streamed: h.streamed,
        timings: Timings {
            start: h.start,
            first_byte: h.first_byte,
            end: h.end,
        },
        request_headers: h.request_headers,
        response_headers: h.response_headers,
        request: JsonText::from_stored(bodies.request),
        response: JsonText::from_stored(bodies.response),
        raw_response: bodies.raw_response,
        meta: h.meta,
        request_bytes: h.request_bytes,
        response_bytes: h.response_bytes,
        model: h.model,
        usage: h.usage,
        facts: h.facts,
        cost: h.cost,
        trajectory_id: h.trajectory_id,
        session_id: h.session_id,
    })
}

impl TraceHead {
    pub(super) fn call_head(self) -> CallHead {
        CallHead {
            id: self.id,
            trajectory_id: self.trajectory_id,
            upstream: self.upstream,
            api: self.api,
            model: self.model,
            status: self.status,
            outcome: self.outcome,
            error: self.error,
            timings: Timings {
                start: self.start,
                first_byte: self.first_byte,
                end: self.end,
            },
            usage: self.usage,
            cost: self.cost,
        }
    }
}
