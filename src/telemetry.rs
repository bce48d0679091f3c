//! Self-observability: logging setup and llmtap's own counters.
//!
//! Every failure after the data path is counted here and logged the first time it happens (then only counted),
//! so a broken sink cannot flood the log. Counters are plain atomics: cheap enough for the data path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn set(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Add and return the value before (a gauge used as a budget).
    pub fn fetch_add(&self, n: u64) -> u64 {
        self.0.fetch_add(n, Ordering::Relaxed)
    }
    /// For gauges only.
    pub fn sub(&self, n: u64) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A flag that is true only the first time it is taken: "log once".
#[derive(Debug, Default)]
pub struct Once(AtomicBool);

impl Once {
    pub fn first(&self) -> bool {
        !self.0.swap(true, Ordering::Relaxed)
    }
}

/// "Log the first of each episode and a periodic summary": a failure that repeats (a full disk, a sink that
/// rejects every batch) is logged when it starts, then summarised at most once per `interval` while it lasts,
/// and logged again when it comes back after a success. A process-wide "log once" hid a second episode an hour
/// later; logging every failure flooded the log.
#[derive(Debug)]
pub struct EpisodeLog {
    interval: std::time::Duration,
    state: std::sync::Mutex<EpisodeState>,
}

#[derive(Debug, Default)]
struct EpisodeState {
    /// Failures since the episode began that were not logged individually.
    quiet: u64,
    /// When the episode began or was last summarised; `None` outside an episode.
    since: Option<std::time::Instant>,
}

/// What the caller should log for a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpisodeReport {
    /// The first failure of an episode: log it in full.
    First,
    /// The summary is due: `count` more failures happened since the last line.
    Summary { count: u64 },
    /// Count it only.
    Quiet,
}

impl Default for EpisodeLog {
    fn default() -> Self {
        EpisodeLog::new(std::time::Duration::from_secs(60))
    }
}

impl EpisodeLog {
    pub fn new(interval: std::time::Duration) -> EpisodeLog {
        EpisodeLog {
            interval,
            state: std::sync::Mutex::new(EpisodeState::default()),
        }
    }

    pub fn failure(&self) -> EpisodeReport {
        self.failure_at(std::time::Instant::now())
    }

    pub fn failure_at(&self, now: std::time::Instant) -> EpisodeReport {
        let Ok(mut s) = self.state.lock() else {
            return EpisodeReport::Quiet;
        };
        match s.since {
            None => {
                s.since = Some(now);
                s.quiet = 0;
                EpisodeReport::First
            }
            Some(since) => {
                s.quiet += 1;
                if now.duration_since(since) >= self.interval {
                    let count = std::mem::take(&mut s.quiet);
                    s.since = Some(now);
                    EpisodeReport::Summary { count }
                } else {
                    EpisodeReport::Quiet
                }
            }
        }
    }

    /// The episode (if any) is over. Returns the failures not yet reported, so the caller can log the end.
    pub fn success(&self) -> Option<u64> {
        let mut s = self.state.lock().ok()?;
        s.since.take()?;
        Some(std::mem::take(&mut s.quiet))
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: Counter,
    pub requests_unrouted: Counter,
    pub upstream_errors: Counter,
    pub client_gone: Counter,
    pub captured: Counter,
    pub capture_dropped: Counter,
    pub capture_truncated: Counter,
    /// Gauge: captured bytes waiting for the pipeline (see `capture::queue`).
    pub capture_queue_bytes: Counter,
    pub processed: Counter,
    pub process_errors: Counter,
    pub steps_derived: Counter,
    pub stored: Counter,
    pub store_errors: Counter,
    pub store_dropped: Counter,
    pub evicted: Counter,
    pub evicted_unexported: Counter,
    pub exported: Counter,
    pub export_retries: Counter,
    pub export_failed: Counter,
    /// Per-sink lag, pause state and last error; `llmtap_export_lag` is the slowest sink's lag.
    pub sinks: SinkRegistry,
    logged_drop: Once,
    logged_process_error: Once,
    logged_store_error: Once,
}

impl Metrics {
    pub fn capture_dropped(&self) {
        self.capture_dropped.inc();
        if self.logged_drop.first() {
            tracing::warn!(
                "Capture queue full or closed; dropping exchanges from capture (traffic unaffected, counted in llmtap_capture_dropped_total)"
            );
        }
    }

    pub fn process_error(&self, error: &dyn std::fmt::Display) {
        self.process_errors.inc();
        if self.logged_process_error.first() {
            tracing::warn!(%error, "Could not process a captured exchange; further errors are only counted");
        }
    }

    pub fn store_error(&self, error: &dyn std::fmt::Display) {
        self.store_errors.inc();
        if self.logged_store_error.first() {
            tracing::error!(%error, "Store write failed; further errors are only counted");
        }
    }

    /// (name, help, value) for every counter, in a stable order.
    pub fn snapshot(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            (
                "llmtap_requests_total",
                "Requests received on a configured route.",
                self.requests.get(),
            ),
            (
                "llmtap_requests_unrouted_total",
                "Requests refused with 404 (no such upstream).",
                self.requests_unrouted.get(),
            ),
            (
                "llmtap_upstream_errors_total",
                "Exchanges whose upstream failed or could not be reached.",
                self.upstream_errors.get(),
            ),
            (
                "llmtap_client_gone_total",
                "Exchanges the client abandoned mid-response.",
                self.client_gone.get(),
            ),
            (
                "llmtap_captured_total",
                "Exchanges handed to the capture pipeline.",
                self.captured.get(),
            ),
            (
                "llmtap_capture_dropped_total",
                "Exchanges not captured because the queue was full (by count or by bytes).",
                self.capture_dropped.get(),
            ),
            (
                "llmtap_capture_queue_bytes",
                "Captured body and header bytes waiting for the pipeline.",
                self.capture_queue_bytes.get(),
            ),
            (
                "llmtap_capture_truncated_total",
                "Exchanges whose body exceeded the capture cap.",
                self.capture_truncated.get(),
            ),
            (
                "llmtap_processed_total",
                "Exchanges turned into provider traces.",
                self.processed.get(),
            ),
            (
                "llmtap_process_errors_total",
                "Captured exchanges that could not be parsed (trace kept raw).",
                self.process_errors.get(),
            ),
            (
                "llmtap_steps_derived_total",
                "Agent steps derived.",
                self.steps_derived.get(),
            ),
            (
                "llmtap_stored_total",
                "Records written to the store.",
                self.stored.get(),
            ),
            (
                "llmtap_store_errors_total",
                "Failed store writes.",
                self.store_errors.get(),
            ),
            (
                "llmtap_store_dropped_total",
                "Records dropped because the store queue was full.",
                self.store_dropped.get(),
            ),
            (
                "llmtap_evicted_total",
                "Traces removed by retention.",
                self.evicted.get(),
            ),
            (
                "llmtap_evicted_unexported_total",
                "Traces removed by retention before every sink exported them.",
                self.evicted_unexported.get(),
            ),
            (
                "llmtap_exported_total",
                "Spans accepted by remote sinks.",
                self.exported.get(),
            ),
            (
                "llmtap_export_retries_total",
                "Export attempts retried.",
                self.export_retries.get(),
            ),
            (
                "llmtap_export_failed_total",
                "Spans dropped after a permanent export failure.",
                self.export_failed.get(),
            ),
            (
                "llmtap_export_lag",
                "Store records not yet exported by the slowest sink.",
                self.sinks.max_lag(),
            ),
        ]
    }

    /// Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        for (name, help, value) in self.snapshot() {
            let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
            // A family's samples stay together: the per-sink lag follows the aggregate.
            if name == "llmtap_export_lag" {
                self.sinks.render_lag(&mut out);
            }
        }
        self.sinks.render_state(&mut out);
        out
    }
}

/// One export destination's live state, written by its driver and read by `/metrics`.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Gauge: export-log entries this sink has not yet delivered.
    pub lag: Counter,
    /// Gauge: 1 while the sink is paused (the destination refused our credentials), else 0.
    pub paused: Counter,
    /// The error that is holding the sink back, cleared by the next accepted batch.
    last_error: std::sync::Mutex<Option<String>>,
}

impl SinkStats {
    pub fn set_error(&self, error: &str) {
        // Bounded: a label value, not a log line.
        let short: String = error.chars().take(120).collect();
        if let Ok(mut e) = self.last_error.lock() {
            *e = Some(short);
        }
    }

    pub fn clear_error(&self) {
        if let Ok(mut e) = self.last_error.lock() {
            *e = None;
        }
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }
}

/// Every export destination's [`SinkStats`], by sink name, in registration order.
#[derive(Debug, Default)]
pub struct SinkRegistry(std::sync::Mutex<Vec<(String, std::sync::Arc<SinkStats>)>>);

impl SinkRegistry {
    /// The stats of sink `name` (registered on first use; a name is registered once).
    pub fn register(&self, name: &str) -> std::sync::Arc<SinkStats> {
        let Ok(mut all) = self.0.lock() else {
            return std::sync::Arc::default();
        };
        if let Some((_, s)) = all.iter().find(|(n, _)| n == name) {
            return s.clone();
        }
        let stats = std::sync::Arc::new(SinkStats::default());
        all.push((name.to_owned(), stats.clone()));
        stats
    }

    fn each(&self) -> Vec<(String, std::sync::Arc<SinkStats>)> {
        self.0.lock().map(|all| all.clone()).unwrap_or_default()
    }

    /// The slowest sink's lag: what `llmtap_export_lag` has always documented.
    pub fn max_lag(&self) -> u64 {
        self.each().iter().map(|(_, s)| s.lag.get()).max().unwrap_or(0)
    }

    fn render_lag(&self, out: &mut String) {
        for (name, s) in self.each() {
            out.push_str(&format!(
                "llmtap_export_lag{{sink=\"{}\"}} {}\n",
                label(&name),
                s.lag.get()
            ));
        }
    }

    fn render_state(&self, out: &mut String) {
        let all = self.each();
        if all.is_empty() {
            return;
        }
        out.push_str(
            "# HELP llmtap_export_paused 1 while a sink is paused because the destination refused our credentials (401/403); it is probed again every retry_max.\n# TYPE llmtap_export_paused gauge\n",
        );
        for (name, s) in &all {
            out.push_str(&format!(
                "llmtap_export_paused{{sink=\"{}\"}} {}\n",
                label(name),
                s.paused.get()
            ));
        }
        out.push_str(
            "# HELP llmtap_export_last_error The error holding a sink back (until a batch is accepted).\n# TYPE llmtap_export_last_error gauge\n",
        );
        for (name, s) in &all {
            if let Some(e) = s.last_error() {
                out.push_str(&format!(
                    "llmtap_export_last_error{{sink=\"{}\",error=\"{}\"}} 1\n",
                    label(name),
                    label(&e)
                ));
            }
        }
    }
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Logs go to stderr; `RUST_LOG` overrides the default `info` level.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

#[cfg(test)]
mod episode_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn first_failure_then_one_summary_per_interval_then_again_after_a_success() {
        let log = EpisodeLog::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(log.failure_at(t0), EpisodeReport::First);
        assert_eq!(log.failure_at(t0 + Duration::from_secs(1)), EpisodeReport::Quiet);
        assert_eq!(log.failure_at(t0 + Duration::from_secs(2)), EpisodeReport::Quiet);
        assert_eq!(
            log.failure_at(t0 + Duration::from_secs(61)),
            EpisodeReport::Summary { count: 3 }
        );
        assert_eq!(log.failure_at(t0 + Duration::from_secs(62)), EpisodeReport::Quiet);
        assert_eq!(log.success(), Some(1));
        assert_eq!(log.success(), None, "no episode to end");
        assert_eq!(log.failure_at(t0 + Duration::from_secs(3600)), EpisodeReport::First);
    }
}
