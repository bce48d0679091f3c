//! Trajectory formats users already have, one module each: opentraces TraceRecord (seed 001), ATIF v1.7 (Harbor
//! RFC), Invariant traces (seed 003), TurnWise conversations (seed 000), Letta steps (seed 004) and the localharness
//! Step event stream (seed 002). One trajectory in memory at a time; what a format has no slot for goes in its
//! extension field (`extra`, `meta`, `metadata`), never dropped.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::model::annotation::Annotation;
use crate::model::step::{Step, TrajectorySummary};

/// A trajectory with its steps (step_index order), the trajectories it started, and the annotations people made
/// on it, on its steps and on its session (oldest first).
pub struct TrajectoryData {
    pub summary: TrajectorySummary,
    pub steps: Vec<Step>,
    pub children: Vec<TrajectoryData>,
    pub annotations: Vec<Annotation>,
}

impl TrajectoryData {
    /// The sub-agents this trajectory started, by (parent step index, tool call id) of the call that started
    /// each (ATIF references them from that call's observation; TurnWise places them after that call).
    pub(super) fn children_by_call(&self) -> std::collections::BTreeMap<(u32, &str), &TrajectoryData> {
        self.children
            .iter()
            .filter_map(|c| {
                let call = c.steps.iter().find_map(|x| x.parent_tool_call_id.as_deref())?;
                Some(((c.summary.parent_step?, call), c))
            })
            .collect()
    }
}

pub(super) fn duration_s(a: &str, b: &str) -> Option<f64> {
    let a = chrono::DateTime::parse_from_rfc3339(a).ok()?;
    let b = chrono::DateTime::parse_from_rfc3339(b).ok()?;
    Some((b - a).num_milliseconds() as f64 / 1000.0)
}

/// A UUID (RFC 9562 v8, custom) derived from the trajectory id, so re-exports keep the same trace_id.
pub(super) fn derived_uuid(namespace: &str, id: &str) -> String {
    let d = Sha256::digest(format!("{namespace}\u{1}{id}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    uuid::Builder::from_custom_bytes(b).into_uuid().to_string()
}

pub(super) fn strip_nulls(v: &mut Value) {
    if let Value::Object(m) = v {
        m.retain(|_, x| !x.is_null());
    }
}

/// Facts beyond the seed's Step fields, kept per step under the record's `metadata`.
pub(super) fn step_extras(s: &Step) -> Value {
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

mod atif;
mod invariant;
mod letta;
mod localharness;
mod opentraces;
mod turnwise;

pub use atif::atif;
pub use invariant::invariant;
pub use letta::{LettaContext, letta};
pub use localharness::{LocalharnessStream, localharness};
pub use opentraces::opentraces;
pub use turnwise::turnwise_conversation;
