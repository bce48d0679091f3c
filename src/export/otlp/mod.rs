//! OTLP export: one worker per destination, each reading the store's export log behind its own persisted
//! cursor (at-least-once: the cursor moves only after the receiver accepted the batch, or rejected it for
//! good). A receiver that is down, or an llmtap restart, delays export and loses nothing.

pub mod metrics;
pub mod spans;
pub mod transport;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, OtlpConfig};
use crate::store::{Cursor, StoreError, StoreReader};
use crate::telemetry::Metrics;
use transport::{ExportError, Transport};

/// After shutdown is requested, how long a worker keeps draining what is already stored.
pub const FLUSH_DEADLINE: Duration = Duration::from_secs(5);
/// How long the exporter waits before looking at the store again when the last look found less than a full batch
/// (or nothing): records gather into batches instead of going out a few at a time, as the OpenTelemetry
/// Collector's batch processor does on the same 200 ms. Every look costs a read of the export log, a gRPC round
/// trip, the receiver's work and a cursor write. A full batch is followed at once by the next, so a backlog
/// drains at full speed; during the shutdown flush there is no wait. (At 500 req/s, against looking again right
/// after a send: exporter CPU 82 → 74 µs per exchange, `perf stat --per-thread`. Modest, because the store
/// commits every 50 ms or so and a look right after a send mostly found nothing new.)
const IDLE_POLL: Duration = Duration::from_millis(200);

pub struct SinkContext {
    pub config: OtlpConfig,
    pub data_dir: PathBuf,
    pub resource: Vec<(String, String)>,
    pub servers: Arc<HashMap<String, (String, u16)>>,
    pub metrics: Arc<Metrics>,
}

/// Upstream name → (host, port) for server.address/server.port.
pub fn servers(config: &Config) -> HashMap<String, (String, u16)> {
    config
        .upstreams
        .values()
        .filter_map(|u| {
            let host = u.url.host()?.to_owned();
            let port = u
                .url
                .port_u16()
                .unwrap_or(if u.url.scheme_str() == Some("http") { 80 } else { 443 });
            Some((u.name.to_string(), (host, port)))
        })
        .collect()
}

struct Batch {
    last_seq: i64,
    request: ExportTraceServiceRequest,
    metrics: Option<opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest>,
    spans: usize,
    head: i64,
    /// The export log held a whole `batch_size` of entries: more may be waiting.
    full: bool,
}

/// Read the next batch after the cursor and build its spans (blocking: SQLite).
fn next_batch(ctx: &SinkContext, reader: &StoreReader, after: i64) -> Result<Option<Batch>, StoreError> {
    let entries = reader.export_log(after, ctx.config.batch_size)?;
    let head = reader.export_head()?;
    let Some(last) = entries.last().map(|e| e.0) else {
        return Ok(None);
    };
    let mut builder = spans::SpanBuilder::new(reader, ctx.config.capture_content, &ctx.servers);
    let mut all = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (_, kind, reference) in &entries {
        for s in builder.spans_for(kind, reference)? {
            // The same tool span can be logged twice (results arriving in two updates): send it once per batch.
            if seen.insert((s.trace_id.clone(), s.span_id.clone())) {
                all.push(s);
            }
        }
    }
    let spans = all.len();
    let metrics = if ctx.config.metrics {
        metrics::from_spans(&ctx.resource, &all)
    } else {
        None
    };
    Ok(Some(Batch {
        last_seq: last,
        metrics,
        request: ExportTraceServiceRequest {
            resource_spans: vec![spans::resource_spans(&ctx.resource, all)],
        },
        spans,
        head,
        full: entries.len() >= ctx.config.batch_size,
    }))
}

/// Jittered exponential backoff: base * 2^attempt, capped, times a factor in [0.5, 1.0).
fn backoff(cfg: &OtlpConfig, attempt: u32) -> Duration {
    let base = cfg
        .retry_initial
        .saturating_mul(1u32 << attempt.min(16))
        .min(cfg.retry_max);
    let jitter = (chrono::Utc::now().timestamp_subsec_nanos() % 1000) as f64 / 2000.0 + 0.5;
    base.mul_f64(jitter)
}

/// The exporter's own store connections: its cursor and a reader.
struct StoreHandles {
    cursor: Cursor,
    reader: StoreReader,
}

impl StoreHandles {
    fn open(ctx: &SinkContext) -> Result<StoreHandles, StoreError> {
        Ok(StoreHandles {
            cursor: Cursor::open(&ctx.data_dir, &ctx.config.name)?,
            reader: StoreReader::open(&ctx.data_dir)?,
        })
    }
}

pub async fn run(ctx: SinkContext, stop: CancellationToken) {
    let name = ctx.config.name.clone();
    let ctx = Arc::new(ctx);
    let mut transport = match Transport::new(&ctx.config) {
        Ok(t) => t,
        Err(error) => {
            tracing::error!(sink = %name, %error, "OTLP exporter disabled");
            return;
        }
    };
    let mut deadline: Option<Instant> = None;
    let mut logged_failure = false;
    // Opened once and kept across batches: opening SQLite connections per batch (schema read, statements
    // prepared again) was most of the exporter's cost under load.
    let mut handles: Option<StoreHandles> = None;
    loop {
        if stop.is_cancelled() && deadline.is_none() {
            deadline = Some(Instant::now() + FLUSH_DEADLINE);
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            break;
        }
        let c = ctx.clone();
        let open = handles.take();
        let built = tokio::task::spawn_blocking(move || {
            // Building spans (read, decompress, normalize) is capture work: it must not compete with the data
            // path. Blocking-pool threads only run background work in llmtap, so lowering one is harmless.
            crate::pipeline::run_in_background();
            let h = match open {
                Some(h) => h,
                None => match StoreHandles::open(&c) {
                    Ok(h) => h,
                    Err(e) => return (None, Err(e)),
                },
            };
            match h.cursor.get().and_then(|after| next_batch(&c, &h.reader, after)) {
                Ok(batch) => (Some(h), Ok(batch)),
                // Reopen after a store error: the file may have been replaced.
                Err(e) => (None, Err(e)),
            }
        })
        .await;
        let batch = match built {
            Ok((h, Ok(batch))) => {
                handles = h;
                batch
            }
            Ok((_, Err(e))) => {
                // Nothing is lost: the cursor did not move and the next poll reads the same records again.
                // SQLite reports a busy store when the writer holds it past the timeout under load; that is
                // a wait, not a failure.
                if e.is_busy() {
                    tracing::debug!(sink = %name, error = %e, "Store busy; export retries");
                } else {
                    // Counted, and logged once (not on every retry).
                    ctx.metrics.store_error(&e);
                }
                sleep_or_stop(&stop, IDLE_POLL, deadline).await;
                continue;
            }
            Err(_) => break,
        };
        let Some(batch) = batch else {
            ctx.metrics.export_lag.set(0);
            if stop.is_cancelled() {
                break;
            }
            sleep_or_stop(&stop, IDLE_POLL, deadline).await;
            continue;
        };
        ctx.metrics
            .export_lag
            .set((batch.head - batch.last_seq).max(0) as u64 + batch.spans as u64);
        let mut attempt = 0u32;
        let mut traces_done = batch.spans == 0;
        let advance = loop {
            if traces_done {
                // Metrics follow their spans; only their own failure is retried (never the spans again).
                let Some(m) = &batch.metrics else { break true };
                match transport.send_metrics(&ctx.config, m.clone()).await {
                    Ok(()) => break true,
                    Err(ExportError::Retryable { retry_after, .. }) => {
                        if !wait_to_retry(&ctx, &mut attempt, retry_after, &stop, deadline).await {
                            break false;
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(sink = %name, error = %e, "OTLP metrics rejected; dropped");
                        break true;
                    }
                }
            }
            match transport.send(&ctx.config, batch.request.clone()).await {
                Ok(acc) => {
                    ctx.metrics
                        .exported
                        .add((batch.spans as i64 - acc.rejected).max(0) as u64);
                    if acc.rejected > 0 {
                        // A partial success is final: the spec forbids retrying it.
                        ctx.metrics.export_failed.add(acc.rejected as u64);
                        tracing::warn!(sink = %name, rejected = acc.rejected, message = %acc.message, "Receiver rejected some spans");
                    }
                    logged_failure = false;
                    traces_done = true;
                    attempt = 0;
                }
                Err(ExportError::Retryable { message, retry_after }) => {
                    if !logged_failure {
                        tracing::warn!(sink = %name, error = %message, "OTLP export failed; retrying (spans stay in the store)");
                        logged_failure = true;
                    }
                    if !wait_to_retry(&ctx, &mut attempt, retry_after, &stop, deadline).await {
                        break false;
                    }
                }
                Err(e) => {
                    ctx.metrics.export_failed.add(batch.spans as u64);
                    tracing::error!(sink = %name, error = %e, spans = batch.spans, "OTLP export rejected; batch dropped");
                    traces_done = true;
                }
            }
        };
        if !advance {
            break;
        }
        let seq = batch.last_seq;
        if let Some(h) = handles.take() {
            match tokio::task::spawn_blocking(move || {
                let saved = h.cursor.set(seq);
                (h, saved)
            })
            .await
            {
                Ok((h, Ok(()))) => handles = Some(h),
                // The next poll reopens the store and sends the batch again from the saved position: at least
                // once, never lost.
                Ok((_, Err(e))) if e.is_busy() => {
                    tracing::debug!(sink = %name, error = %e, "Store busy; export cursor not saved")
                }
                Ok((_, Err(e))) => ctx.metrics.store_error(&e),
                Err(_) => break,
            }
        }
        // Caught up: let the next batch gather (see IDLE_POLL). A stop request ends the wait at once.
        if !batch.full && deadline.is_none() {
            sleep_or_stop(&stop, IDLE_POLL, deadline).await;
        }
    }
}

/// Count a retry and wait for it: the server's delay if it gave one, else jittered backoff. False when the
/// shutdown deadline is over.
async fn wait_to_retry(
    ctx: &SinkContext,
    attempt: &mut u32,
    retry_after: Option<Duration>,
    stop: &CancellationToken,
    deadline: Option<Instant>,
) -> bool {
    ctx.metrics.export_retries.inc();
    let wait = retry_after
        .unwrap_or_else(|| backoff(&ctx.config, *attempt))
        .max(Duration::from_millis(10));
    *attempt += 1;
    sleep_or_stop(stop, wait, deadline).await
}

/// Sleep unless the flush deadline passes first; false when the deadline is over.
async fn sleep_or_stop(stop: &CancellationToken, d: Duration, deadline: Option<Instant>) -> bool {
    let d = match deadline {
        Some(dl) => d.min(dl.saturating_duration_since(Instant::now())),
        None => d,
    };
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.cancelled(), if deadline.is_none() => {}
    }
    deadline.is_none_or(|dl| Instant::now() < dl)
}
