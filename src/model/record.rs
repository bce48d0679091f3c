//! What derivation produces and the store keeps: one pipeline pass yields records, written in one batch.

use super::step::{Step, TrajectorySummary};
use super::trace::ProviderTrace;

#[derive(Debug, Clone)]
pub enum Record {
    Trace(Box<ProviderTrace>),
    /// A step, new or updated with late facts (observations, classification): upserted by id.
    Step(Box<Step>),
    Trajectory(Box<TrajectorySummary>),
}

impl Record {
    /// The bodies' bytes a record holds: a trace's request and response text; steps and summaries count as 0
    /// (their text is a fraction of the call's bodies). What the store writer's in-flight budget counts.
    pub fn body_bytes(&self) -> u64 {
        match self {
            Record::Trace(t) => t.body_bytes(),
            Record::Step(_) | Record::Trajectory(_) => 0,
        }
    }
}

/// What an export-log entry stands for; its `ref` names the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExportKind {
    /// An LLM call (ref = trace id), logged when its agent step is first written.
    Chat,
    /// A step received tool results (ref = step id).
    Tools,
    /// A trajectory closed (ref = trajectory id).
    Agent,
    /// Entries of the ship log (`ship_log`, written only when a shared store is configured): a record was
    /// written, ref = its id. Read by the sink that delivers records to the shared store.
    Trace,
    Step,
    Trajectory,
}

impl ExportKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ExportKind::Chat => "chat",
            ExportKind::Tools => "tools",
            ExportKind::Agent => "agent",
            ExportKind::Trace => "trace",
            ExportKind::Step => "step",
            ExportKind::Trajectory => "trajectory",
        }
    }

    pub fn parse(s: &str) -> Option<ExportKind> {
        match s {
            "chat" => Some(ExportKind::Chat),
            "tools" => Some(ExportKind::Tools),
            "agent" => Some(ExportKind::Agent),
            "trace" => Some(ExportKind::Trace),
            "step" => Some(ExportKind::Step),
            "trajectory" => Some(ExportKind::Trajectory),
            _ => None,
        }
    }
}

/// A position in the export log (the order sinks deliver in), distinct from a trace's own sequence number.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ExportSeq(pub i64);

/// One export-log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportEntry {
    pub seq: ExportSeq,
    pub kind: ExportKind,
    pub reference: String,
}
