//! The single writer: a dedicated OS thread that commits what the pipeline sends in batched transactions.
//!
//! The pipeline sends records in batches, one per pass over the capture queue (see [`crate::pipeline`]), so a
//! burst of exchanges costs the writer one wake-up, not one per record. Producers block when the channel is
//! full; the data path never touches it (it only feeds the capture queue, which drops when full). Write errors
//! are counted and logged once per episode (see `Metrics::store_error`), and a failed batch is kept (see
//! [`Committer`]): a transient error (busy, full disk, I/O) is retried with back-off while the batches behind it
//! wait (the pipeline then waits on this channel, and the capture spill takes what arrives meanwhile); any other
//! error is narrowed down by splitting the batch until the record that fails on its own is found, and that
//! record is put aside in the quarantine table (`store::quarantine`) while the rest is stored.

use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::{Connection, OptionalExtension, params};
use rustc_hash::FxHashMap;

use super::checkpoint::{CHECKPOINT_PAGES, Checkpointer};
use super::chunks::{ChunkCache, store_request};
use super::coalesce::{Slot, plan};
use super::codec::compress;
use super::feed::{CommitFeed, LiveEvent, LiveTx};
use super::in_flight::{Held, InFlight};
use super::recent::RecentRecords;
use super::{Record, StoreError};
use crate::config::StoreConfig;
use crate::model::cost::CostBreakdown;
use crate::model::json::JsonText;
use crate::model::record::ExportKind;
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::{ProviderTrace, rfc3339};
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics};

/// Batches the channel holds before the pipeline waits. Each is one pipeline pass: at most 64 exchanges (about
/// three records each) or 4 MiB of captured bytes. While the writer commits a group ([`GROUP_COMMIT_WAIT`] of
/// traffic, tens of milliseconds of work) the pipeline goes on deriving the next one: the channel must hold that
/// much, or the two threads take turns instead of working side by side. 32 passes are 2,048 exchanges, 0.2 s
/// at 10k exchanges/s (docs/performance.md, "The store channel").
const QUEUED_BATCHES: usize = 32;
/// The most body bytes waiting for the writer, in its channel and in the group it is gathering, before the
/// pipeline waits (see [`InFlight`]): with multi-megabyte bodies the batch count alone would let this grow to
/// gigabytes.
const IN_FLIGHT_BYTES: u64 = 128 * 1024 * 1024;

/// A batch for the writer, with its share of the in-flight budget (given back once the batch is committed).
type Batch = (Vec<Record>, Held);

#[derive(Clone)]
pub struct StoreTx {
    tx: SyncSender<Batch>,
    /// One count per sender: the writer sees shutdown coming (every sender gone) while it retries a batch
    /// (see [`RETRY_AT_SHUTDOWN`]).
    _sender: Arc<()>,
    in_flight: Arc<InFlight>,
    metrics: Arc<Metrics>,
}

impl StoreTx {
    /// Bodies this handle sends count against the capture budget too while they wait for the writer (see
    /// [`InFlight`]): the pipeline's handle.
    pub fn sharing_capture_budget(mut self, budget: crate::capture::budget::Budget) -> StoreTx {
        self.in_flight = InFlight::sharing(IN_FLIGHT_BYTES, Some(budget));
        self
    }

    /// Blocking send of one batch (back-pressure on the pipeline thread only). An empty batch is not sent.
    pub fn send(&self, records: Vec<Record>) {
        if records.is_empty() {
            return;
        }
        let n = records.len() as u64;
        let held = self.in_flight.hold(&records);
        self.metrics.store_pending.add(n);
        if self.tx.send((records, held)).is_err() {
            self.metrics.store_pending.sub(n);
            self.metrics.store_dropped.add(n);
        }
    }
}

pub struct StoreWriter;

impl StoreWriter {
    /// Start the writer thread. It ends when every `StoreTx` is dropped, after writing what was queued. Each
    /// committed batch goes on to `recent`, for the exporters.
    pub fn spawn(
        conn: Connection,
        config: StoreConfig,
        metrics: Arc<Metrics>,
        recent: Arc<RecentRecords>,
    ) -> std::io::Result<(StoreTx, JoinHandle<()>)> {
        Self::spawn_with_feed(conn, config, metrics, recent, None)
    }

    /// [`spawn`](Self::spawn), publishing each commit on `feed` (see `store::feed`).
    pub fn spawn_with_feed(
        conn: Connection,
        config: StoreConfig,
        metrics: Arc<Metrics>,
        recent: Arc<RecentRecords>,
        feed: Option<CommitFeed>,
    ) -> std::io::Result<(StoreTx, JoinHandle<()>)> {
        let (tx, rx) = sync_channel(QUEUED_BATCHES);
        let m = metrics.clone();
        let sender = Arc::new(());
        let senders = Arc::downgrade(&sender);
        let handle = std::thread::Builder::new()
            .name("llmtap-store".into())
            .spawn(move || run(conn, rx, config, m, recent, feed, senders))?;
        let in_flight = InFlight::new(IN_FLIGHT_BYTES);
        Ok((
            StoreTx {
                tx,
                _sender: sender,
                in_flight,
                metrics,
            },
            handle,
        ))
    }
}

/// How often the writer applies retention (`store.retention_days`, `store.max_traces`), after once at start.
const RETENTION_INTERVAL: Duration = Duration::from_secs(60);

/// Retention runs on the writer thread (the only writer): at start, then between batches and on idle seconds
/// once [`RETENTION_INTERVAL`] has passed since the last run, so an llmtap that restarts over a store beyond its
/// limits, or that stops receiving traffic, still trims it.
fn retention_due(last: Instant) -> bool {
    last.elapsed() >= RETENTION_INTERVAL
}

fn retain_now(
    conn: &Connection,
    config: &StoreConfig,
    metrics: &Metrics,
    last: &mut Instant,
    chunks: &mut ChunkCache,
    recent: &RecentRecords,
) {
    *last = Instant::now();
    if config.url.is_some()
        && let Err(e) = trim_ship_log(conn)
    {
        metrics.store_error(&e);
    }
    match super::read::apply_retention(conn, config, metrics) {
        // Deleted chunks may be remembered by id, deleted records by the exporters' cache.
        Ok(deleted) if deleted > 0 => {
            chunks.forget();
            recent.forget();
        }
        Ok(_) => {}
        Err(e) => metrics.store_error(&e),
    }
}

/// Ship-log entries the shared-store sink has delivered (its cursor passed them) are not needed again.
fn trim_ship_log(conn: &Connection) -> Result<(), StoreError> {
    conn.execute(
        "DELETE FROM ship_log WHERE seq <= (SELECT seq FROM cursors WHERE sink = ?1)",
        [crate::store::postgres::SHIP_CURSOR],
    )?;
    Ok(())
}

/// How long the writer waits for more batches before committing. A commit writes every page it touches to the
/// WAL (tables and indexes): one exchange per commit cost ~10 page writes. While traffic flows the pipeline sends
/// a batch every 20 ms or so (its poll interval); waiting this long lets a commit carry a few of them. Only
/// capture latency pays (a step is stored up to this much later), never the data path. A batch that comes after
/// a quiet spell (none in the last `GROUP_COMMIT_WAIT`) is committed at once: a sparse caller, such as one agent,
/// has nothing to share a commit with, and its steps then reach the store within milliseconds.
const GROUP_COMMIT_WAIT: Duration = Duration::from_millis(50);

fn run(
    mut conn: Connection,
    rx: Receiver<Batch>,
    config: StoreConfig,
    metrics: Arc<Metrics>,
    recent: Arc<RecentRecords>,
    feed: Option<CommitFeed>,
    senders: Weak<()>,
) {
    crate::background::run_in_background();
    if let Err(e) = tune_writer(&conn).and_then(|()| super::quarantine::create(&conn)) {
        metrics.store_error(&e);
    }
    publish_export_head(&conn, &metrics);
    // Checkpoints on their own thread; if it cannot start, SQLite's automatic checkpoint (`tune_writer`) stays.
    let checkpointer = Checkpointer::start(&mut conn, CHECKPOINT_PAGES, metrics.clone()).unwrap_or_else(|e| {
        metrics.store_error(&e);
        None
    });
    // At start: a store found over its limits is trimmed before anything new arrives.
    let mut last_retention = Instant::now();
    retain_now(
        &conn,
        &config,
        &metrics,
        &mut last_retention,
        &mut ChunkCache::default(),
        &recent,
    );
    let mut chunks = ChunkCache::default();
    let mut batch = Vec::with_capacity(config.batch_size);
    // The group's shares of the in-flight budget, given back once it is committed.
    let mut held: Vec<Held> = Vec::new();
    let mut last_batch: Option<Instant> = None;
    let mut closing_since = None;
    let mut quarantined = EpisodeLog::default();
    loop {
        // A second without records: the exporters' cache is emptied (an exporter reads within a fraction of a
        // second of a commit; one that has not, a paused one, reads the store), and what other threads freed in
        // this thread's pages goes back to the system.
        let first = match rx.recv_timeout(Duration::from_secs(1)) {
            Ok((records, share)) => {
                held.push(share);
                records
            }
            Err(RecvTimeoutError::Timeout) => {
                recent.forget();
                crate::allocator::release_when_idle();
                if retention_due(last_retention) {
                    retain_now(&conn, &config, &metrics, &mut last_retention, &mut chunks, &recent);
                }
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
                Ok((records, share)) => {
                    batch.extend(records);
                    held.push(share);
                    last_batch = Some(Instant::now());
                }
                Err(_) => break,
            }
        }
        let mut committer = Committer {
            conn: &mut conn,
            chunks: &mut chunks,
            metrics: &metrics,
            senders: &senders,
            closing_since: &mut closing_since,
            quarantined: &mut quarantined,
            ship: config.url.is_some(),
        };
        let mut lost = Vec::new();
        committer.commit(&batch, 0, &mut lost);
        let stored = batch.len() - lost.len();
        if stored > 0 {
            metrics.stored.add(stored as u64);
            metrics.store_ok();
            publish_export_head(&conn, &metrics);
        }
        if let Some(feed) = &feed {
            if feed.live.receiver_count() > 0 {
                publish(&feed.live, &batch, &lost);
            }
            if stored > 0 {
                feed.commits.send_modify(|n| *n += 1);
            }
        }
        // Stored, quarantined or given up: no longer pending either way.
        metrics.store_pending.sub(batch.len() as u64);
        let mut i = 0;
        recent.remember(batch.drain(..).filter(|_| {
            i += 1;
            lost.binary_search(&(i - 1)).is_err()
        }));
        if let Some(c) = &checkpointer
            && let Err(e) = c.after_commit(&conn)
        {
            metrics.store_error(&e);
        }
        batch.clear();
        held.clear();
        if retention_due(last_retention) {
            retain_now(&conn, &config, &metrics, &mut last_retention, &mut chunks, &recent);
        }
    }
    if let Some(c) = checkpointer {
        c.stop(&mut conn);
    }
    let _ = conn.pragma_update(None, "wal_checkpoint", "PASSIVE");
}

/// Tell the commit feed's listeners about every committed step and call of `batch` (`lost`: the indexes of
/// records that were not stored, in order).
fn publish(feed: &LiveTx, batch: &[Record], lost: &[usize]) {
    for (i, record) in batch.iter().enumerate() {
        if lost.binary_search(&i).is_ok() {
            continue;
        }
        let event = match record {
            Record::Step(s) => LiveEvent::Step(Arc::new((**s).clone())),
            Record::Trace(t) => LiveEvent::Trace(Arc::new(t.head())),
            Record::Trajectory(_) => continue,
        };
        // No listener left is not an error: events are for whoever is listening now.
        let _ = feed.send(event);
    }
}

/// First wait after a transient write error; each further failure doubles it, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// Once every sender is gone (llmtap is stopping), a transient error is retried this much longer; then the
/// records still unwritten are given up, counted in `llmtap_store_dropped_total`, so that a disk that stays
/// full cannot hold the process up forever.
const RETRY_AT_SHUTDOWN: Duration = Duration::from_secs(10);

/// Errors that say nothing about the records: the same batch can succeed later (another connection holds the
/// lock, the disk is full or failing, the file cannot be opened right now, memory is short).
fn is_transient(e: &StoreError) -> bool {
    use rusqlite::ErrorCode::*;
    let StoreError::Sql(e) = e else { return false };
    matches!(
        e.sqlite_error_code(),
        Some(DatabaseBusy | DatabaseLocked | DiskFull | SystemIoFailure | CannotOpen | OutOfMemory | ReadOnly)
    )
}

/// How one group is committed without losing it to one bad record or to a full disk.
struct Committer<'a> {
    conn: &'a mut Connection,
    chunks: &'a mut ChunkCache,
    metrics: &'a Metrics,
    senders: &'a Weak<()>,
    /// Records put aside: the first of an episode is logged, then a summary a minute.
    quarantined: &'a mut EpisodeLog,
    /// When a retry first found every sender gone (kept across groups: shutdown's allowance is for all of
    /// them together).
    closing_since: &'a mut Option<Instant>,
    /// Log every written record in `ship_log` (a shared store is configured).
    ship: bool,
}

/// How [`Committer::write_retrying`] ended.
enum Written {
    Committed,
    /// Failed for a reason that is not transient: one of the records, probably.
    Refused(StoreError),
    /// Still failing transiently when shutdown's allowance ran out.
    GaveUp,
}

impl Committer<'_> {
    /// Store `batch` (which starts at `offset` in the group); the group indexes of records not stored go to
    /// `lost`, in order. A refused batch is split in two, each half written on its own, in order (what the
    /// records write does not depend on how they are grouped, see `coalesce`): a record that fails alone is
    /// put aside, and the other 999 of a thousand are stored in about twenty transactions.
    fn commit(&mut self, batch: &[Record], offset: usize, lost: &mut Vec<usize>) {
        match self.write_retrying(batch) {
            Written::Committed => {}
            Written::GaveUp => {
                self.metrics.store_dropped.add(batch.len() as u64);
                lost.extend(offset..offset + batch.len());
            }
            Written::Refused(e) if batch.len() == 1 => {
                self.metrics.store_errors.inc();
                match super::quarantine::put(self.conn, &batch[0], &e) {
                    Ok(()) => {
                        self.metrics.store_quarantined.inc();
                        match self.quarantined.failure() {
                            EpisodeReport::First => tracing::warn!(
                                error = %e,
                                "A record failed to store on its own; kept in the store's quarantine table \
                                 (counted in llmtap_store_quarantined_total, summarised once a minute)"
                            ),
                            EpisodeReport::Summary { count } => tracing::warn!(
                                last_error = %e,
                                "{count} more records put in the store's quarantine table in the last minute"
                            ),
                            EpisodeReport::Quiet => {}
                        }
                    }
                    Err(q) => {
                        self.metrics.store_error(&q);
                        self.metrics.store_dropped.inc();
                    }
                }
                lost.push(offset);
            }
            Written::Refused(_) => {
                // Not counted yet: the halves say which record it was.
                let mid = batch.len() / 2;
                self.commit(&batch[..mid], offset, lost);
                self.commit(&batch[mid..], offset + mid, lost);
            }
        }
    }

    /// Write `batch` in one transaction, waiting out transient errors with back-off. While this waits, the
    /// batches behind it stay in the channel and the pipeline blocks on it (back-pressure: the capture spill,
    /// when on, takes the traffic meanwhile).
    fn write_retrying(&mut self, batch: &[Record]) -> Written {
        let mut wait = RETRY_FIRST;
        loop {
            let started = std::time::Instant::now();
            let e = match write_batch_logged(self.conn, batch, self.chunks, self.ship) {
                Ok(()) => {
                    self.metrics.record_commit(started.elapsed().as_secs_f64());
                    return Written::Committed;
                }
                Err(e) if is_transient(&e) => e,
                Err(e) => return Written::Refused(e),
            };
            // Busy is a wait for another connection (an exporter's cursor), not a failure worth counting.
            if !e.is_busy() {
                self.metrics.store_error(&e);
            }
            if self.senders.strong_count() == 0 {
                let since = *self.closing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= RETRY_AT_SHUTDOWN {
                    tracing::error!(error = %e, records = batch.len(), "Store still failing at shutdown; records given up");
                    return Written::GaveUp;
                }
            }
            self.metrics.store_retries.inc();
            std::thread::sleep(wait);
            wait = (wait * 2).min(RETRY_MAX);
        }
    }
}

/// The export log's last committed seq, for the sinks' lag (`llmtap_export_lag`).
fn publish_export_head(conn: &Connection, metrics: &Metrics) {
    let head = conn
        .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM export_log")
        .and_then(|mut s| s.query_row([], |r| r.get::<_, i64>(0)));
    if let Ok(head) = head {
        metrics.export_head.set(head.max(0) as u64);
    }
}

/// The writer's page cache, in KiB (SQLite's negative `cache_size`). Trajectory, session and step ids are
/// hashes, so their index entries land on pages all over each index; with SQLite's default 2 MiB most inserts
/// first read their page back from the file, and a big transaction spills pages to the WAL before it commits.
/// The cache fills only as pages are used: an idle or lightly used llmtap does not grow by it.
const WRITER_CACHE_KIB: i64 = 64 * 1024;
/// When the WAL restarts, its file is cut back to this size, so the space a burst took is given back.
const WAL_SIZE_LIMIT_BYTES: i64 = 64 * 1024 * 1024;

/// Settings for the writer's connection only; readers keep SQLite's defaults. Store CPU per exchange in
/// `llmtap-bench store-rate` (~2 KB chat completion): see docs/performance.md.
fn tune_writer(conn: &Connection) -> Result<(), StoreError> {
    conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
    // SQLite's own checkpoints at the same size, in case the checkpoint thread cannot start (its WAL hook,
    // installed after this, turns them off).
    conn.pragma_update(None, "wal_autocheckpoint", CHECKPOINT_PAGES)?;
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT_BYTES)?;
    Ok(())
}

/// One transaction for the batch. `chunks` learns the batch's new chunk ids only once it commits.
#[cfg(test)]
pub(crate) fn write_batch(conn: &mut Connection, batch: &[Record], chunks: &mut ChunkCache) -> Result<(), StoreError> {
    write_batch_logged(conn, batch, chunks, false)
}

/// [`write_batch`], also logging each record written in `ship_log` when `ship` (once per record and batch).
fn write_batch_logged(
    conn: &mut Connection,
    batch: &[Record],
    chunks: &mut ChunkCache,
    ship: bool,
) -> Result<(), StoreError> {
    let result = (|| {
        let tx = conn.transaction()?;
        let slots = plan(batch);
        // Trajectory rows first: their traces and steps carry the number a trajectory gets when its row is first
        // written (schema v10). The pipeline sends each call's summary with its trace and steps, so this finds
        // the number of nearly every row of the batch.
        let mut numbers = TrajectoryNumbers::default();
        for (record, slot) in batch.iter().zip(&slots) {
            if let (Record::Trajectory(t), &Slot::TrajectoryFirst { last, prompts, tools }) = (record, slot) {
                let at = |i: Option<usize>| i.and_then(|i| trajectory_at(batch, i));
                let last = at(Some(last)).unwrap_or(t);
                let number = upsert_trajectory(&tx, t, last, at(prompts), at(tools))?;
                numbers.0.insert(&t.trajectory_id, number);
            }
        }
        for (record, slot) in batch.iter().zip(slots) {
            match (record, slot) {
                (Record::Trace(t), _) => {
                    let number = match &t.trajectory_id {
                        Some(id) => Some(numbers.of(&tx, id, || placeholder_for_trace(t, id))?),
                        None => None,
                    };
                    insert_trace(&tx, t, number, chunks)?
                }
                (Record::Step(s), Slot::StepFirst { last }) => {
                    let last = step_at(batch, last).unwrap_or(s);
                    let number = numbers.of(&tx, &s.trajectory_id, || placeholder_for_step(s))?;
                    let inserted = upsert_step(&tx, s, last, number)?;
                    log_step(&tx, s, inserted)?;
                }
                // A later version: the row exists by then, as its first version wrote it.
                (Record::Step(s), _) => log_step(&tx, s, false)?,
                (Record::Trajectory(t), _) => log_trajectory(&tx, t)?,
            }
        }
        if ship {
            log_shipping(&tx, batch)?;
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

/// One `ship_log` entry per record of the batch (a record sent in several versions is read back once, as the
/// batch left it).
fn log_shipping(tx: &rusqlite::Transaction<'_>, batch: &[Record]) -> Result<(), StoreError> {
    let mut seen: rustc_hash::FxHashSet<(ExportKind, &str)> = Default::default();
    let mut insert = tx.prepare_cached("INSERT INTO ship_log (kind, ref) VALUES (?1, ?2)")?;
    for record in batch {
        let entry = match record {
            Record::Trace(t) => (ExportKind::Trace, t.id.as_str()),
            Record::Step(s) => (ExportKind::Step, s.step_id.as_str()),
            Record::Trajectory(t) => (ExportKind::Trajectory, t.trajectory_id.as_str()),
        };
        if seen.insert(entry) {
            insert.execute(params![entry.0.as_str(), entry.1])?;
        }
    }
    Ok(())
}

/// Trajectory id → its number (`trajectories.seq`), for one transaction.
#[derive(Default)]
struct TrajectoryNumbers<'a>(FxHashMap<&'a str, i64>);

impl<'a> TrajectoryNumbers<'a> {
    /// The number of trajectory `id`: as the batch's summaries wrote it, else as the store holds it. A trajectory
    /// with no row yet (a trace or step sent without its summary, which the pipeline does not do) gets one now,
    /// from `placeholder`; its summary, when it comes, replaces all but its start.
    fn of(
        &mut self,
        tx: &rusqlite::Transaction<'_>,
        id: &'a str,
        placeholder: impl FnOnce() -> TrajectorySummary,
    ) -> Result<i64, StoreError> {
        if let Some(&n) = self.0.get(id) {
            return Ok(n);
        }
        let stored = tx
            .prepare_cached("SELECT seq FROM trajectories WHERE trajectory_id = ?1")?
            .query_row([id], |r| r.get::<_, i64>(0))
            .optional()?;
        let n = match stored {
            Some(n) => n,
            None => {
                let summary = placeholder();
                upsert_trajectory(tx, &summary, &summary, None, None)?
            }
        };
        self.0.insert(id, n);
        Ok(n)
    }
}

fn placeholder_for_trace(t: &ProviderTrace, id: &str) -> TrajectorySummary {
    TrajectorySummary {
        trajectory_id: id.to_owned(),
        session_id: t.session_id.clone(),
        started_at: rfc3339(t.timings.start),
        ended_at: rfc3339(t.timings.end),
        ..Default::default()
    }
}

fn placeholder_for_step(s: &Step) -> TrajectorySummary {
    TrajectorySummary {
        trajectory_id: s.trajectory_id.clone(),
        session_id: s.session_id.clone(),
        started_at: s.timestamp.clone(),
        ended_at: s.timestamp.clone(),
        ..Default::default()
    }
}

/// A value as JSON text for a column. A failure is an error, never an empty string: a row with `""` where JSON
/// belongs would read back as corrupt later instead of failing now, where it is counted and logged.
fn json<T: serde::Serialize + ?Sized>(what: &'static str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|source| StoreError::Serialize { what, source })
}

/// `number`: the trace's trajectory's (None without a trajectory).
fn insert_trace(
    tx: &rusqlite::Transaction<'_>,
    t: &ProviderTrace,
    number: Option<i64>,
    chunks: &mut ChunkCache,
) -> Result<(), StoreError> {
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
            cost_cache_write_usd, cost_output_usd, cost_reasoning_usd, trajectory_seq)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22,
            ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30)")?.execute(params![
            t.id,
            t.trajectory_id,
            t.session(),
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
            number,
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

fn step_at(batch: &[Record], i: usize) -> Option<&Step> {
    match batch.get(i) {
        Some(Record::Step(s)) => Some(s),
        _ => None,
    }
}

fn trajectory_at(batch: &[Record], i: usize) -> Option<&TrajectorySummary> {
    match batch.get(i) {
        Some(Record::Trajectory(t)) => Some(t),
        _ => None,
    }
}

/// Writes the step's row as versions `first` to `last` of the batch leave it (see `coalesce.rs`): the columns
/// an update keeps from `first`, the body and trace id from `last`. `number`: its trajectory's. True if the row
/// is new.
fn upsert_step(tx: &rusqlite::Transaction<'_>, first: &Step, last: &Step, number: i64) -> Result<bool, StoreError> {
    let started_us = first
        .timings
        .as_ref()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t.started_at).ok())
        .or_else(|| chrono::DateTime::parse_from_rfc3339(&first.timestamp).ok())
        .map(|t| t.timestamp_micros())
        .unwrap_or(0);
    // Compressed (see `codec.rs`): a step holds the tool results it observed, the largest part of what a long
    // session stores besides the bodies (~2.5 KB of text per call in `llmtap-bench bytes`). Rows written before
    // are text.
    let body = compress(&json("step", last)?);
    // Most writes are a step's first (one statement); an update keeps the original seq (and so the original
    // export position) of the step.
    let inserted = tx
        .prepare_cached(
            "INSERT OR IGNORE INTO steps (step_id, trajectory_id, session_id, step_index, role, trace_id, started_us, body,
                 trajectory_seq)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?
        .execute(params![
            first.step_id,
            first.trajectory_id,
            first.session_id,
            first.step_index,
            first.role.as_str(),
            last.provider_trace_id,
            started_us,
            body,
            number
        ])?
        == 1;
    if !inserted {
        tx.prepare_cached("UPDATE steps SET body = ?2, trace_id = ?3 WHERE trajectory_seq = ?4 AND step_id = ?1")?
            .execute(params![first.step_id, body, last.provider_trace_id, number])?;
    }
    Ok(inserted)
}

/// The export-log entry of one version of a step: `inserted` if this version's write created the row.
fn log_step(tx: &rusqlite::Transaction<'_>, s: &Step, inserted: bool) -> Result<(), StoreError> {
    // An agent step's first write is when its call's span can be built (trace row and step both present).
    if inserted && let (crate::model::step::StepRole::Agent, Some(trace_id)) = (s.role, &s.provider_trace_id) {
        log_export(tx, ExportKind::Chat, trace_id)?;
    }
    // A rewrite: tool results arrived, or a retry's answer took the place of a failed one. Span sinks make the
    // tool spans from it (none for a step without results); the search indexer reads the step again.
    if !inserted {
        log_export(tx, ExportKind::Tools, &s.step_id)?;
    }
    Ok(())
}

/// Writes the trajectory's row as versions `first` to `last` of the batch leave it (see `coalesce.rs`): its start
/// from `first` (an update keeps it), the rest from `last`, the system prompts and tool definitions from the last
/// versions that carry them (`None`: kept as they are). Returns its number: a new row's is one more than the
/// largest so far.
fn upsert_trajectory(
    tx: &rusqlite::Transaction<'_>,
    first: &TrajectorySummary,
    last: &TrajectorySummary,
    prompts: Option<&TrajectorySummary>,
    tools: Option<&TrajectorySummary>,
) -> Result<i64, StoreError> {
    let us = |s: &str| {
        chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_micros())
            .unwrap_or(0)
    };
    let prompts = prompts
        .filter(|t| !t.system_prompts.is_empty())
        .map(|t| json("system prompts", &t.system_prompts))
        .transpose()?;
    let tools = tools
        .filter(|t| !t.tool_definitions.is_empty())
        .map(|t| json("tool definitions", &t.tool_definitions))
        .transpose()?;
    let body = json("trajectory", &last.without_heavy_parts())?;
    // The column holds a session only when it is not the trajectory's own id (schema v9): such rows stay out of
    // the session index. The body keeps the summary's session id as it is.
    let session = last.session_id.as_deref().filter(|s| *s != first.trajectory_id);
    let number = tx
        .prepare_cached(
            "INSERT INTO trajectories (trajectory_id, session_id, started_us, ended_us, body, system_prompts,
                 tool_definitions, seq)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, (SELECT COALESCE(MAX(seq), 0) + 1 FROM trajectories))
             ON CONFLICT(trajectory_id) DO UPDATE SET session_id = excluded.session_id, ended_us = excluded.ended_us,
                 body = excluded.body,
                 system_prompts = COALESCE(excluded.system_prompts, trajectories.system_prompts),
                 tool_definitions = COALESCE(excluded.tool_definitions, trajectories.tool_definitions)
             RETURNING seq",
        )?
        .query_row(
            params![
                first.trajectory_id,
                session,
                us(&first.started_at),
                us(&last.ended_at),
                body,
                prompts,
                tools
            ],
            |r| r.get(0),
        )?;
    Ok(number)
}

/// The export-log entry of one version of a trajectory.
fn log_trajectory(tx: &rusqlite::Transaction<'_>, t: &TrajectorySummary) -> Result<(), StoreError> {
    if t.closed {
        log_export(tx, ExportKind::Agent, &t.trajectory_id)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;
    use serde_json::json;

    use super::write_batch;
    use crate::derive::testkit::{Harness, call, calls, calls_out, result, text_out, tool_call, trace, user};
    use crate::model::call::ToolDef;
    use crate::model::exchange::Api;
    use crate::model::record::Record;
    use crate::store::chunks::ChunkCache;

    /// Two agents' sessions interleaved, as the pipeline sends them: each call's trace, steps (the previous agent
    /// step again once its tool results arrive) and trajectory summary; then every trajectory closed.
    fn sessions() -> Vec<Record> {
        let mut h = Harness::new(Api::OpenAiChat);
        let mut records = Vec::new();
        let mut conversations = [vec![user("fix the bug")], vec![user("write the docs")]];
        for i in 0..5 {
            for (a, messages) in conversations.iter_mut().enumerate() {
                let id = format!("c{a}-{i}");
                let c = tool_call(&id, "read", json!({ "path": i }));
                let output = if i == 4 {
                    text_out("done")
                } else {
                    calls_out(std::slice::from_ref(&c))
                };
                let mut call = call(&format!("agent {a}"), messages.clone(), output);
                call.tools = vec![ToolDef {
                    name: "read".into(),
                    description: None,
                    parameters: None,
                }];
                let t = trace(h.api, h.now, h.now + 1_000_000);
                h.now += 1_000_000;
                records.extend(h.deriver.observe(t, Some(call)));
                messages.push(calls(&[c]));
                messages.push(result(&id, &format!("contents of file {i}")));
            }
        }
        records.extend(h.deriver.close_all());
        records
    }

    /// The rows and export log a store holds, in `seq` order, as text.
    fn contents(conn: &Connection) -> Vec<String> {
        let mut out = Vec::new();
        for sql in [
            "SELECT step_id, trajectory_id, trajectory_seq, session_id, step_index, role, trace_id, started_us, \
             CAST(body AS BLOB) FROM steps ORDER BY seq",
            "SELECT trajectory_id, session_id, started_us, ended_us, body, system_prompts, tool_definitions, seq \
             FROM trajectories ORDER BY trajectory_id",
            "SELECT kind, ref, NULL, NULL, NULL, NULL, NULL, NULL FROM export_log ORDER BY seq",
            "SELECT id, trajectory_id, trajectory_seq, session_id, NULL, NULL, NULL, NULL FROM traces ORDER BY seq",
        ] {
            let mut stmt = conn.prepare(sql).unwrap_or_else(|e| panic!("{e}"));
            let n = stmt.column_count();
            let rows = stmt
                .query_map([], |r| {
                    (0..n)
                        .map(|i| r.get::<_, rusqlite::types::Value>(i).map(|v| format!("{v:?}")))
                        .collect::<Result<Vec<_>, _>>()
                })
                .unwrap_or_else(|e| panic!("{e}"));
            for row in rows {
                out.push(row.unwrap_or_else(|e| panic!("{e}")).join(" | "));
            }
        }
        out
    }

    fn store_of(batches: &[&[Record]]) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut chunks = ChunkCache::default();
        for batch in batches {
            write_batch(&mut conn, batch, &mut chunks).unwrap_or_else(|e| panic!("{e}"));
        }
        contents(&conn)
    }

    #[test]
    fn a_coalesced_batch_leaves_the_rows_and_export_log_of_one_record_at_a_time() {
        let mut records = sessions();
        // Versions the deriver does not send but the writer must still get right: a trajectory closed, then
        // updated again without its prompts and tools (the carried ones stay; the close is still logged).
        let Some(Record::Trajectory(last)) = records.iter().rev().find(|r| matches!(r, Record::Trajectory(_))) else {
            panic!("no trajectory")
        };
        let mut closed = last.clone();
        closed.closed = true;
        closed.system_prompts.insert("h".into(), "another prompt".into());
        let mut reopened = closed.clone();
        reopened.closed = false;
        reopened.system_prompts.clear();
        reopened.tool_definitions.clear();
        reopened.ended_at = "2030-01-01T00:00:00Z".into();
        records.push(Record::Trajectory(closed));
        records.push(Record::Trajectory(reopened));

        let steps = records.iter().filter(|r| matches!(r, Record::Step(_))).count();
        let trajectories = records.iter().filter(|r| matches!(r, Record::Trajectory(_))).count();
        let one_at_a_time: Vec<&[Record]> = records.chunks(1).collect();
        let expected = store_of(&one_at_a_time);
        assert!(
            expected.len() < records.len() + 4,
            "the sessions rewrite steps and trajectories: {} rows and entries from {} records ({steps} steps, \
             {trajectories} trajectories)",
            expected.len(),
            records.len()
        );
        assert!(
            expected.iter().any(|r| r.starts_with("Text(\"tools\")")),
            "{expected:#?}"
        );
        assert!(expected.iter().any(|r| r.contains("another prompt")), "{expected:#?}");
        // Conversations without a session header are their own sessions: the column leaves that out (schema v9),
        // and the body keeps it.
        let own_session = records
            .iter()
            .any(|r| matches!(r, Record::Trajectory(t) if t.session_id.as_deref() == Some(t.trajectory_id.as_str())));
        assert!(own_session, "the deriver names a conversation's own session");
        let trajectory_rows: Vec<&String> = expected
            .iter()
            .filter(|r| r.contains("\\\"trajectory_id\\\""))
            .collect();
        assert_eq!(trajectory_rows.len(), 2, "{expected:#?}");
        assert!(
            trajectory_rows.iter().all(|r| r.split(" | ").nth(1) == Some("Null")),
            "{trajectory_rows:#?}"
        );
        assert_eq!(store_of(&[&records]), expected, "one batch");
        // Batches that split a step's or a trajectory's versions between them.
        for size in [2, 3, 7] {
            let batches: Vec<&[Record]> = records.chunks(size).collect();
            assert_eq!(store_of(&batches), expected, "batches of {size}");
        }
    }

    /// Issue 36 item 9: one record SQLite refuses (here a trigger, as a constraint or a damaged value would)
    /// in a batch of 1,000. The other 999 are stored, the bad one is kept in the quarantine table with its
    /// error and counted; before, the whole batch was lost.
    #[test]
    fn one_poisoned_record_in_a_batch_of_a_thousand_is_put_aside_and_the_rest_stored() {
        use std::sync::Arc;

        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch(
            "CREATE TRIGGER poison BEFORE INSERT ON traces WHEN NEW.id = 'trace-500' \
             BEGIN SELECT RAISE(ABORT, 'poisoned record'); END;",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let metrics = Arc::new(crate::telemetry::Metrics::default());
        let (tx, writer) = super::StoreWriter::spawn(conn, Default::default(), metrics.clone(), Default::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let batch: Vec<Record> = (0..1000)
            .map(|i| Record::Trace(Box::new(trace(Api::OpenAiChat, i, i + 10))))
            .collect();
        tx.send(batch);
        drop(tx);
        writer.join().unwrap_or_else(|_| panic!("writer"));

        let db = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let count = |sql: &str| -> i64 { db.query_row(sql, [], |r| r.get(0)).unwrap_or_else(|e| panic!("{e}")) };
        assert_eq!(count("SELECT COUNT(*) FROM traces"), 999);
        assert_eq!(count("SELECT COUNT(*) FROM traces WHERE id = 'trace-500'"), 0);
        let (kind, reference, error, record): (String, String, String, String) = db
            .query_row("SELECT kind, ref, error, record FROM quarantine", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((kind.as_str(), reference.as_str()), ("trace", "trace-500"));
        assert!(error.contains("poisoned record"), "{error}");
        assert!(record.contains("\"id\":\"trace-500\""), "{record}");
        assert_eq!(metrics.stored.get(), 999);
        assert_eq!(
            metrics.store_pending.get(),
            0,
            "stored and quarantined records are no longer pending"
        );
        assert_eq!(metrics.store_quarantined.get(), 1);
        assert_eq!(metrics.store_dropped.get(), 0);
    }

    /// Rows sent without their trajectory's summary (the pipeline always sends it; another writer might not) are
    /// still numbered under their trajectory and found by it; the summary that comes later keeps the number and
    /// replaces the placeholder's body.
    #[test]
    fn rows_sent_before_their_summary_are_found_under_their_trajectory() {
        let records = sessions();
        let Some(Record::Step(step)) = records.iter().find(|r| matches!(r, Record::Step(_))) else {
            panic!("no step")
        };
        let Some(Record::Trajectory(summary)) = records
            .iter()
            .find(|r| matches!(r, Record::Trajectory(t) if t.trajectory_id == step.trajectory_id))
        else {
            panic!("no summary")
        };
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut chunks = ChunkCache::default();
        let write = |conn: &mut Connection, chunks: &mut ChunkCache, r: &Record| {
            write_batch(conn, std::slice::from_ref(r), chunks).unwrap_or_else(|e| panic!("{e}"))
        };
        write(&mut conn, &mut chunks, &Record::Step(step.clone()));
        let reader = crate::store::StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let found = |reader: &crate::store::StoreReader| {
            reader
                .steps_page(&step.trajectory_id, None, 10)
                .unwrap_or_else(|e| panic!("{e}"))
                .into_iter()
                .map(|s| s.step_id)
                .collect::<Vec<_>>()
        };
        assert_eq!(found(&reader), std::slice::from_ref(&step.step_id));
        let number = |conn: &Connection| -> (i64, String) {
            conn.query_row(
                "SELECT seq, body FROM trajectories WHERE trajectory_id = ?1",
                [&step.trajectory_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let (placeholder, _) = number(&conn);
        write(&mut conn, &mut chunks, &Record::Trajectory(summary.clone()));
        let (kept, body) = number(&conn);
        assert_eq!(kept, placeholder);
        assert!(body.contains("\"llm_calls\":1"), "{body}");
        assert_eq!(found(&reader), std::slice::from_ref(&step.step_id));
    }
}
