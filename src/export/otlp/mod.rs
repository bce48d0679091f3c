//! OTLP export: traces (and the GenAI client metrics) to a gRPC, HTTP/protobuf or HTTP/JSON receiver. This is
//! only the [`Sink`]: building requests from the export log and sending them (`transport`); cursor, batching,
//! retries, pause, shutdown flush and metrics are the shared driver's (`export::sink`).

pub mod metrics;
pub mod spans;
pub mod transport;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, OtlpConfig};
use crate::export::sink::driver::{Driver, DriverConfig};
use crate::export::sink::retry::RetryPolicy;
use crate::export::sink::{Accepted, LogEntry, SendError, Sink};
use crate::store::{RecentRecords, StoreError, StoreReader};
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics};
use transport::Transport;

pub use crate::export::sink::driver::FLUSH_DEADLINE;

pub struct SinkContext {
    pub config: OtlpConfig,
    pub data_dir: PathBuf,
    pub resource: Vec<(String, String)>,
    pub servers: Arc<HashMap<String, (String, u16)>>,
    pub metrics: Arc<Metrics>,
    /// The writer's last committed records: most spans are built from these instead of read back.
    pub recent: Arc<RecentRecords>,
    /// The writer's commit count: the sink wakes on commits instead of polling.
    pub commits: tokio::sync::watch::Receiver<u64>,
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

/// One OTLP destination.
pub struct OtlpSink {
    config: OtlpConfig,
    resource: Vec<(String, String)>,
    servers: Arc<HashMap<String, (String, u16)>>,
    transport: Transport,
    /// Metrics refused for good are dropped (the spans went through): logged once per episode.
    metrics_rejected: EpisodeLog,
}

/// One request's spans and metrics; each part is cleared once delivered, so a retry sends only what is left
/// (metrics follow their spans; a metrics failure never sends the spans again).
pub struct OtlpBatch {
    traces: Option<ExportTraceServiceRequest>,
    metrics: Option<ExportMetricsServiceRequest>,
    spans: usize,
    /// What the receiver said about the spans, kept while the metrics are retried.
    accepted: Accepted,
}

impl Sink for OtlpSink {
    type Batch = OtlpBatch;

    fn build(&self, reader: &StoreReader, entries: &[LogEntry]) -> Result<OtlpBatch, StoreError> {
        let mut builder = spans::SpanBuilder::new(reader, self.config.capture_content, &self.servers);
        let mut all = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for entry in entries {
            for s in builder.spans_for(entry.kind, &entry.reference)? {
                // The same tool span can be logged twice (results arriving in two updates): send it once per batch.
                if seen.insert((s.trace_id.clone(), s.span_id.clone())) {
                    all.push(s);
                }
            }
        }
        let spans = all.len();
        let metrics = if self.config.metrics {
            metrics::from_spans(&self.resource, &all)
        } else {
            None
        };
        Ok(OtlpBatch {
            traces: (spans > 0).then(|| ExportTraceServiceRequest {
                resource_spans: vec![spans::resource_spans(&self.resource, all)],
            }),
            metrics,
            spans,
            accepted: Accepted::default(),
        })
    }

    fn items(&self, batch: &OtlpBatch) -> usize {
        batch.spans
    }

    async fn send(&self, batch: &mut OtlpBatch) -> Result<Accepted, SendError> {
        if let Some(request) = &batch.traces {
            batch.accepted = self.transport.send(&self.config, request.clone()).await?;
            batch.traces = None;
        }
        if let Some(request) = &batch.metrics {
            match self.transport.send_metrics(&self.config, request.clone()).await {
                Ok(()) => {
                    self.metrics_rejected.success();
                }
                Err(e @ SendError::Retryable { .. }) => return Err(e),
                Err(error) => match self.metrics_rejected.failure() {
                    EpisodeReport::First => {
                        tracing::warn!(sink = %self.config.name, %error, "OTLP metrics rejected; dropped")
                    }
                    EpisodeReport::Summary { count } => {
                        tracing::warn!(sink = %self.config.name, count, %error, "OTLP metrics rejected {count} more times in the last minute")
                    }
                    EpisodeReport::Quiet => {}
                },
            }
            batch.metrics = None;
        }
        Ok(std::mem::take(&mut batch.accepted))
    }
}

/// Run one OTLP destination until `stop` (and its flush) is over.
pub async fn run(ctx: SinkContext, stop: CancellationToken) {
    let transport = match Transport::new(&ctx.config) {
        Ok(t) => t,
        Err(error) => {
            tracing::error!(sink = %ctx.config.name, %error, "OTLP exporter disabled");
            return;
        }
    };
    let cfg = DriverConfig {
        name: ctx.config.name.clone(),
        data_dir: ctx.data_dir,
        batch_size: ctx.config.batch_size,
        retry: RetryPolicy {
            initial: ctx.config.retry_initial,
            max: ctx.config.retry_max,
        },
        recent: ctx.recent,
        log: crate::store::LogTable::Export,
        commits: Some(ctx.commits),
    };
    let sink = OtlpSink {
        config: ctx.config,
        resource: ctx.resource,
        servers: ctx.servers,
        transport,
        metrics_rejected: EpisodeLog::default(),
    };
    Driver::new(sink, cfg, ctx.metrics).run(stop).await;
}
