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
    last_failure: Option<std::time::Instant>,
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
        s.last_failure = Some(now);
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

    /// A success that ends the episode only once no failure has been seen for the interval: for failures
    /// that flap (accept under descriptor exhaustion succeeds and fails in turn), where ending the episode at
    /// every success would log every flap.
    pub fn success_if_settled(&self) -> Option<u64> {
        self.success_if_settled_at(std::time::Instant::now())
    }

    pub fn success_if_settled_at(&self, now: std::time::Instant) -> Option<u64> {
        let recent = self
            .state
            .lock()
            .ok()?
            .last_failure
            .is_some_and(|t| now.duration_since(t) < self.interval);
        if recent { None } else { self.success() }
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
    /// Conversations capture lost an exchange of (each counted once; see `capture::conversation`).
    pub capture_dropped_trajectories: Counter,
    pub capture_truncated: Counter,
    /// Gauge: captured bytes waiting for the pipeline, and decoded bodies waiting for the store (see `capture::budget`).
    pub capture_queue_bytes: Counter,
    /// Gauge: spilled record bytes not yet handed to the pipeline (see `capture::spill`).
    pub capture_spill_bytes: Counter,
    pub capture_spilled: Counter,
    pub capture_spill_errors: Counter,
    /// Milliseconds the pipeline waited for the data path (see `background::deferral`).
    pub pipeline_deferred_ms: Counter,
    logged_spill_error: Once,
    pub processed: Counter,
    pub process_errors: Counter,
    pub steps_derived: Counter,
    /// Gauge: trajectories the deriver holds open (see `derive::MAX_OPEN_TRAJECTORIES`).
    pub derive_open_trajectories: Counter,
    pub stored: Counter,
    /// Gauge: records handed to the store writer and not yet committed (nor given up or quarantined).
    pub store_pending: Counter,
    /// WAL checkpoint passes that copied pages, by the checkpoint thread (`store::checkpoint`).
    pub store_checkpoints: Counter,
    pub store_errors: Counter,
    /// Batch writes retried after a transient error (busy, full disk, I/O), the batch kept (`store::write`).
    pub store_retries: Counter,
    /// Records that failed to write on their own, set aside in the quarantine table (`store::write`).
    pub store_quarantined: Counter,
    pub store_dropped: Counter,
    pub evicted: Counter,
    pub evicted_unexported: Counter,
    pub exported: Counter,
    /// Gauge: the export log's last committed seq, kept by the store writer (sinks' lag is measured from it).
    pub export_head: Counter,
    pub export_retries: Counter,
    pub export_failed: Counter,
    pub capture_over_budget: Counter,
    pub accept_errors: Counter,
    pub connections_at_limit: Counter,
    /// Connections closed because the client stopped sending a request body / taking a response body.
    pub body_read_timeouts: Counter,
    pub send_timeouts: Counter,
    logged_over_budget: Once,
    /// Gauge: open gRPC API streams (Subscribe and Export).
    pub api_streams: Counter,
    pub api_streams_rejected: Counter,
    pub api_streams_stalled: Counter,
    pub api_unauthenticated: Counter,
    pub api_errors: Counter,
    /// Per-sink lag, pause state and last error; `llmtap_export_lag` is the slowest sink's lag.
    pub sinks: SinkRegistry,
    /// Dollars spent and calls without a known cost, by model.
    pub costs: CostByModel,
    logged_drop: Once,
    logged_process_error: Once,
    /// Store write failures come in episodes (a full disk): see [`Metrics::store_error`].
    store_episode: EpisodeLog,
    /// Forward-proxy mode (`proxy::intercept`): CONNECT tunnels (and plain-HTTP proxy requests) decrypted,
    /// relayed blind, refused or failed.
    pub forward_intercepted: Counter,
    pub forward_blind: Counter,
    pub forward_blind_bytes: Counter,
    pub forward_refused: Counter,
    pub forward_connect_errors: Counter,
    pub forward_handshake_failures: Counter,
}

impl Metrics {
    /// A tap stopped keeping a body because captured bytes in memory reached `capture.queue_bytes`.
    pub fn capture_over_budget(&self) {
        self.capture_over_budget.inc();
        if self.logged_over_budget.first() {
            tracing::warn!(
                "Captured bytes in memory reached capture.queue_bytes; cutting captures (traffic unaffected, counted in llmtap_capture_over_budget_total)"
            );
        }
    }

    pub fn capture_dropped(&self) {
        self.capture_dropped.inc();
        if self.logged_drop.first() {
            tracing::warn!(
                "Capture queue full or closed; dropping exchanges from capture (traffic unaffected, counted in llmtap_capture_dropped_total)"
            );
        }
    }

    /// The spill could not write or read a record (a full disk, a torn tail after a crash): counted, logged once.
    pub fn capture_spill_error(&self, error: &dyn std::fmt::Display) {
        self.capture_spill_errors.inc();
        if self.logged_spill_error.first() {
            tracing::warn!(%error, "Capture spill error; further errors are only counted (llmtap_capture_spill_errors_total)");
        }
    }

    pub fn process_error(&self, error: &dyn std::fmt::Display) {
        self.process_errors.inc();
        if self.logged_process_error.first() {
            tracing::warn!(%error, "Could not process a captured exchange; further errors are only counted");
        }
    }

    /// A failed store write: the first of an episode is logged in full, then a summary at most once a minute
    /// while it lasts. The episode ends at the next successful commit ([`Metrics::store_ok`]), so a disk that
    /// fills again an hour later is logged again.
    pub fn store_error(&self, error: &dyn std::fmt::Display) {
        self.store_errors.inc();
        match self.store_episode.failure() {
            EpisodeReport::First => tracing::error!(
                %error,
                "Store write failed (counted in llmtap_store_errors_total, summarised once a minute); a transient \
                 error is retried with the records kept, a record that fails on its own goes to the quarantine \
                 table"
            ),
            EpisodeReport::Summary { count } => {
                tracing::error!(%error, failed = count, "Store writes still failing ({count} more since the last report)")
            }
            EpisodeReport::Quiet => {}
        }
    }

    /// A store commit succeeded: ends a failure episode, if one was under way.
    pub fn store_ok(&self) {
        if let Some(unreported) = self.store_episode.success() {
            tracing::warn!(
                unreported,
                "Store writes succeed again ({unreported} failures since the last report)"
            );
        }
    }

    /// (name, help, value) for every counter, in a stable order.
    pub fn snapshot(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            (
                "llmtap_forward_intercepted_total",
                "CONNECT tunnels and plain-HTTP proxy requests to intercept-list hosts, decrypted (tunnels) and captured.",
                self.forward_intercepted.get(),
            ),
            (
                "llmtap_forward_blind_total",
                "CONNECT tunnels and plain-HTTP proxy requests to other hosts, relayed without decrypting or capturing.",
                self.forward_blind.get(),
            ),
            (
                "llmtap_forward_blind_bytes_total",
                "Bytes relayed through blind CONNECT tunnels (both directions).",
                self.forward_blind_bytes.get(),
            ),
            (
                "llmtap_forward_refused_total",
                "Proxy requests (CONNECT or plain HTTP) refused (malformed target, or no valid token beyond loopback).",
                self.forward_refused.get(),
            ),
            (
                "llmtap_forward_connect_errors_total",
                "Blind CONNECT tunnels whose target could not be reached (answered 502).",
                self.forward_connect_errors.get(),
            ),
            (
                "llmtap_forward_handshake_failures_total",
                "Intercepted tunnels whose client refused llmtap's certificate or broke the TLS handshake.",
                self.forward_handshake_failures.get(),
            ),
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
                "llmtap_capture_dropped_trajectories_total",
                "Conversations dropped from capture: from their first dropped exchange on, their later exchanges are dropped too (no trajectory is stored with holes).",
                self.capture_dropped_trajectories.get(),
            ),
            (
                "llmtap_capture_queue_bytes",
                "Captured body and header bytes held in memory (exchanges in flight and waiting for the pipeline), and the bodies decoded from them waiting for the store writer.",
                self.capture_queue_bytes.get(),
            ),
            (
                "llmtap_capture_spill_bytes",
                "Captured exchanges waiting on disk for the pipeline (capture.spill_bytes), in record bytes.",
                self.capture_spill_bytes.get(),
            ),
            (
                "llmtap_capture_spilled_total",
                "Exchanges written to the capture spill because the pipeline was behind.",
                self.capture_spilled.get(),
            ),
            (
                "llmtap_capture_spill_errors_total",
                "Spill records that could not be written or read back (a full disk, a torn record after a crash).",
                self.capture_spill_errors.get(),
            ),
            (
                "llmtap_pipeline_deferred_milliseconds_total",
                "Time the pipeline left captured exchanges in the spill because the proxy needed the machine's CPU.",
                self.pipeline_deferred_ms.get(),
            ),
            (
                "llmtap_capture_truncated_total",
                "Exchanges captured only in part: a body over the capture cap (on the wire or decoded), or capture memory spent.",
                self.capture_truncated.get(),
            ),
            (
                "llmtap_accept_errors_total",
                "Failed accepts on the proxy listener (e.g. out of file descriptors).",
                self.accept_errors.get(),
            ),
            (
                "llmtap_connections_at_limit_total",
                "Times the proxy stopped accepting because server.max_connections connections were open.",
                self.connections_at_limit.get(),
            ),
            (
                "llmtap_body_read_timeouts_total",
                "Connections closed because the client sent nothing of a request body for server.body_read_timeout_secs.",
                self.body_read_timeouts.get(),
            ),
            (
                "llmtap_send_timeouts_total",
                "Connections closed because the client took nothing of a response body for server.send_timeout_secs.",
                self.send_timeouts.get(),
            ),
            (
                "llmtap_capture_over_budget_total",
                "Bodies whose capture was cut because captured bytes in memory reached capture.queue_bytes.",
                self.capture_over_budget.get(),
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
                "llmtap_derive_open_trajectories",
                "Trajectories held open by derivation, waiting for their next call (closed after derive.idle_timeout_secs without one, or beyond 10,000 open, least recently seen first).",
                self.derive_open_trajectories.get(),
            ),
            (
                "llmtap_stored_total",
                "Records written to the store.",
                self.stored.get(),
            ),
            (
                "llmtap_store_pending_records",
                "Records handed to the store writer and not yet committed (an exchange is counted in llmtap_processed_total once its records are here).",
                self.store_pending.get(),
            ),
            (
                "llmtap_store_checkpoints_total",
                "WAL checkpoint passes of the store's checkpoint thread that copied pages into the database file.",
                self.store_checkpoints.get(),
            ),
            (
                "llmtap_store_errors_total",
                "Failed store writes.",
                self.store_errors.get(),
            ),
            (
                "llmtap_store_retries_total",
                "Store batch writes retried after a transient error (busy, full disk, I/O); the batch is kept.",
                self.store_retries.get(),
            ),
            (
                "llmtap_store_quarantined_total",
                "Records that failed to write on their own, kept in the store's quarantine table instead.",
                self.store_quarantined.get(),
            ),
            (
                "llmtap_store_dropped_total",
                "Records dropped because the store queue was closed, or still unwritten when a store that kept failing was given up at shutdown.",
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
                "Store records not yet exported by the slowest sink: the store's last committed export-log entry minus the sink's cursor, as of this read.",
                self.sinks.max_lag(self.export_head.get()),
            ),
            (
                "llmtap_api_streams",
                "Open gRPC API streams (Subscribe and Export).",
                self.api_streams.get(),
            ),
            (
                "llmtap_api_streams_rejected_total",
                "gRPC API streams refused with RESOURCE_EXHAUSTED ([api] max_streams open already).",
                self.api_streams_rejected.get(),
            ),
            (
                "llmtap_api_streams_stalled_total",
                "gRPC API streams dropped because their client took nothing for [api] stall_timeout_secs.",
                self.api_streams_stalled.get(),
            ),
            (
                "llmtap_api_unauthenticated_total",
                "gRPC API calls refused with UNAUTHENTICATED (missing or wrong bearer token).",
                self.api_unauthenticated.get(),
            ),
            (
                "llmtap_api_errors_total",
                "gRPC API calls that failed inside llmtap (store read errors).",
                self.api_errors.get(),
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
                self.sinks.render_lag(&mut out, self.export_head.get());
            }
        }
        self.sinks.render_state(&mut out);
        self.costs.render(&mut out);
        out
    }
}

/// `llmtap_cost_usd_total{model}` and `llmtap_cost_unknown_calls_total{model}`: what the priced calls cost and
/// how many calls had no known cost, per model as the response named it. Sums are exact decimals (rendered in
/// full), not floats that drift as millions of tiny amounts are added.
#[derive(Debug, Default)]
pub struct CostByModel(std::sync::Mutex<std::collections::BTreeMap<String, ModelCost>>);

#[derive(Debug, Default, Clone, Copy)]
struct ModelCost {
    usd: rust_decimal::Decimal,
    priced: u64,
    unknown: u64,
}

/// Distinct model labels kept; further models are counted under `model="other"` so a misbehaving upstream
/// naming a new model per response cannot grow `/metrics` without bound.
const MAX_COST_MODELS: usize = 256;

impl CostByModel {
    /// One priced call (`usd` its total) or, with `None`, one call whose cost is unknown.
    pub fn record(&self, model: &str, usd: Option<rust_decimal::Decimal>) {
        let Ok(mut all) = self.0.lock() else { return };
        let key = if all.contains_key(model) || all.len() < MAX_COST_MODELS {
            model
        } else {
            "other"
        };
        let entry = all.entry(key.to_owned()).or_default();
        match usd.and_then(|d| entry.usd.checked_add(d)) {
            Some(sum) => {
                entry.usd = sum;
                entry.priced += 1;
            }
            None => entry.unknown += 1,
        }
    }

    fn render(&self, out: &mut String) {
        let all = match self.0.lock() {
            Ok(all) => all.clone(),
            Err(_) => return,
        };
        out.push_str(
            "# HELP llmtap_cost_usd_total US dollars spent on calls with a known cost, by model (prices: genai-prices data embedded at build time, or [cost] prices_file).\n# TYPE llmtap_cost_usd_total counter\n",
        );
        for (model, c) in all.iter().filter(|(_, c)| c.priced > 0) {
            out.push_str(&format!(
                "llmtap_cost_usd_total{{model=\"{}\"}} {}\n",
                label(model),
                c.usd.normalize()
            ));
        }
        out.push_str(
            "# HELP llmtap_cost_unknown_calls_total LLM calls whose cost is unknown (no price for the model, or no usage reported), by model.\n# TYPE llmtap_cost_unknown_calls_total counter\n",
        );
        for (model, c) in all.iter().filter(|(_, c)| c.unknown > 0) {
            out.push_str(&format!(
                "llmtap_cost_unknown_calls_total{{model=\"{}\"}} {}\n",
                label(model),
                c.unknown
            ));
        }
    }
}

/// One export destination's live state, written by its driver and read by `/metrics`.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// The export-log seq this sink has delivered up to (its cursor) plus one; 0 until the driver read it.
    /// Its lag is computed from this and the writer's head when it is read (see [`SinkStats::lag`]), so it is
    /// exact even while the driver waits out a retry.
    position: Counter,
    /// Gauge: 1 while the sink is paused (the destination refused our credentials), else 0.
    pub paused: Counter,
    /// The error that is holding the sink back, cleared by the next accepted batch.
    last_error: std::sync::Mutex<Option<String>>,
}

impl SinkStats {
    /// The sink's cursor as the store holds it.
    pub fn set_cursor(&self, seq: i64) {
        self.position.set(seq.max(0) as u64 + 1);
    }

    /// Export-log entries after this sink's cursor, `head` being the last one committed (0 before the sink
    /// read its cursor).
    pub fn lag(&self, head: u64) -> u64 {
        match self.position.get() {
            0 => 0,
            p => head.saturating_sub(p - 1),
        }
    }

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
    pub fn max_lag(&self, head: u64) -> u64 {
        self.each().iter().map(|(_, s)| s.lag(head)).max().unwrap_or(0)
    }

    fn render_lag(&self, out: &mut String, head: u64) {
        for (name, s) in self.each() {
            out.push_str(&format!(
                "llmtap_export_lag{{sink=\"{}\"}} {}\n",
                label(&name),
                s.lag(head)
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

/// Logs go to stderr; `RUST_LOG` overrides the default `info` level. Text is coloured only when stderr is a
/// terminal and `NO_COLOR` is unset or empty (https://no-color.org): a log written to a file or a pipe, or read
/// by a log shipper, must not carry escape codes. JSON is one object per line, the event's fields (`message`
/// among them) beside `timestamp` and `level`.
pub fn init_logging(format: crate::config::LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match format {
        crate::config::LogFormat::Text => builder.with_ansi(stderr_wants_color()).try_init(),
        crate::config::LogFormat::Json => {
            let installed = builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_ansi(false)
                .try_init();
            JSON_LOGS.store(installed.is_ok(), Ordering::Relaxed);
            installed
        }
    };
}

/// Set once the log is JSON: the error that ends the process is then one more JSON event (see
/// [`logs_as_json`]), so that a log shipper can parse every line of stderr.
static JSON_LOGS: AtomicBool = AtomicBool::new(false);

/// Whether the log is JSON (`log_format = "json"`, set by `serve`).
pub fn logs_as_json() -> bool {
    JSON_LOGS.load(Ordering::Relaxed)
}

fn stderr_wants_color() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
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

    #[test]
    fn a_flapping_failure_is_one_episode_until_it_has_settled() {
        let log = EpisodeLog::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(log.failure_at(t0), EpisodeReport::First);
        assert_eq!(log.success_if_settled_at(t0 + Duration::from_secs(1)), None);
        assert_eq!(log.failure_at(t0 + Duration::from_secs(2)), EpisodeReport::Quiet);
        assert_eq!(log.success_if_settled_at(t0 + Duration::from_secs(63)), Some(1));
        assert_eq!(log.failure_at(t0 + Duration::from_secs(64)), EpisodeReport::First);
    }
}
