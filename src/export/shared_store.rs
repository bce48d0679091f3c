//! The sink that delivers this replica's records to the team's shared PostgreSQL store (`[store] url`). It reads
//! the ship log (every record the store writer committed) behind its own cursor, reads each record back from the
//! local store as it is now, and upserts the batch in one transaction (`store::postgres`). The shared driver
//! gives it what every sink has: at-least-once delivery across outages and restarts, back-off, metrics, and log
//! lines once per failure episode. The local store is the spool: nothing waits in memory.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::sink::driver::{Driver, DriverConfig};
use super::sink::retry::RetryPolicy;
use super::sink::{Accepted, LogEntry, SendError, Sink};
use crate::model::record::ExportKind;
use crate::store::postgres::{PgStore, SHIP_CURSOR, ShipBatch, is_refused_credentials, is_transient};
use crate::store::{LogTable, RecentRecords, StoreError, StoreReader};
use crate::telemetry::Metrics;

/// Ship-log entries per transaction (one statement per table each): 1,024 delivered about twice the rows per
/// second of 256 (`llmtap-bench shared-store`).
pub const BATCH: usize = 1024;
/// How often a replica applies the shared store's retention (any replica may; they delete the same rows).
const RETENTION_EVERY: Duration = Duration::from_secs(600);

pub struct SharedStoreSink {
    store: Arc<PgStore>,
    replica: String,
    retention_days: u64,
    last_retention: std::sync::Mutex<Option<Instant>>,
}

impl Sink for SharedStoreSink {
    type Batch = Arc<ShipBatch>;

    fn build(&self, reader: &StoreReader, entries: &[LogEntry]) -> Result<Arc<ShipBatch>, StoreError> {
        batch_of(reader, entries).map(Arc::new)
    }

    fn items(&self, batch: &Arc<ShipBatch>) -> usize {
        batch.len()
    }

    async fn send(&self, batch: &mut Arc<ShipBatch>) -> Result<Accepted, SendError> {
        if !batch.is_empty()
            && let Err(e) = self.store.ship(batch.clone(), self.replica.clone()).await
        {
            return Err(if is_refused_credentials(&e) {
                SendError::Unauthorized { message: e.to_string() }
            } else if is_transient(&e) {
                SendError::Retryable {
                    message: e.to_string(),
                    retry_after: None,
                }
            } else {
                SendError::Rejected { message: e.to_string() }
            });
        }
        self.retain_when_due().await;
        Ok(Accepted::default())
    }
}

/// The records ship-log `entries` name, as the local store holds them now. A record retention already deleted
/// locally is skipped: there is nothing left to deliver.
pub fn batch_of(reader: &StoreReader, entries: &[LogEntry]) -> Result<ShipBatch, StoreError> {
    let mut batch = ShipBatch::default();
    for entry in entries {
        match entry.kind {
            ExportKind::Trace => {
                if let Some(t) = reader.trace(&entry.reference)? {
                    batch.add_trace(&t)?;
                }
            }
            ExportKind::Step => {
                if let Some(s) = reader.step_by_id(&entry.reference)? {
                    batch.add_step(&s)?;
                }
            }
            ExportKind::Trajectory => {
                if let Some(t) = reader.trajectory(&entry.reference)? {
                    batch.add_trajectory(&t)?;
                }
            }
            ExportKind::Chat | ExportKind::Tools | ExportKind::Agent => {}
        }
    }
    Ok(batch)
}

impl SharedStoreSink {
    async fn retain_when_due(&self) {
        if self.retention_days == 0 {
            return;
        }
        let due = match self.last_retention.lock() {
            Ok(mut last) if last.is_none_or(|t| t.elapsed() >= RETENTION_EVERY) => {
                *last = Some(Instant::now());
                true
            }
            _ => false,
        };
        if !due {
            return;
        }
        let cutoff = chrono::Utc::now().timestamp_micros() - (self.retention_days as i64) * 86_400_000_000;
        if let Err(error) = self.store.retain(cutoff).await {
            tracing::warn!(%error, "Shared store retention failed; tried again later");
        }
    }
}

/// What the shared-store sink needs from the app.
pub struct SharedStoreContext {
    pub store: Arc<PgStore>,
    pub replica: String,
    pub data_dir: PathBuf,
    pub retention_days: u64,
    pub metrics: Arc<Metrics>,
    pub recent: Arc<RecentRecords>,
    /// The writer's commit count: the sink wakes on commits instead of polling.
    pub commits: tokio::sync::watch::Receiver<u64>,
}

/// Deliver this replica's records to the shared store until `stop` (and its flush) is over; what is left is
/// delivered after the next start.
pub async fn run(ctx: SharedStoreContext, stop: CancellationToken) {
    let cfg = DriverConfig {
        name: SHIP_CURSOR.to_owned(),
        data_dir: ctx.data_dir,
        batch_size: BATCH,
        retry: RetryPolicy {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(5),
        },
        recent: ctx.recent,
        log: LogTable::Ship,
        commits: Some(ctx.commits),
    };
    let sink = SharedStoreSink {
        store: ctx.store,
        replica: ctx.replica,
        retention_days: ctx.retention_days,
        last_retention: std::sync::Mutex::new(None),
    };
    Driver::new(sink, cfg, ctx.metrics).run(stop).await;
}
