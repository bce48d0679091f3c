//! Full-text search over steps: prompts, outputs, reasoning, tool calls' arguments and tool results.
//!
//! A step is the unit a hit names (session → trajectory → step, as the viewer opens it). What is indexed and
//! how text compares is in [`text`], shared by both backends:
//! - SQLite (`sqlite`): `search_docs` (one row per step, keyed by the step's `seq`, with the columns the filters
//!   use and the folded text) and `search_fts`, an FTS5 trigram index over that text (schema v14). The index is
//!   written by its own thread ([`index::Indexer`]) following the store behind a cursor, never by the store
//!   writer: the writer's cost per exchange (the lossless capture rate) stays what it was, and a search index
//!   that falls behind under load catches up later instead of slowing capture.
//! - PostgreSQL (`postgres::search`): the same rows in `search_docs`, written with the steps by the shipping
//!   sink (already off the data path, behind its cursor), under a `pg_trgm` GIN index.

pub mod index;
mod sqlite;
pub mod text;

pub use text::{Field, Piece, Terms, TermsError};

use crate::model::step::{Step, StepRole};

/// What to search for. Filters combine with AND.
#[derive(Debug, Clone)]
pub struct SearchQuery {
    pub terms: Terms,
    /// Steps whose model (`upstream/model`, e.g. `openai/gpt-4o-2024-08-06`) contains this.
    pub model: Option<String>,
    /// Steps of this agent.
    pub agent: Option<String>,
    /// Only steps with an error (a failed call or a tool result flagged as one).
    pub errors_only: bool,
    /// The step's call cost in USD, inclusive bounds (a step without a known cost is left out by either).
    pub min_cost: Option<f64>,
    pub max_cost: Option<f64>,
    /// Unix micros, inclusive.
    pub since_us: Option<i64>,
    pub until_us: Option<i64>,
    pub limit: u32,
}

impl SearchQuery {
    pub const DEFAULT_LIMIT: u32 = 50;
    pub const MAX_LIMIT: u32 = 500;

    pub fn new(terms: Terms) -> SearchQuery {
        SearchQuery {
            terms,
            model: None,
            agent: None,
            errors_only: false,
            min_cost: None,
            max_cost: None,
            since_us: None,
            until_us: None,
            limit: Self::DEFAULT_LIMIT,
        }
    }
}

/// One step that matched, newest first.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SearchHit {
    pub session_id: String,
    pub trajectory_id: String,
    pub step_id: String,
    pub step_index: u32,
    pub role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub timestamp: String,
    /// The step's call cost in USD, as exact decimal text.
    pub cost_usd: Option<String>,
    pub error: bool,
    pub field: Field,
    pub snippet: Vec<Piece>,
}

/// Columns the index keeps per step, besides the text: what the filters read.
pub(crate) struct DocColumns {
    pub session_key: String,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub error: bool,
    pub cost_usd: Option<f64>,
    pub started_us: i64,
}

impl DocColumns {
    /// The columns of `step`. A user's step has no call of its own: `call`, the agent step that answered it
    /// (the next step of its trajectory), lends it its model, cost and error, so the filters find a prompt by
    /// the call it went to.
    pub fn of(step: &Step, call: Option<&Step>) -> DocColumns {
        use rust_decimal::prelude::ToPrimitive;
        let micros = |s: &str| {
            chrono::DateTime::parse_from_rfc3339(s)
                .ok()
                .map(|t| t.timestamp_micros())
        };
        let from = match call {
            Some(c) if step.role != StepRole::Agent && c.role == StepRole::Agent => c,
            _ => step,
        };
        DocColumns {
            session_key: step.session_id.clone().unwrap_or_else(|| step.trajectory_id.clone()),
            model: from.model.clone(),
            agent: step.agent.clone().or_else(|| from.agent.clone()),
            error: text::has_error(from),
            cost_usd: from.cost_usd.as_ref().and_then(|c| c.total.to_f64()),
            started_us: step
                .timings
                .as_ref()
                .and_then(|t| micros(&t.started_at))
                .or_else(|| micros(&step.timestamp))
                .unwrap_or(0),
        }
    }
}

/// The id of the step that answers `step` when it is a user's step: the next one of its trajectory.
pub fn answer_id(step: &Step) -> Option<String> {
    (step.role != StepRole::Agent).then(|| format!("{}/{}", step.trajectory_id, step.step_index + 1))
}

/// A matched step as a hit, with the filters' columns its index row holds (a user's step: its call's); None when
/// its text (read back now) holds none of the terms, e.g. a step rewritten since it was indexed.
pub(crate) fn hit(step: Step, doc: DocColumns, terms: &Terms) -> Option<SearchHit> {
    let (field, snippet) = text::snippet(&step, terms)?;
    let cost = step.cost_usd.map(|c| c.total.to_string());
    Some(SearchHit {
        session_id: doc.session_key,
        error: doc.error,
        call_id: step.provider_trace_id,
        step_index: step.step_index,
        role: step.role.as_str(),
        model: doc.model,
        agent: doc.agent,
        timestamp: step.timestamp,
        cost_usd: cost.or_else(|| doc.cost_usd.map(|c| c.to_string())),
        trajectory_id: step.trajectory_id,
        step_id: step.step_id,
        field,
        snippet,
    })
}
