//! The single writer: a dedicated OS thread that commits what the pipeline sends in batched transactions.
//!
//! The pipeline sends records in batches, one per pass over the capture queue (see [`crate::pipeline`]), so a
//! burst of exchanges costs the writer one wake-up, not one per record. Producers block when the channel is
//! full; the data path never touches it (it only feeds the capture queue, which drops when full). Write errors
//! are counted and logged once per episode (see `Metrics::store_error`); the batch is lost but the thread keeps
//! going, so one bad record cannot stop capture.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::{Connection, params};

use super::chunks::{ChunkCache, store_request};
use super::codec::compress;
use super::{Record, StoreError};
use crate::config::StoreConfig;
use crate::model::cost::CostBreakdown;
use crate::model::json::JsonText;
use crate::model::record::ExportKind;
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use crate::telemetry::Metrics;

/// Batches the channel holds before the pipeline waits. Each is one pipeline pass: at most 64 exchanges, about
/// three records each.
const QUEUED_BATCHES: usize = 4;

#[derive(Clone)]
pub struct StoreTx {
    tx: SyncSender<Vec<Record>>,
    metrics: Arc<Metrics>,
}

impl StoreTx {
    /// Blocking send of one batch (back-pressure on the pipeline thread only). An empty batch is not sent.
    pub fn send(&self, records: Vec<Record>) {
        if records.is_empty() {
            return;
        }
        let n = records.len() as u64;
        if self.tx.send(records).is_err() {
            self.metrics.store_dropped.add(n);
        }
    }
}

pub struct StoreWriter;

impl StoreWriter {
    /// Start the writer thread. It ends when every `StoreTx` is dropped, after writing what was queued.
    pub fn spawn(
        conn: Connection,
        config: StoreConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(StoreTx, JoinHandle<()>)> {
        let (tx, rx) = sync_channel(QUEUED_BATCHES);
        let m = metrics.clone();
        let handle = std::thread::Builder::new()
            .name("llmtap-store".into())
            .spawn(move || run(conn, rx, config, m))?;
        Ok((StoreTx { tx, metrics }, handle))
    }
}

/// How often the writer applies retention (`store.retention_days`, `store.max_traces`), after once at start.
const RETENTION_INTERVAL: Duration = Duration::from_secs(60);

/// Retention runs on the writer thread (the only writer): at start, then between batches and on idle seconds
/// once [`RETENTION_INTERVAL`] has passed, so an llmtap that restarts over a store beyond its limits, or that
/// stops receiving traffic, still trims it.
fn retention_when_due(
    conn: &Connection,
    config: &StoreConfig,
    metrics: &Metrics,
    last: &mut Instant,
    chunks: &mut ChunkCache,
) {
    if last.elapsed() >= RETENTION_INTERVAL {
        retain_now(conn, config, metrics, last, chunks);
    }
}

fn retain_now(conn: &Connection, config: &StoreConfig, metrics: &Metrics, last: &mut Instant, chunks: &mut ChunkCache) {
    *last = Instant::now();
    match super::read::apply_retention(conn, config, metrics) {
        // Deleted chunks may be remembered by id.
        Ok(deleted) if deleted > 0 => chunks.forget(),
        Ok(_) => {}
        Err(e) => metrics.store_error(&e),
    }
}

/// How long the writer waits for more batches before committing. A commit writes every page it touches to the
/// WAL (tables and indexes): one exchange per commit cost ~10 page writes. While traffic flows the pipeline sends
/// a batch every 20 ms or so (its poll interval); waiting this long lets a commit carry a few of them. Only
/// capture latency pays (a step is stored up to this much later), never the data path. A batch that comes after
/// a quiet spell (none in the last `GROUP_COMMIT_WAIT`) is committed at once: a sparse caller, such as one agent,
/// has nothing to share a commit with, and its steps then reach the store within milliseconds.
const GROUP_COMMIT_WAIT: Duration = Duration::from_millis(50);

fn run(mut conn: Connection, rx: Receiver<Vec<Record>>, config: StoreConfig, metrics: Arc<Metrics>) {
    crate::background::run_in_background();
    if let Ok(v) = std::env::var("XP_CACHE") {
        let _ = conn.pragma_update(None, "cache_size", v);
    }
    if let Ok(v) = std::env::var("XP_AUTOCKPT") {
        let _ = conn.pragma_update(None, "wal_autocheckpoint", v);
    }
    // At start: a store found over its limits is trimmed before anything new arrives.
    let mut last_retention = Instant::now();
    retain_now(
        &conn,
        &config,
        &metrics,
        &mut last_retention,
        &mut ChunkCache::default(),
    );
    let mut chunks = ChunkCache::default();
    let mut batch = Vec::with_capacity(config.batch_size);
    let mut last_batch: Option<Instant> = None;
    loop {
        // A second without records: give back what other threads freed in this thread's pages.
        let first = match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(records) => records,
            Err(RecvTimeoutError::Timeout) => {
                crate::allocator::release_when_idle();
                retention_when_due(&conn, &config, &metrics, &mut last_retention, &mut chunks);
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        batch.extend(first);
        let now = Instant::now();
        let traffic_flows = last_batch.is_some_and(|t| now.duration_since(t) < GROUP_COMMIT_WAIT);
        last_batch = Some(now);
        let deadline = now + GROUP_COMMIT_WAIT;
        while traffic_flows && batch.len() < config.batch_size {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(records) => {
                    batch.extend(records);
                    last_batch = Some(Instant::now());
                }
                Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        // Another connection (an exporter moving its cursor) may hold the write lock for longer than the busy
        // timeout when the machine is saturated; waiting longer is better than losing captured records.
        let mut result = write_batch(&mut conn, &batch, &mut chunks);
        for _ in 0..5 {
            match &result {
                Err(e) if e.is_busy() => result = write_batch(&mut conn, &batch, &mut chunks),
                _ => break,
            }
        }
        match result {
            Ok(()) => {
                metrics.stored.add(n);
                metrics.store_ok();
            }
            Err(e) => metrics.store_error(&e),
        }
        batch.clear();
        retention_when_due(&conn, &config, &metrics, &mut last_retention, &mut chunks);
    }
    let _ = conn.pragma_update(None, "wal_checkpoint", "PASSIVE");
}

/// One transaction for the batch. `chunks` learns the batch's new chunk ids only once it commits.
pub(crate) fn write_batch(conn: &mut Connection, batch: &[Record], chunks: &mut ChunkCache) -> Result<(), StoreError> {
    let result = (|| {
        let tx = conn.transaction()?;
        for record in batch {
            match record {
                Record::Trace(t) => insert_trace(&tx, t, chunks)?,
                Record::Step(s) => upsert_step(&tx, s)?,
                Record::Trajectory(t) => upsert_trajectory(&tx, t)?,
            }
        }
        chunks.flush_refs(&tx)?;
        tx.commit()?;
        Ok(())
    })();
    match result {
        Ok(()) => chunks.committed(),
        Err(_) => chunks.rolled_back(),
    }
    result
}

/// A value as JSON text for a column. A failure is an error, never an empty string: a row with `""` where JSON
/// belongs would read back as corrupt later instead of failing now, where it is counted and logged.
fn json<T: serde::Serialize + ?Sized>(what: &'static str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|source| StoreError::Serialize { what, source })
}

fn insert_trace(tx: &rusqlite::Transaction<'_>, t: &ProviderTrace, chunks: &mut ChunkCache) -> Result<(), StoreError> {
    let usage = t.usage.as_ref().map(|u| json("usage", u)).transpose()?;
    let request_headers = json("request headers", &t.request_headers)?;
    let response_headers = json("response headers", &t.response_headers)?;
    let metadata = json("trace metadata", &t.meta)?;
    let facts = t.facts.as_ref().map(|f| json("call facts", f)).transpose()?;
    // Exact decimal text; NULL when the cost is unknown.
    let cost = |part: fn(&CostBreakdown) -> rust_decimal::Decimal| t.cost.as_ref().map(|c| part(c).to_string());
    tx.prepare_cached("INSERT OR REPLACE INTO traces (id, trajectory_id, session_id, agent, upstream, api, method, path, status, outcome,
            error, streamed, model, started_us, first_byte_us, ended_us, request_bytes, response_bytes, usage,
            request_headers, response_headers, metadata, facts, cost_usd, cost_input_usd, cost_cache_read_usd,
            cost_cache_write_usd, cost_output_usd, cost_reasoning_usd)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22,
            ?23, ?24, ?25, ?26, ?27, ?28, ?29)")?.execute(params![
            t.id,
            t.trajectory_id,
            t.session_id.as_ref().or(t.meta.session.as_ref()),
            t.meta.agent,
            t.upstream,
            t.api.as_str(),
            t.method,
            t.path,
            t.status,
            t.outcome.as_str(),
            t.error,
            t.streamed,
            t.model,
            t.timings.start,
            t.timings.first_byte,
            t.timings.end,
            t.request_bytes as i64,
            t.response_bytes as i64,
            usage,
            request_headers,
            response_headers,
            metadata,
            facts,
            cost(|c| c.total),
            cost(|c| c.input),
            cost(|c| c.cache_read),
            cost(|c| c.cache_write),
            cost(|c| c.output),
            cost(|c| c.reasoning),
        ],
    )?;
    let body = |v: &JsonText| (!v.is_null()).then(|| compress(v.as_str()));
    // Requests repeat the conversation: stored content-addressed (see `chunks.rs`). Responses are new text.
    let request = if t.request.is_null() {
        None
    } else {
        Some(store_request(tx, chunks, t.request.as_str())?)
    };
    tx.prepare_cached(
        "INSERT OR REPLACE INTO trace_bodies (trace_id, request, response, raw_response) VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![
        t.id,
        request,
        body(&t.response),
        t.raw_response.as_deref().map(compress)
    ])?;
    Ok(())
}

fn log_export(tx: &rusqlite::Transaction<'_>, kind: ExportKind, reference: &str) -> Result<(), StoreError> {
    tx.prepare_cached("INSERT INTO export_log (kind, ref) VALUES (?1, ?2)")?
        .execute(params![kind.as_str(), reference])?;
    Ok(())
}

fn upsert_step(tx: &rusqlite::Transaction<'_>, s: &Step) -> Result<(), StoreError> {
    let exists: bool = tx
        .prepare_cached("SELECT 1 FROM steps WHERE step_id = ?1")?
        .exists([&s.step_id])?;
    let started_us = s
        .timings
        .as_ref()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t.started_at).ok())
        .or_else(|| chrono::DateTime::parse_from_rfc3339(&s.timestamp).ok())
        .map(|t| t.timestamp_micros())
        .unwrap_or(0);
    // Compressed: a step holds the tool results it observed, the largest part of what a long session stores
    // besides the bodies (~2.5 KB of text per call in `llmtap-bench bytes`). Rows written before are text.
    let body = compress(&json("step", s)?);
    // Updates keep the original seq (and so the original export position) of the step.
    tx.prepare_cached(
        "INSERT INTO steps (step_id, trajectory_id, session_id, step_index, role, trace_id, started_us, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
         ON CONFLICT(step_id) DO UPDATE SET body = excluded.body, trace_id = excluded.trace_id",
    )?
    .execute(params![
        s.step_id,
        s.trajectory_id,
        s.session_id,
        s.step_index,
        serde_json::to_value(s.role)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned)),
        s.provider_trace_id,
        started_us,
        body
    ])?;
    // An agent step's first write is when its call's span can be built (trace row and step both present).
    if !exists && let (crate::model::step::StepRole::Agent, Some(trace_id)) = (s.role, &s.provider_trace_id) {
        log_export(tx, ExportKind::Chat, trace_id)?;
    }
    if exists && !s.observations.is_empty() {
        log_export(tx, ExportKind::Tools, &s.step_id)?;
    }
    Ok(())
}

fn upsert_trajectory(tx: &rusqlite::Transaction<'_>, t: &TrajectorySummary) -> Result<(), StoreError> {
    let us = |s: &str| {
        chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_micros())
            .unwrap_or(0)
    };
    let prompts = (!t.system_prompts.is_empty())
        .then(|| json("system prompts", &t.system_prompts))
        .transpose()?;
    let tools = (!t.tool_definitions.is_empty())
        .then(|| json("tool definitions", &t.tool_definitions))
        .transpose()?;
    let body = json("trajectory", &t.without_heavy_parts())?;
    tx.prepare_cached("INSERT INTO trajectories (trajectory_id, session_id, started_us, ended_us, body, system_prompts, tool_definitions)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT(trajectory_id) DO UPDATE SET session_id = excluded.session_id, ended_us = excluded.ended_us,
             body = excluded.body,
             system_prompts = COALESCE(excluded.system_prompts, trajectories.system_prompts),
             tool_definitions = COALESCE(excluded.tool_definitions, trajectories.tool_definitions)")?.execute(params![t.trajectory_id, t.session_id, us(&t.started_at), us(&t.ended_at), body, prompts, tools],
    )?;
    if t.closed {
        log_export(tx, ExportKind::Agent, &t.trajectory_id)?;
    }
    Ok(())
}
