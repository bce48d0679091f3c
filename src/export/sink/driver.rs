//! The one loop every sink runs in: read the next batch after the sink's persisted cursor, hand it to the sink,
//! retry or pause as the outcome says, move the cursor only once the batch is done with (at-least-once), and
//! keep the sink's metrics and log honest. One task per sink, all on the export thread's runtime.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::retry::RetryPolicy;
use super::{Accepted, SendError, Sink};
use crate::model::record::ExportSeq;
use crate::store::{Cursor, LogTable, RecentRecords, StoreError, StoreReader};
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics, SinkStats};

/// After shutdown is requested, how long a sink keeps draining what is already stored.
pub const FLUSH_DEADLINE: Duration = Duration::from_secs(5);

/// How long a sink waits before looking at the store again when the last look found less than a full batch
/// (or nothing): records gather into batches instead of going out a few at a time, as the OpenTelemetry
/// Collector's batch processor does on the same 200 ms. Every look costs a read of the export log, a round
/// trip, the receiver's work and a cursor write. A full batch is followed at once by the next, so a backlog
/// drains at full speed; during the shutdown flush there is no wait. (At 500 req/s, against looking again right
/// after a send: exporter CPU 82 → 74 µs per exchange, `perf stat --per-thread`. Modest, because the store
/// commits every 50 ms or so and a look right after a send mostly found nothing new.)
const IDLE_POLL: Duration = Duration::from_millis(200);

/// What the driver needs to know about a sink besides the sink itself.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// Names the sink's cursor in the store, its metrics and its log lines.
    pub name: String,
    pub data_dir: PathBuf,
    /// Export-log entries per batch.
    pub batch_size: usize,
    /// Retry backoff; `retry.max` also caps server-given delays and paces probes of a paused sink.
    pub retry: RetryPolicy,
    /// The writer's last committed records, which the sink's reader consults before the store.
    pub recent: Arc<RecentRecords>,
    /// The log the sink follows: the export log (span and file sinks), or the ship log (the shared store).
    pub log: LogTable,
    /// The store writer's commit count (`store::feed`): a sink that found nothing new waits for it to move
    /// instead of polling the store. None: it looks again every `IDLE_POLL`.
    pub commits: Option<tokio::sync::watch::Receiver<u64>>,
}

/// The sink's own store connections, opened once and kept across batches: opening SQLite connections per batch
/// (schema read, statements prepared again) was most of the exporter's cost under load.
struct StoreHandles {
    cursor: Cursor,
    reader: StoreReader,
}

/// A batch read from the store, with where it ends in the export log.
struct Read<B> {
    batch: B,
    last_seq: ExportSeq,
    /// The export log held a whole `batch_size` of entries: more may be waiting.
    full: bool,
}

pub struct Driver<S: Sink> {
    sink: Arc<S>,
    cfg: DriverConfig,
    metrics: Arc<Metrics>,
    stats: Arc<SinkStats>,
    /// Failures of this sink: the first of each episode is logged, then a summary a minute.
    episodes: EpisodeLog,
    /// Partial successes (items refused inside an accepted batch): logged the same way.
    partials: EpisodeLog,
    store: Option<StoreHandles>,
    /// Set when shutdown is first seen: the flush ends then.
    deadline: Option<Instant>,
}

impl<S: Sink> Driver<S> {
    pub fn new(sink: S, cfg: DriverConfig, metrics: Arc<Metrics>) -> Driver<S> {
        let stats = metrics.sinks.register(&cfg.name);
        Driver {
            sink: Arc::new(sink),
            cfg,
            metrics,
            stats,
            episodes: EpisodeLog::default(),
            partials: EpisodeLog::default(),
            store: None,
            deadline: None,
        }
    }

    pub async fn run(mut self, stop: CancellationToken) {
        loop {
            if !self.time_left(&stop) {
                break;
            }
            let read = match self.read_next().await {
                None => break,
                Some(Ok(read)) => read,
                Some(Err(e)) => {
                    // Nothing is lost: the cursor did not move and the next look reads the same records again.
                    self.store_failed(&e);
                    self.sleep(&stop, IDLE_POLL).await;
                    continue;
                }
            };
            let Some(mut read) = read else {
                if stop.is_cancelled() {
                    break;
                }
                // Nothing new: wait for the writer's next commit rather than looking again and again.
                self.wait_for_commit(&stop).await;
                continue;
            };
            if !self.deliver(&mut read.batch, &stop).await {
                break;
            }
            let seq = read.last_seq;
            match self.with_store(move |h| h.cursor.set(seq)).await {
                None => break,
                Some(Ok(())) => self.stats.set_cursor(seq.0),
                // The next look reopens the store and sends the batch again from the saved position: at least
                // once, never lost.
                Some(Err(e)) => self.store_failed(&e),
            }
            // Caught up: let the next batch gather (see IDLE_POLL). A stop request ends the wait at once.
            if !read.full && self.deadline.is_none() {
                self.sleep(&stop, IDLE_POLL).await;
            }
        }
    }

    /// Send until the batch is done with (true), or the shutdown flush is over (false: the cursor stays).
    async fn deliver(&mut self, batch: &mut S::Batch, stop: &CancellationToken) -> bool {
        let items = self.sink.items(batch) as u64;
        let mut schedule = self.cfg.retry.schedule();
        loop {
            let wait = match self.sink.send(batch).await {
                Ok(accepted) => {
                    self.accepted(items, accepted);
                    return true;
                }
                Err(e) => {
                    self.failed(&e);
                    match e {
                        SendError::Retryable { retry_after, .. } => {
                            self.metrics.export_retries.inc();
                            schedule.next_wait(retry_after)
                        }
                        SendError::Rejected { .. } => {
                            // OTLP forbids retrying a rejection: count it, move past it.
                            self.metrics.export_failed.add(items);
                            self.stats.send_failed.add(items);
                            return true;
                        }
                        SendError::Unauthorized { .. } => {
                            // Not this batch's fault: keep it and the cursor, and probe again later. A paused
                            // sink has nothing to flush, so shutdown does not wait for it.
                            self.stats.paused.set(1);
                            if stop.is_cancelled() {
                                return false;
                            }
                            self.cfg.retry.max
                        }
                    }
                }
            };
            if !self.sleep(stop, wait).await {
                return false;
            }
        }
    }

    fn accepted(&mut self, items: u64, accepted: Accepted) {
        self.metrics.exported.add(items.saturating_sub(accepted.rejected));
        self.stats.sent.add(items.saturating_sub(accepted.rejected));
        self.stats.paused.set(0);
        self.stats.clear_error();
        if let Some(quiet) = self.episodes.success() {
            tracing::info!(sink = %self.cfg.name, unreported_failures = quiet, "Export recovered");
        }
        if accepted.rejected > 0 {
            // A partial success is final: the spec forbids retrying it.
            self.metrics.export_failed.add(accepted.rejected);
            self.stats.send_failed.add(accepted.rejected);
            match self.partials.failure() {
                EpisodeReport::First => {
                    tracing::warn!(sink = %self.cfg.name, rejected = accepted.rejected, message = %accepted.message, "Receiver rejected some items")
                }
                EpisodeReport::Summary { count } => {
                    tracing::warn!(sink = %self.cfg.name, count, message = %accepted.message, "Receiver rejected some items of {count} more batches in the last minute")
                }
                EpisodeReport::Quiet => {}
            }
        } else {
            self.partials.success();
        }
    }

    /// Record and log a failed send: the first of an episode in full, then a summary a minute.
    fn failed(&self, e: &SendError) {
        self.stats.failures.inc();
        self.stats.set_error(&e.to_string());
        let name = &self.cfg.name;
        match self.episodes.failure() {
            EpisodeReport::First => match e {
                SendError::Retryable { .. } => {
                    tracing::warn!(sink = %name, error = %e, "Export failed; retrying (records stay in the store)")
                }
                SendError::Rejected { .. } => {
                    tracing::error!(sink = %name, error = %e, "Export rejected; batch dropped")
                }
                SendError::Unauthorized { .. } => tracing::error!(
                    sink = %name, error = %e, probe_every = ?self.cfg.retry.max,
                    "Destination refused our credentials; sink paused (nothing dropped) until it accepts"
                ),
            },
            EpisodeReport::Summary { count } => {
                tracing::warn!(sink = %name, count, last_error = %e, "{count} more export failures in the last minute")
            }
            EpisodeReport::Quiet => {}
        }
    }

    fn store_failed(&self, e: &StoreError) {
        // SQLite reports a busy store when the writer holds it past the timeout under load; that is a wait, not
        // a failure.
        if e.is_busy() {
            tracing::debug!(sink = %self.cfg.name, error = %e, "Store busy; export retries");
        } else {
            // Counted, and logged once.
            self.metrics.store_error(e);
        }
    }

    /// The next batch after the cursor (None: caught up). Outer None: the runtime is going away.
    async fn read_next(&mut self) -> Option<Result<Option<Read<S::Batch>>, StoreError>> {
        // What the read will see includes every commit counted so far.
        if let Some(c) = self.cfg.commits.as_mut() {
            c.mark_unchanged();
        }
        let sink = self.sink.clone();
        let batch_size = self.cfg.batch_size;
        let log = self.cfg.log;
        let stats = self.stats.clone();
        self.with_store(move |h| {
            let after = h.cursor.get()?;
            // The sink's lag is the writer's head minus this, computed when `/metrics` is read (`SinkStats`).
            stats.set_cursor(after.0);
            h.reader.in_snapshot(|reader| {
                let entries = reader.log_entries(log, after, batch_size)?;
                let Some(last_seq) = entries.last().map(|e| e.seq) else {
                    return Ok(None);
                };
                let batch = sink.build(reader, &entries)?;
                Ok(Some(Read {
                    batch,
                    last_seq,
                    full: entries.len() >= batch_size,
                }))
            })
        })
        .await
    }

    /// Run `f` against the sink's store connections on the blocking pool (SQLite blocks; building a batch is
    /// capture work that must not compete with the data path). None when the runtime is shutting down.
    async fn with_store<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&StoreHandles) -> Result<T, StoreError> + Send + 'static,
    ) -> Option<Result<T, StoreError>> {
        let open = self.store.take();
        let data_dir = self.cfg.data_dir.clone();
        let name = self.cfg.name.clone();
        let recent = self.cfg.recent.clone();
        let joined = tokio::task::spawn_blocking(move || {
            // Blocking-pool threads only run background work in llmtap, so lowering one is harmless.
            crate::background::run_in_background();
            let handles = match open {
                Some(h) => h,
                None => match Cursor::open(&data_dir, &name)
                    .and_then(|cursor| Ok((cursor, StoreReader::open(&data_dir)?.with_recent(recent))))
                {
                    Ok((cursor, reader)) => StoreHandles { cursor, reader },
                    Err(e) => return (None, Err(e)),
                },
            };
            match f(&handles) {
                Ok(v) => (Some(handles), Ok(v)),
                // Reopen after a store error: the file may have been replaced.
                Err(e) => (None, Err(e)),
            }
        })
        .await;
        let (handles, result) = joined.ok()?;
        self.store = handles;
        Some(result)
    }

    /// False once the shutdown flush deadline is over (starting it when shutdown is first seen).
    fn time_left(&mut self, stop: &CancellationToken) -> bool {
        if stop.is_cancelled() && self.deadline.is_none() {
            self.deadline = Some(Instant::now() + FLUSH_DEADLINE);
        }
        self.deadline.is_none_or(|d| Instant::now() < d)
    }

    /// Until the writer commits again (or `IDLE_POLL` without a commit feed), a stop request, or the flush
    /// deadline. Commits seen before the last read count as seen: the read looked at them.
    async fn wait_for_commit(&mut self, stop: &CancellationToken) {
        let Some(mut commits) = self.cfg.commits.clone() else {
            self.sleep(stop, IDLE_POLL).await;
            return;
        };
        if self.deadline.is_some() {
            // Flushing at shutdown: the writer has stopped; nothing more will come.
            self.sleep(stop, IDLE_POLL).await;
            return;
        }
        tokio::select! {
            changed = commits.changed() => {
                if changed.is_err() {
                    // The writer is gone: fall back to looking now and then.
                    self.cfg.commits = None;
                }
            }
            _ = stop.cancelled() => {}
        }
        if let Some(c) = self.cfg.commits.as_mut() {
            c.mark_unchanged();
        }
    }

    /// Sleep `d`, cut short by a stop request (which starts the flush deadline) and by the deadline itself.
    /// False when the deadline is over.
    async fn sleep(&mut self, stop: &CancellationToken, d: Duration) -> bool {
        if !self.time_left(stop) {
            return false;
        }
        match self.deadline {
            Some(dl) => tokio::time::sleep(d.min(dl.saturating_duration_since(Instant::now()))).await,
            None => {
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = stop.cancelled() => {}
                }
            }
        }
        self.time_left(stop)
    }
}
