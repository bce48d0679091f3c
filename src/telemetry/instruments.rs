//! Every metric llmtap reports about itself, declared once: name, kind, unit, attributes, help, and how its value
//! is read. The OpenTelemetry instruments (`telemetry::sdk`), the `/metrics` exposition (`telemetry::exposition`)
//! and the metric list in docs/operations.md are all made from [`INSTRUMENTS`].
//!
//! Names follow the OpenTelemetry Collector's own telemetry (`otelcol_exporter_sent_*`, `otelcol_process_*`)
//! with an `llmtap_` prefix. A counter's name carries no `_total`: the Prometheus exposition adds it, as the
//! Collector's Prometheus endpoint and Prometheus' own OTLP ingestion do.

use opentelemetry::KeyValue;

use super::Metrics;

/// What a metric is, in OpenTelemetry terms (the Prometheus type follows from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic sum: `counter` on /metrics, with `_total` added to the name.
    Counter,
    Gauge,
    /// Explicit-bucket histogram, recorded where the work happens (off the data path).
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One observed value and its attributes.
#[derive(Debug, Clone)]
pub struct Point {
    pub value: Value,
    pub attributes: Vec<KeyValue>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    U64(u64),
    F64(f64),
}

impl Value {
    pub fn as_u64(self) -> u64 {
        match self {
            Value::U64(v) => v,
            Value::F64(v) => v as u64,
        }
    }
    pub fn as_f64(self) -> f64 {
        match self {
            Value::U64(v) => v as f64,
            Value::F64(v) => v,
        }
    }
}

/// How an instrument gets its values.
#[derive(Clone, Copy)]
pub enum Read {
    /// Observed at collection time from one of the hot path's atomics: no cost per request.
    Value(fn(&Metrics) -> u64),
    /// Observed at collection time: several points, each with its attributes.
    Points(fn(&Metrics, &mut Vec<Point>)),
    /// A synchronous instrument recorded off the data path (pipeline, store writer): see [`super::Recorded`].
    Recorded,
}

impl std::fmt::Debug for Read {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Read::Value(_) => "Value",
            Read::Points(_) => "Points",
            Read::Recorded => "Recorded",
        })
    }
}

#[derive(Debug)]
pub struct Instrument {
    /// The OpenTelemetry name (also the Prometheus family name; counters get `_total` on /metrics).
    pub name: &'static str,
    pub kind: Kind,
    /// UCUM, as OTLP carries it.
    pub unit: &'static str,
    /// Whether values are floating point (else integers).
    pub float: bool,
    pub attributes: &'static [&'static str],
    pub help: &'static str,
    pub read: Read,
}

impl Instrument {
    /// The name a Prometheus scrape sees on its samples (histograms add `_bucket`, `_sum` and `_count`).
    pub fn prometheus_name(&self) -> String {
        match self.kind {
            Kind::Counter => format!("{}_total", self.name),
            Kind::Gauge | Kind::Histogram => self.name.to_owned(),
        }
    }

    /// The instrument's current points (empty for a recorded instrument: the SDK holds those).
    pub fn observe(&self, metrics: &Metrics) -> Vec<Point> {
        let mut out = Vec::new();
        match self.read {
            Read::Value(f) => out.push(Point {
                value: Value::U64(f(metrics)),
                attributes: Vec::new(),
            }),
            Read::Points(f) => f(metrics, &mut out),
            Read::Recorded => {}
        }
        out
    }
}

const fn counter(name: &'static str, unit: &'static str, help: &'static str, read: fn(&Metrics) -> u64) -> Instrument {
    Instrument {
        name,
        kind: Kind::Counter,
        unit,
        float: false,
        attributes: &[],
        help,
        read: Read::Value(read),
    }
}

const fn gauge(name: &'static str, unit: &'static str, help: &'static str, read: fn(&Metrics) -> u64) -> Instrument {
    Instrument {
        name,
        kind: Kind::Gauge,
        unit,
        float: false,
        attributes: &[],
        help,
        read: Read::Value(read),
    }
}

/// Bucket bounds of the duration histograms, in seconds: a store commit takes milliseconds, an LLM call up to
/// minutes.
pub const DURATION_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

pub const UPSTREAM_REQUESTS: &str = "llmtap_upstream_requests";
pub const UPSTREAM_FAILED: &str = "llmtap_upstream_failed_requests";
pub const UPSTREAM_DURATION: &str = "llmtap_upstream_duration_seconds";
pub const STORE_COMMIT_DURATION: &str = "llmtap_store_commit_duration_seconds";

/// Every metric, in the order /metrics and the docs list them.
pub static INSTRUMENTS: &[Instrument] = &[
    // The proxy (the data path).
    counter(
        "llmtap_requests",
        "{request}",
        "Requests received on a configured route.",
        |m| m.requests.get(),
    ),
    counter(
        "llmtap_requests_unrouted",
        "{request}",
        "Requests refused with 404 (no such upstream).",
        |m| m.requests_unrouted.get(),
    ),
    counter(
        "llmtap_upstream_errors",
        "{exchange}",
        "Exchanges whose upstream failed or could not be reached.",
        |m| m.upstream_errors.get(),
    ),
    counter(
        "llmtap_client_gone",
        "{exchange}",
        "Exchanges the client abandoned mid-response.",
        |m| m.client_gone.get(),
    ),
    Instrument {
        name: UPSTREAM_REQUESTS,
        kind: Kind::Counter,
        unit: "{exchange}",
        float: false,
        attributes: &["upstream"],
        help: "Captured exchanges by upstream (route name), counted by the pipeline as it takes them.",
        read: Read::Recorded,
    },
    Instrument {
        name: UPSTREAM_FAILED,
        kind: Kind::Counter,
        unit: "{exchange}",
        float: false,
        attributes: &["upstream"],
        help: "Captured exchanges by upstream whose upstream failed, could not be reached, or answered 4xx/5xx.",
        read: Read::Recorded,
    },
    Instrument {
        name: UPSTREAM_DURATION,
        kind: Kind::Histogram,
        unit: "s",
        float: true,
        attributes: &["upstream"],
        help: "Captured exchanges' duration by upstream, from the request head to the response's end, recorded by the pipeline from the capture's timestamps (nothing is timed on the data path).",
        read: Read::Recorded,
    },
    counter(
        "llmtap_accept_errors",
        "{error}",
        "Failed accepts on the proxy listener (e.g. out of file descriptors).",
        |m| m.accept_errors.get(),
    ),
    counter(
        "llmtap_connections_at_limit",
        "{event}",
        "Times the proxy stopped accepting because server.max_connections connections were open.",
        |m| m.connections_at_limit.get(),
    ),
    counter(
        "llmtap_body_read_timeouts",
        "{connection}",
        "Connections closed because the client sent nothing of a request body for server.body_read_timeout_secs.",
        |m| m.body_read_timeouts.get(),
    ),
    counter(
        "llmtap_send_timeouts",
        "{connection}",
        "Connections closed because the client took nothing of a response body for server.send_timeout_secs.",
        |m| m.send_timeouts.get(),
    ),
    counter(
        "llmtap_forward_intercepted",
        "{tunnel}",
        "CONNECT tunnels and plain-HTTP proxy requests to intercept-list hosts, decrypted (tunnels) and captured.",
        |m| m.forward_intercepted.get(),
    ),
    counter(
        "llmtap_forward_blind",
        "{tunnel}",
        "CONNECT tunnels and plain-HTTP proxy requests to other hosts, relayed without decrypting or capturing.",
        |m| m.forward_blind.get(),
    ),
    counter(
        "llmtap_forward_blind_bytes",
        "By",
        "Bytes relayed through blind CONNECT tunnels (both directions).",
        |m| m.forward_blind_bytes.get(),
    ),
    counter(
        "llmtap_forward_refused",
        "{request}",
        "Proxy requests (CONNECT or plain HTTP) refused (malformed target, or no valid token beyond loopback).",
        |m| m.forward_refused.get(),
    ),
    counter(
        "llmtap_forward_connect_errors",
        "{tunnel}",
        "Blind CONNECT tunnels whose target could not be reached (answered 502).",
        |m| m.forward_connect_errors.get(),
    ),
    counter(
        "llmtap_forward_handshake_failures",
        "{tunnel}",
        "Intercepted tunnels whose client refused llmtap's certificate or broke the TLS handshake.",
        |m| m.forward_handshake_failures.get(),
    ),
    counter(
        "llmtap_websockets",
        "{socket}",
        "WebSocket connections relayed after a 101 (base-URL mode and intercepted tunnels).",
        |m| m.websockets.get(),
    ),
    gauge(
        "llmtap_websockets_open",
        "{socket}",
        "WebSocket connections relaying now (each keeps its connection's server.max_connections slot).",
        |m| m.websockets_open.get(),
    ),
    // Capture (the receiver side: accepted, spilled, dropped).
    counter(
        "llmtap_captured",
        "{exchange}",
        "Exchanges accepted by capture (handed to the capture pipeline).",
        |m| m.captured.get(),
    ),
    counter(
        "llmtap_capture_spilled",
        "{exchange}",
        "Exchanges written to the capture spill because the pipeline was behind.",
        |m| m.capture_spilled.get(),
    ),
    counter(
        "llmtap_capture_dropped",
        "{exchange}",
        "Exchanges not captured because the queue was full (by count or by bytes).",
        |m| m.capture_dropped.get(),
    ),
    counter(
        "llmtap_capture_dropped_trajectories",
        "{trajectory}",
        "Conversations dropped from capture: from their first dropped exchange on, their later exchanges are dropped too (no trajectory is stored with holes).",
        |m| m.capture_dropped_trajectories.get(),
    ),
    counter(
        "llmtap_capture_truncated",
        "{exchange}",
        "Exchanges captured only in part: a body over the capture cap (on the wire or decoded), or capture memory spent.",
        |m| m.capture_truncated.get(),
    ),
    counter(
        "llmtap_capture_over_budget",
        "{body}",
        "Bodies whose capture was cut because captured bytes in memory reached capture.queue_bytes.",
        |m| m.capture_over_budget.get(),
    ),
    gauge(
        "llmtap_capture_queue_bytes",
        "By",
        "Captured body and header bytes held in memory (exchanges in flight and waiting for the pipeline), and the bodies decoded from them waiting for the store writer.",
        |m| m.capture_queue_bytes.get(),
    ),
    gauge(
        "llmtap_capture_queue_capacity_bytes",
        "By",
        "The capture memory budget llmtap_capture_queue_bytes is held under (capture.queue_bytes).",
        |m| m.capture_queue_capacity.get(),
    ),
    gauge(
        "llmtap_capture_spill_bytes",
        "By",
        "Captured exchanges waiting on disk for the pipeline (capture.spill_bytes), in record bytes.",
        |m| m.capture_spill_bytes.get(),
    ),
    counter(
        "llmtap_capture_spill_errors",
        "{error}",
        "Spill records that could not be written or read back (a full disk, a torn record after a crash).",
        |m| m.capture_spill_errors.get(),
    ),
    counter(
        "llmtap_pipeline_deferred_milliseconds",
        "ms",
        "Time the pipeline left captured exchanges in the spill because the proxy needed the machine's CPU.",
        |m| m.pipeline_deferred_ms.get(),
    ),
    // Processing and derivation.
    counter(
        "llmtap_processed",
        "{exchange}",
        "Exchanges turned into provider traces.",
        |m| m.processed.get(),
    ),
    counter(
        "llmtap_process_errors",
        "{exchange}",
        "Captured exchanges that could not be parsed (trace kept raw).",
        |m| m.process_errors.get(),
    ),
    counter("llmtap_steps_derived", "{step}", "Agent steps derived.", |m| {
        m.steps_derived.get()
    }),
    gauge(
        "llmtap_derive_open_trajectories",
        "{trajectory}",
        "Trajectories held open by derivation, waiting for their next call (closed after derive.idle_timeout_secs without one, or beyond 10,000 open, least recently seen first).",
        |m| m.derive_open_trajectories.get(),
    ),
    Instrument {
        name: "llmtap_cost_usd",
        kind: Kind::Counter,
        unit: "USD",
        float: true,
        attributes: &["model"],
        help: "US dollars spent on calls with a known cost, by model (prices: genai-prices data embedded at build time, or [cost] prices_file).",
        read: Read::Points(|m, out| m.costs.observe_usd(out)),
    },
    Instrument {
        name: "llmtap_cost_unknown_calls",
        kind: Kind::Counter,
        unit: "{call}",
        float: false,
        attributes: &["model"],
        help: "LLM calls whose cost is unknown (no price for the model, or no usage reported), by model.",
        read: Read::Points(|m, out| m.costs.observe_unknown(out)),
    },
    // The store.
    counter("llmtap_stored", "{record}", "Records written to the store.", |m| {
        m.stored.get()
    }),
    gauge(
        "llmtap_store_pending_records",
        "{record}",
        "Records handed to the store writer and not yet committed (an exchange is counted in llmtap_processed_total once its records are here).",
        |m| m.store_pending.get(),
    ),
    gauge(
        "llmtap_search_pending_steps",
        "{step}",
        "Steps stored and not yet searchable: the search indexer waits while the proxy needs the CPU and catches up afterwards (read about once a second).",
        |m| m.search_pending_steps.get(),
    ),
    Instrument {
        name: STORE_COMMIT_DURATION,
        kind: Kind::Histogram,
        unit: "s",
        float: true,
        attributes: &[],
        help: "Time the store writer took to write and commit one batch (successful commits).",
        read: Read::Recorded,
    },
    counter("llmtap_store_errors", "{error}", "Failed store writes.", |m| {
        m.store_errors.get()
    }),
    counter(
        "llmtap_store_retries",
        "{batch}",
        "Store batch writes retried after a transient error (busy, full disk, I/O); the batch is kept.",
        |m| m.store_retries.get(),
    ),
    counter(
        "llmtap_store_quarantined",
        "{record}",
        "Records that failed to write on their own, kept in the store's quarantine table instead.",
        |m| m.store_quarantined.get(),
    ),
    counter(
        "llmtap_store_dropped",
        "{record}",
        "Records dropped because the store queue was closed, or still unwritten when a store that kept failing was given up at shutdown.",
        |m| m.store_dropped.get(),
    ),
    counter(
        "llmtap_store_checkpoints",
        "{checkpoint}",
        "WAL checkpoint passes of the store's checkpoint thread that copied pages into the database file.",
        |m| m.store_checkpoints.get(),
    ),
    counter("llmtap_evicted", "{trace}", "Traces removed by retention.", |m| {
        m.evicted.get()
    }),
    counter(
        "llmtap_evicted_unexported",
        "{trace}",
        "Traces removed by retention before every sink exported them.",
        |m| m.evicted_unexported.get(),
    ),
    // Export, all sinks together.
    counter(
        "llmtap_exported",
        "{item}",
        "Items (spans) accepted by remote sinks, all sinks together.",
        |m| m.exported.get(),
    ),
    counter("llmtap_export_retries", "{attempt}", "Export attempts retried.", |m| {
        m.export_retries.get()
    }),
    counter(
        "llmtap_export_failed",
        "{item}",
        "Items (spans) dropped after a permanent export failure, all sinks together.",
        |m| m.export_failed.get(),
    ),
    Instrument {
        name: "llmtap_export_lag",
        kind: Kind::Gauge,
        unit: "{record}",
        float: false,
        attributes: &["sink"],
        help: "Store records not yet exported: the store's last committed export-log entry minus a sink's cursor, as of this read. Without attributes: the slowest sink's.",
        read: Read::Points(|m, out| m.observe_export_lag(out)),
    },
    Instrument {
        name: "llmtap_export_paused",
        kind: Kind::Gauge,
        unit: "1",
        float: false,
        attributes: &["sink"],
        help: "1 while a sink is paused because the destination refused our credentials (401/403); it is probed again every retry_max.",
        read: Read::Points(|m, out| m.sinks.observe(out, "sink", |s| Some(s.paused.get()))),
    },
    Instrument {
        name: "llmtap_export_last_error",
        kind: Kind::Gauge,
        unit: "1",
        float: false,
        attributes: &["sink", "error"],
        help: "The error holding a sink back (until a batch is accepted).",
        read: Read::Points(|m, out| m.sinks.observe_last_error(out)),
    },
    // Export, per exporter (the Collector's otelcol_exporter_* set).
    Instrument {
        name: "llmtap_exporter_sent_items",
        kind: Kind::Counter,
        unit: "{item}",
        float: false,
        attributes: &["exporter"],
        help: "Items (spans) an exporter's destination accepted.",
        read: Read::Points(|m, out| m.sinks.observe(out, "exporter", |s| Some(s.sent.get()))),
    },
    Instrument {
        name: "llmtap_exporter_send_failed_items",
        kind: Kind::Counter,
        unit: "{item}",
        float: false,
        attributes: &["exporter"],
        help: "Items (spans) an exporter gave up on: rejected by the destination (OTLP forbids retrying a rejection).",
        read: Read::Points(|m, out| m.sinks.observe(out, "exporter", |s| Some(s.send_failed.get()))),
    },
    Instrument {
        name: "llmtap_exporter_send_failures",
        kind: Kind::Counter,
        unit: "{attempt}",
        float: false,
        attributes: &["exporter"],
        help: "Send attempts of an exporter that failed (retried, rejected or refused credentials).",
        read: Read::Points(|m, out| m.sinks.observe(out, "exporter", |s| Some(s.failures.get()))),
    },
    Instrument {
        name: "llmtap_exporter_queue_size",
        kind: Kind::Gauge,
        unit: "{record}",
        float: false,
        attributes: &["exporter"],
        help: "Records waiting for an exporter: its queue is the store's export log after its cursor (the same number as llmtap_export_lag; the log is bounded by retention, not by a count, so there is no queue capacity).",
        read: Read::Points(|m, out| {
            let head = m.export_head.get();
            m.sinks.observe(out, "exporter", |s| Some(s.lag(head)))
        }),
    },
    // The gRPC API.
    gauge(
        "llmtap_api_streams",
        "{stream}",
        "Open gRPC API streams (Subscribe and Export).",
        |m| m.api_streams.get(),
    ),
    counter(
        "llmtap_api_streams_rejected",
        "{stream}",
        "gRPC API streams refused with RESOURCE_EXHAUSTED ([api] max_streams open already).",
        |m| m.api_streams_rejected.get(),
    ),
    counter(
        "llmtap_api_streams_stalled",
        "{stream}",
        "gRPC API streams dropped because their client took nothing for [api] stall_timeout_secs.",
        |m| m.api_streams_stalled.get(),
    ),
    counter(
        "llmtap_api_unauthenticated",
        "{call}",
        "gRPC API calls refused with UNAUTHENTICATED (missing or wrong bearer token).",
        |m| m.api_unauthenticated.get(),
    ),
    counter(
        "llmtap_api_errors",
        "{call}",
        "gRPC API calls that failed inside llmtap (store read errors).",
        |m| m.api_errors.get(),
    ),
    counter(
        "llmtap_telemetry_export_failures",
        "{push}",
        "Pushes of these metrics to [telemetry] otlp_endpoint that failed (the next push carries the totals again).",
        |m| m.telemetry_export_failures.get(),
    ),
    // The process (read from the operating system when collected).
    Instrument {
        name: "llmtap_process_cpu_seconds",
        kind: Kind::Counter,
        unit: "s",
        float: true,
        attributes: &[],
        help: "CPU time the process used, user and system.",
        read: Read::Points(|_, out| super::process::cpu_seconds(out)),
    },
    Instrument {
        name: "llmtap_process_memory_rss_bytes",
        kind: Kind::Gauge,
        unit: "By",
        float: false,
        attributes: &[],
        help: "Resident set size of the process (Linux).",
        read: Read::Points(|_, out| super::process::rss_bytes(out)),
    },
    Instrument {
        name: "llmtap_process_open_fds",
        kind: Kind::Gauge,
        unit: "{file}",
        float: false,
        attributes: &[],
        help: "File descriptors the process has open (Linux).",
        read: Read::Points(|_, out| super::process::open_fds(out)),
    },
];

/// The instrument named `name`.
pub fn find(name: &str) -> Option<&'static Instrument> {
    INSTRUMENTS.iter().find(|i| i.name == name)
}

/// The metric list of docs/operations.md: one table row per instrument, in [`INSTRUMENTS`] order.
pub fn markdown_table() -> String {
    let mut out = String::from("| On /metrics | Type | Unit (OTLP) | Attributes | Meaning |\n|---|---|---|---|---|\n");
    for i in INSTRUMENTS {
        let attributes = if i.attributes.is_empty() {
            "".to_owned()
        } else {
            i.attributes
                .iter()
                .map(|a| format!("`{a}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!(
            "| `{}` | {} | `{}` | {} | {} |\n",
            i.prometheus_name(),
            i.kind.as_str(),
            i.unit,
            attributes,
            i.help.replace('|', "\\|")
        ));
    }
    out
}
