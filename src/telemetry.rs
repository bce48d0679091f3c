//! Self-observability: logging setup and llmtap's own counters.
//!
//! Every failure after the data path is counted here and logged the first time it happens (then only counted),
//! so a broken sink cannot flood the log. Counters are plain atomics: cheap enough for the data path (per-thread
//! slots for the few a worker changes on every exchange, and a per-thread batched budget gauge, were measured in
//! forward mode's saturated capture-on rounds: no less CPU per exchange, within noise or worse). What they
//! are called and how they are reported lives in [`instruments`]; [`sdk`] puts them on the OpenTelemetry
//! metrics SDK (OTLP export), [`exposition`] writes `/metrics` from the same instruments.

pub mod exposition;
pub mod instruments;
mod process;
pub mod sdk;

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
    /// Gauge: `capture.queue_bytes`, the budget `capture_queue_bytes` is held under.
    pub capture_queue_capacity: Counter,
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
    /// Gauge: steps stored and not yet in the search index (`store::search::index`).
    pub search_pending_steps: Counter,
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
    /// WebSocket sockets relayed (base-URL mode and intercepted tunnels), and, as a gauge, those open now.
    pub websockets: Counter,
    pub websockets_open: Counter,
    /// Pushes of llmtap's own metrics to `[telemetry] otlp_endpoint` that failed.
    pub telemetry_export_failures: Counter,
    /// The synchronous instruments, once [`sdk::install`] ran (else recording is a no-op: unit tests, benches).
    recorded: std::sync::OnceLock<sdk::Recorded>,
    /// `/metrics`, once [`sdk::install`] ran.
    exposition: std::sync::OnceLock<exposition::Exposition>,
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

    /// A captured exchange, as the pipeline takes it: counted and timed by upstream (route name). Off the data
    /// path: the duration is the capture's own timestamps.
    pub fn record_exchange(&self, upstream: &str, failed: bool, seconds: f64) {
        if let Some(r) = self.recorded.get() {
            r.exchange(upstream, failed, seconds);
        }
    }

    /// A store batch written and committed in `seconds`.
    pub fn record_commit(&self, seconds: f64) {
        if let Some(r) = self.recorded.get() {
            r.commit(seconds);
        }
    }

    /// The Prometheus text exposition of every instrument (empty before [`sdk::install`]).
    pub fn render_prometheus(&self) -> String {
        self.exposition.get().map(|e| e.render()).unwrap_or_default()
    }

    /// One collection of every instrument (empty before [`sdk::install`]): what `/metrics` shows.
    pub fn families(&self) -> Vec<exposition::Family> {
        self.exposition.get().map(|e| e.families()).unwrap_or_default()
    }

    /// `llmtap_export_lag`: the slowest sink's lag without attributes, then each sink's.
    fn observe_export_lag(&self, out: &mut Vec<instruments::Point>) {
        let head = self.export_head.get();
        out.push(instruments::Point {
            value: instruments::Value::U64(self.sinks.max_lag(head)),
            attributes: Vec::new(),
        });
        self.sinks.observe(out, "sink", |s| Some(s.lag(head)));
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

    fn each(&self) -> Vec<(String, ModelCost)> {
        self.0
            .lock()
            .map(|all| all.iter().map(|(m, c)| (m.clone(), *c)).collect())
            .unwrap_or_default()
    }

    /// `llmtap_cost_usd{model}`: models with at least one priced call. Summed as exact decimals, handed over as
    /// the nearest float.
    fn observe_usd(&self, out: &mut Vec<instruments::Point>) {
        use rust_decimal::prelude::ToPrimitive as _;
        for (model, c) in self.each().into_iter().filter(|(_, c)| c.priced > 0) {
            out.push(instruments::Point {
                value: instruments::Value::F64(c.usd.normalize().to_f64().unwrap_or(0.0)),
                attributes: vec![opentelemetry::KeyValue::new("model", model)],
            });
        }
    }

    /// `llmtap_cost_unknown_calls{model}`: models with at least one call of unknown cost.
    fn observe_unknown(&self, out: &mut Vec<instruments::Point>) {
        for (model, c) in self.each().into_iter().filter(|(_, c)| c.unknown > 0) {
            out.push(instruments::Point {
                value: instruments::Value::U64(c.unknown),
                attributes: vec![opentelemetry::KeyValue::new("model", model)],
            });
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
    /// Items the destination accepted.
    pub sent: Counter,
    /// Items given up on (rejected; OTLP forbids retrying a rejection).
    pub send_failed: Counter,
    /// Send attempts that failed, whatever came of them.
    pub failures: Counter,
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

    /// One point per sink, `key` naming it, with the value `read` gives (none: no point).
    fn observe(&self, out: &mut Vec<instruments::Point>, key: &'static str, read: impl Fn(&SinkStats) -> Option<u64>) {
        for (name, s) in self.each() {
            if let Some(v) = read(&s) {
                out.push(instruments::Point {
                    value: instruments::Value::U64(v),
                    attributes: vec![opentelemetry::KeyValue::new(key, name)],
                });
            }
        }
    }

    /// `llmtap_export_last_error{sink, error}` = 1 for each sink held back by an error.
    fn observe_last_error(&self, out: &mut Vec<instruments::Point>) {
        for (name, s) in self.each() {
            if let Some(e) = s.last_error() {
                out.push(instruments::Point {
                    value: instruments::Value::U64(1),
                    attributes: vec![
                        opentelemetry::KeyValue::new("sink", name),
                        opentelemetry::KeyValue::new("error", e),
                    ],
                });
            }
        }
    }
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

/// An error with its causes, outermost first: "connect error: Connection refused (os error 111)" rather than
/// hyper's terse top-level message.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
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
