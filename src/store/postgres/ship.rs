//! Delivering a replica's records into the shared store: every row an upsert by its id, one transaction per
//! batch, statements pipelined on one connection (tokio-postgres sends them without waiting for each answer).
//! Rows are written in key order within each table, so two replicas' transactions take row locks in the same
//! order; a deadlock that still happens is a transient error and the batch is sent again.

use std::collections::BTreeMap;

use futures_util::future::try_join_all;

use super::{StoreError, db_error, doc};
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;

/// A batch encoded for the shared store, built on a blocking thread (compression, JSON) so that the store's
/// runtime only sends.
#[derive(Default)]
pub struct ShipBatch {
    traces: BTreeMap<String, TraceRow>,
    steps: BTreeMap<String, StepRow>,
    parts: BTreeMap<String, PartRow>,
}

struct TraceRow {
    trajectory_id: Option<String>,
    session_key: Option<String>,
    started_us: i64,
    head: String,
    bodies: Vec<u8>,
}

struct StepRow {
    trajectory_id: String,
    step_index: i32,
    role: &'static str,
    trace_id: Option<String>,
    started_us: i64,
    body: String,
}

struct PartRow {
    session_key: String,
    started_us: i64,
    ended_us: i64,
    body: String,
    system_prompts: Option<String>,
    tool_definitions: Option<String>,
    agent: Option<String>,
    models: Vec<String>,
}

fn micros(rfc3339: &str) -> i64 {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .map(|t| t.timestamp_micros())
        .unwrap_or(0)
}

fn json<T: serde::Serialize + ?Sized>(what: &'static str, v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|source| StoreError::Serialize { what, source })
}

impl ShipBatch {
    pub fn is_empty(&self) -> bool {
        self.traces.is_empty() && self.steps.is_empty() && self.parts.is_empty()
    }

    /// Rows in the batch (what the sink counts as delivered items).
    pub fn len(&self) -> usize {
        self.traces.len() + self.steps.len() + self.parts.len()
    }

    pub fn add_trace(&mut self, t: &ProviderTrace) -> Result<(), StoreError> {
        let (head, bodies) = doc::encode(t)?;
        let session_key = t.session_id.clone().or_else(|| t.trajectory_id.clone());
        self.traces.insert(
            t.id.clone(),
            TraceRow {
                trajectory_id: t.trajectory_id.clone(),
                session_key,
                started_us: t.timings.start,
                head,
                bodies,
            },
        );
        Ok(())
    }

    pub fn add_step(&mut self, s: &Step) -> Result<(), StoreError> {
        let started_us = s
            .timings
            .as_ref()
            .map(|t| micros(&t.started_at))
            .filter(|us| *us != 0)
            .unwrap_or_else(|| micros(&s.timestamp));
        self.steps.insert(
            s.step_id.clone(),
            StepRow {
                trajectory_id: s.trajectory_id.clone(),
                step_index: i32::try_from(s.step_index).unwrap_or(i32::MAX),
                role: s.role.as_str(),
                trace_id: s.provider_trace_id.clone(),
                started_us,
                body: json("step", s)?,
            },
        );
        Ok(())
    }

    pub fn add_trajectory(&mut self, t: &TrajectorySummary) -> Result<(), StoreError> {
        let prompts = (!t.system_prompts.is_empty())
            .then(|| json("system prompts", &t.system_prompts))
            .transpose()?;
        let tools = (!t.tool_definitions.is_empty())
            .then(|| json("tool definitions", &t.tool_definitions))
            .transpose()?;
        self.parts.insert(
            t.trajectory_id.clone(),
            PartRow {
                session_key: t.session_key().to_owned(),
                started_us: micros(&t.started_at),
                ended_us: micros(&t.ended_at),
                body: json("trajectory", &t.without_heavy_parts())?,
                system_prompts: prompts,
                tool_definitions: tools,
                agent: t.agent.clone(),
                models: t.models.clone(),
            },
        );
        Ok(())
    }
}

/// What a batch adds to one session row: (start, end, agents, models).
type SessionRow = (i64, i64, Vec<String>, Vec<String>);

/// The session rows a batch's trajectory parts add to, per session key.
fn sessions(batch: &ShipBatch) -> BTreeMap<&str, SessionRow> {
    let mut out: BTreeMap<&str, SessionRow> = BTreeMap::new();
    for p in batch.parts.values() {
        let e = out
            .entry(p.session_key.as_str())
            .or_insert((p.started_us, p.ended_us, Vec::new(), Vec::new()));
        e.0 = e.0.min(p.started_us);
        e.1 = e.1.max(p.ended_us);
        if let Some(a) = &p.agent
            && !e.2.contains(a)
        {
            e.2.push(a.clone());
        }
        for m in &p.models {
            if !e.3.contains(m) {
                e.3.push(m.clone());
            }
        }
    }
    out
}

pub(super) async fn upsert(
    client: &mut deadpool_postgres::Object,
    batch: &ShipBatch,
    replica: &str,
    display: &str,
) -> Result<(), StoreError> {
    let err = |e| db_error(display, e);
    let tx = client.transaction().await.map_err(err)?;
    let trace = tx
        .prepare_cached(
            "INSERT INTO traces (id, replica, trajectory_id, session_key, started_us, head, bodies)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (id) DO UPDATE SET replica = EXCLUDED.replica, trajectory_id = EXCLUDED.trajectory_id,
                 session_key = EXCLUDED.session_key, head = EXCLUDED.head, bodies = EXCLUDED.bodies",
        )
        .await
        .map_err(err)?;
    // Two replicas may both derive a step (a user turn both saw): the version written from the call itself
    // (with its trace id) wins over one derived from a later request's history.
    let step = tx
        .prepare_cached(
            "INSERT INTO steps (step_id, trajectory_id, step_index, role, trace_id, started_us, body)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (step_id) DO UPDATE SET
                 body = CASE WHEN EXCLUDED.trace_id IS NOT NULL OR steps.trace_id IS NULL
                        THEN EXCLUDED.body ELSE steps.body END,
                 trace_id = COALESCE(EXCLUDED.trace_id, steps.trace_id)",
        )
        .await
        .map_err(err)?;
    let part = tx
        .prepare_cached(
            "INSERT INTO trajectory_parts (trajectory_id, replica, session_key, started_us, ended_us, body,
                 system_prompts, tool_definitions)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (trajectory_id, replica) DO UPDATE SET session_key = EXCLUDED.session_key,
                 started_us = LEAST(trajectory_parts.started_us, EXCLUDED.started_us),
                 ended_us = EXCLUDED.ended_us, body = EXCLUDED.body,
                 system_prompts = COALESCE(EXCLUDED.system_prompts, trajectory_parts.system_prompts),
                 tool_definitions = COALESCE(EXCLUDED.tool_definitions, trajectory_parts.tool_definitions)",
        )
        .await
        .map_err(err)?;
    let session = tx
        .prepare_cached(
            "INSERT INTO sessions (session_key, started_us, ended_us, agents, models) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (session_key) DO UPDATE SET
                 started_us = LEAST(sessions.started_us, EXCLUDED.started_us),
                 ended_us = GREATEST(sessions.ended_us, EXCLUDED.ended_us),
                 agents = ARRAY(SELECT DISTINCT a FROM unnest(sessions.agents || EXCLUDED.agents) a ORDER BY a),
                 models = ARRAY(SELECT DISTINCT m FROM unnest(sessions.models || EXCLUDED.models) m ORDER BY m)",
        )
        .await
        .map_err(err)?;

    // Sessions and trajectory parts first (the rows replicas share), then the rows only one replica writes.
    let session_rows = sessions(batch);
    try_join_all(session_rows.iter().map(|(key, (start, end, agents, models))| {
        tx.execute_raw(&session, params(&[key, start, end, agents, models]))
    }))
    .await
    .map_err(err)?;
    try_join_all(batch.parts.iter().map(|(id, p)| {
        tx.execute_raw(
            &part,
            params(&[
                id,
                &replica,
                &p.session_key,
                &p.started_us,
                &p.ended_us,
                &p.body,
                &p.system_prompts,
                &p.tool_definitions,
            ]),
        )
    }))
    .await
    .map_err(err)?;
    try_join_all(batch.traces.iter().map(|(id, t)| {
        tx.execute_raw(
            &trace,
            params(&[
                id,
                &replica,
                &t.trajectory_id,
                &t.session_key,
                &t.started_us,
                &t.head,
                &t.bodies,
            ]),
        )
    }))
    .await
    .map_err(err)?;
    try_join_all(batch.steps.iter().map(|(id, s)| {
        tx.execute_raw(
            &step,
            params(&[
                id,
                &s.trajectory_id,
                &s.step_index,
                &s.role,
                &s.trace_id,
                &s.started_us,
                &s.body,
            ]),
        )
    }))
    .await
    .map_err(err)?;
    tx.commit().await.map_err(err)
}

type Param<'a> = &'a (dyn tokio_postgres::types::ToSql + Sync);

/// A statement's parameters as an owned list, so that a pipelined statement's future does not borrow a
/// temporary array.
fn params<'a>(p: &[Param<'a>]) -> Vec<Param<'a>> {
    p.to_vec()
}

/// Delete rows older than `cutoff_us`; returns how many traces went.
pub(super) async fn retain(
    client: &deadpool_postgres::Object,
    cutoff_us: i64,
    display: &str,
) -> Result<u64, StoreError> {
    let err = |e| db_error(display, e);
    let traces = client
        .execute("DELETE FROM traces WHERE started_us < $1", &[&cutoff_us])
        .await
        .map_err(err)?;
    client
        .execute("DELETE FROM steps WHERE started_us < $1", &[&cutoff_us])
        .await
        .map_err(err)?;
    client
        .execute("DELETE FROM trajectory_parts WHERE ended_us < $1", &[&cutoff_us])
        .await
        .map_err(err)?;
    client
        .execute("DELETE FROM sessions WHERE ended_us < $1", &[&cutoff_us])
        .await
        .map_err(err)?;
    Ok(traces)
}
