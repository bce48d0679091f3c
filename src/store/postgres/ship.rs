//! Delivering a replica's records into the shared store: every row an upsert by its id, one transaction per
//! batch, one statement per table (the batch's rows as arrays, `unnest`ed: a row-per-statement upsert of a
//! 256-entry batch was hundreds of round trips). Rows go in key order within each table, so two replicas'
//! transactions take row locks in the same order; a deadlock that still happens is a transient error and the
//! batch is sent again.

use std::collections::BTreeMap;

use super::{StoreError, db_error, doc};
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use crate::store::search::DocColumns;

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
    /// What search reads of the step (`store::search`).
    search: DocColumns,
    text: String,
    /// A user's step: the id of the step answering it, whose columns it takes when the batch holds it.
    answer: Option<String>,
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
                search: DocColumns::of(s, None),
                answer: crate::store::search::answer_id(s),
                text: crate::store::search::text::indexed_text(s),
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
    // Sessions and trajectory parts first (the rows replicas share), then the rows only one replica writes.
    let sessions = sessions(batch);
    if !sessions.is_empty() {
        let keys: Vec<&str> = sessions.keys().copied().collect();
        let starts: Vec<i64> = sessions.values().map(|s| s.0).collect();
        let ends: Vec<i64> = sessions.values().map(|s| s.1).collect();
        // Each row's lists as JSON text: arrays of arrays cannot be ragged.
        let agents: Vec<String> = sessions.values().map(|s| json_list(&s.2)).collect();
        let models: Vec<String> = sessions.values().map(|s| json_list(&s.3)).collect();
        let stmt = tx
            .prepare_cached(
                "INSERT INTO sessions (session_key, started_us, ended_us, agents, models)
                 SELECT k, s, e, ARRAY(SELECT jsonb_array_elements_text(a::jsonb)),
                        ARRAY(SELECT jsonb_array_elements_text(m::jsonb))
                 FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[], $5::text[]) AS u(k, s, e, a, m)
                 ON CONFLICT (session_key) DO UPDATE SET
                     started_us = LEAST(sessions.started_us, EXCLUDED.started_us),
                     ended_us = GREATEST(sessions.ended_us, EXCLUDED.ended_us),
                     agents = ARRAY(SELECT DISTINCT x FROM unnest(sessions.agents || EXCLUDED.agents) x ORDER BY x),
                     models = ARRAY(SELECT DISTINCT x FROM unnest(sessions.models || EXCLUDED.models) x ORDER BY x)",
            )
            .await
            .map_err(err)?;
        tx.execute(&stmt, &[&keys, &starts, &ends, &agents, &models])
            .await
            .map_err(err)?;
    }
    if !batch.parts.is_empty() {
        let p = &batch.parts;
        let ids: Vec<&str> = p.keys().map(String::as_str).collect();
        let keys: Vec<&str> = p.values().map(|r| r.session_key.as_str()).collect();
        let starts: Vec<i64> = p.values().map(|r| r.started_us).collect();
        let ends: Vec<i64> = p.values().map(|r| r.ended_us).collect();
        let bodies: Vec<&str> = p.values().map(|r| r.body.as_str()).collect();
        let prompts: Vec<Option<&str>> = p.values().map(|r| r.system_prompts.as_deref()).collect();
        let tools: Vec<Option<&str>> = p.values().map(|r| r.tool_definitions.as_deref()).collect();
        let stmt = tx
            .prepare_cached(
                "INSERT INTO trajectory_parts (trajectory_id, replica, session_key, started_us, ended_us, body,
                     system_prompts, tool_definitions)
                 SELECT t, $2, k, s, e, b, sp, td
                 FROM unnest($1::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[], $7::text[], $8::text[])
                     AS u(t, k, s, e, b, sp, td)
                 ON CONFLICT (trajectory_id, replica) DO UPDATE SET session_key = EXCLUDED.session_key,
                     started_us = LEAST(trajectory_parts.started_us, EXCLUDED.started_us),
                     ended_us = EXCLUDED.ended_us, body = EXCLUDED.body,
                     system_prompts = COALESCE(EXCLUDED.system_prompts, trajectory_parts.system_prompts),
                     tool_definitions = COALESCE(EXCLUDED.tool_definitions, trajectory_parts.tool_definitions)",
            )
            .await
            .map_err(err)?;
        tx.execute(
            &stmt,
            &[&ids, &replica, &keys, &starts, &ends, &bodies, &prompts, &tools],
        )
        .await
        .map_err(err)?;
    }
    if !batch.traces.is_empty() {
        let t = &batch.traces;
        let ids: Vec<&str> = t.keys().map(String::as_str).collect();
        let trajectories: Vec<Option<&str>> = t.values().map(|r| r.trajectory_id.as_deref()).collect();
        let keys: Vec<Option<&str>> = t.values().map(|r| r.session_key.as_deref()).collect();
        let starts: Vec<i64> = t.values().map(|r| r.started_us).collect();
        let heads: Vec<&str> = t.values().map(|r| r.head.as_str()).collect();
        let bodies: Vec<&[u8]> = t.values().map(|r| r.bodies.as_slice()).collect();
        let stmt = tx
            .prepare_cached(
                "INSERT INTO traces (id, replica, trajectory_id, session_key, started_us, head, bodies)
                 SELECT i, $2, t, k, s, h, b
                 FROM unnest($1::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::bytea[])
                     AS u(i, t, k, s, h, b)
                 ON CONFLICT (id) DO UPDATE SET replica = EXCLUDED.replica, trajectory_id = EXCLUDED.trajectory_id,
                     session_key = EXCLUDED.session_key, head = EXCLUDED.head, bodies = EXCLUDED.bodies",
            )
            .await
            .map_err(err)?;
        tx.execute(&stmt, &[&ids, &replica, &trajectories, &keys, &starts, &heads, &bodies])
            .await
            .map_err(err)?;
    }
    if !batch.steps.is_empty() {
        let st = &batch.steps;
        let ids: Vec<&str> = st.keys().map(String::as_str).collect();
        let trajectories: Vec<&str> = st.values().map(|r| r.trajectory_id.as_str()).collect();
        let indexes: Vec<i32> = st.values().map(|r| r.step_index).collect();
        let roles: Vec<&str> = st.values().map(|r| r.role).collect();
        let traces: Vec<Option<&str>> = st.values().map(|r| r.trace_id.as_deref()).collect();
        let starts: Vec<i64> = st.values().map(|r| r.started_us).collect();
        let bodies: Vec<&str> = st.values().map(|r| r.body.as_str()).collect();
        // Two replicas may both derive a step (a user turn both saw): the version written from the call itself
        // (with its trace id) wins over one derived from a later request's history.
        let stmt = tx
            .prepare_cached(
                "INSERT INTO steps (step_id, trajectory_id, step_index, role, trace_id, started_us, body)
                 SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::bigint[],
                     $7::text[])
                 ON CONFLICT (step_id) DO UPDATE SET
                     body = CASE WHEN EXCLUDED.trace_id IS NOT NULL OR steps.trace_id IS NULL
                            THEN EXCLUDED.body ELSE steps.body END,
                     trace_id = COALESCE(EXCLUDED.trace_id, steps.trace_id)",
            )
            .await
            .map_err(err)?;
        tx.execute(
            &stmt,
            &[&ids, &trajectories, &indexes, &roles, &traces, &starts, &bodies],
        )
        .await
        .map_err(err)?;
        upsert_search(&tx, st, err).await?;
    }
    tx.commit().await.map_err(err)
}

/// A user's step takes the filters' columns (model, error, cost) of the agent step answering it. An answer
/// shipped after its question (rewritten with tool results or a retry's answer, or delivered in a later batch)
/// updates the question's row here, as the local indexer does (`store::search::index`).
async fn answered_questions(
    tx: &deadpool_postgres::Transaction<'_>,
    steps: &BTreeMap<String, StepRow>,
    err: &impl Fn(tokio_postgres::Error) -> StoreError,
) -> Result<(), StoreError> {
    let answers: Vec<&StepRow> = steps
        .values()
        .filter(|r| r.role == "agent" && r.step_index > 0)
        .collect();
    if answers.is_empty() {
        return Ok(());
    }
    let questions: Vec<String> = answers
        .iter()
        .map(|r| format!("{}/{}", r.trajectory_id, r.step_index - 1))
        .collect();
    let models: Vec<Option<&str>> = answers.iter().map(|r| r.search.model.as_deref()).collect();
    let errors: Vec<bool> = answers.iter().map(|r| r.search.error).collect();
    let costs: Vec<Option<f64>> = answers.iter().map(|r| r.search.cost_usd).collect();
    tx.execute(
        "UPDATE search_docs d SET model = u.model, error = u.error, cost_usd = u.cost_usd
         FROM unnest($1::text[], $2::text[], $3::bool[], $4::float8[]) AS u(step_id, model, error, cost_usd)
         WHERE d.step_id = u.step_id
           AND EXISTS (SELECT 1 FROM steps s WHERE s.step_id = u.step_id AND s.role <> 'agent')",
        &[&questions, &models, &errors, &costs],
    )
    .await
    .map_err(err)?;
    Ok(())
}

/// The steps' search rows, by the steps' rule: the version with a trace id wins. A step without searchable text
/// has none (its version from the call loses the one it had).
async fn upsert_search(
    tx: &deadpool_postgres::Transaction<'_>,
    steps: &BTreeMap<String, StepRow>,
    err: impl Fn(tokio_postgres::Error) -> StoreError,
) -> Result<(), StoreError> {
    let empty: Vec<&str> = steps
        .iter()
        .filter(|(_, r)| r.text.is_empty() && r.trace_id.is_some())
        .map(|(id, _)| id.as_str())
        .collect();
    if !empty.is_empty() {
        tx.execute("DELETE FROM search_docs WHERE step_id = ANY($1)", &[&empty])
            .await
            .map_err(&err)?;
    }
    answered_questions(tx, steps, &err).await?;
    let rows: Vec<(&String, &StepRow)> = steps.iter().filter(|(_, r)| !r.text.is_empty()).collect();
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = rows.iter().map(|(id, _)| id.as_str()).collect();
    // A user's step takes the filters' columns of the call that answered it (`DocColumns::of`).
    fn call<'a>(steps: &'a BTreeMap<String, StepRow>, r: &'a StepRow) -> &'a DocColumns {
        r.answer
            .as_ref()
            .and_then(|a| steps.get(a))
            .filter(|a| a.role == "agent")
            .map_or(&r.search, |a| &a.search)
    }
    let call = |r| call(steps, r);
    let keys: Vec<&str> = rows.iter().map(|(_, r)| r.search.session_key.as_str()).collect();
    let models: Vec<Option<&str>> = rows.iter().map(|(_, r)| call(r).model.as_deref()).collect();
    let agents: Vec<Option<&str>> = rows
        .iter()
        .map(|(_, r)| r.search.agent.as_deref().or(call(r).agent.as_deref()))
        .collect();
    let errors: Vec<bool> = rows.iter().map(|(_, r)| call(r).error).collect();
    let costs: Vec<Option<f64>> = rows.iter().map(|(_, r)| call(r).cost_usd).collect();
    let starts: Vec<i64> = rows.iter().map(|(_, r)| r.search.started_us).collect();
    let traced: Vec<bool> = rows.iter().map(|(_, r)| r.trace_id.is_some()).collect();
    let texts: Vec<&str> = rows.iter().map(|(_, r)| r.text.as_str()).collect();
    let stmt = tx
        .prepare_cached(
            "INSERT INTO search_docs (step_id, session_key, model, agent, error, cost_usd, started_us, has_trace, text)
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[], $6::float8[],
                 $7::bigint[], $8::bool[], $9::text[])
             ON CONFLICT (step_id) DO UPDATE SET session_key = EXCLUDED.session_key, model = EXCLUDED.model,
                 agent = EXCLUDED.agent, error = EXCLUDED.error, cost_usd = EXCLUDED.cost_usd,
                 started_us = EXCLUDED.started_us, has_trace = EXCLUDED.has_trace, text = EXCLUDED.text
             WHERE EXCLUDED.has_trace OR NOT search_docs.has_trace",
        )
        .await
        .map_err(&err)?;
    tx.execute(
        &stmt,
        &[&ids, &keys, &models, &agents, &errors, &costs, &starts, &traced, &texts],
    )
    .await
    .map_err(&err)?;
    Ok(())
}

fn json_list(items: &[String]) -> String {
    serde_json::to_string(items).unwrap_or_else(|_| "[]".into())
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
    // A step's search row goes with it.
    client
        .execute(
            "DELETE FROM search_docs WHERE step_id IN (SELECT step_id FROM steps WHERE started_us < $1)",
            &[&cutoff_us],
        )
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
    // Annotations go with what they are about, as in the local store (`store::read::apply_retention`).
    client
        .batch_execute(
            "DELETE FROM annotations a WHERE a.target = 'step'
                 AND NOT EXISTS (SELECT 1 FROM steps s WHERE s.step_id = a.target_id);
             DELETE FROM annotations a WHERE a.trajectory_id IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM trajectory_parts p WHERE p.trajectory_id = a.trajectory_id);
             DELETE FROM annotations a WHERE a.target = 'session'
                 AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.session_key = a.session_key)
                 AND NOT EXISTS (SELECT 1 FROM traces t WHERE t.session_key = a.session_key);",
        )
        .await
        .map_err(err)?;
    Ok(traces)
}
