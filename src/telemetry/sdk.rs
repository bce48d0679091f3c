//! llmtap's own metrics on the OpenTelemetry metrics SDK: one meter provider whose instruments are made from
//! [`INSTRUMENTS`]. Observable instruments read the counters' atomics when a reader collects (nothing is added
//! to a request's work); the few synchronous ones (histograms, per-upstream counts) are recorded by the
//! pipeline and the store writer. Two readers share those instruments: a manual one that `/metrics` collects
//! on each scrape (`telemetry::exposition`), and, when `[telemetry] otlp_endpoint` is set, a periodic one
//! pushing OTLP/gRPC.

use std::sync::{Arc, Weak};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, PeriodicReader, Pipeline, SdkMeterProvider, Temporality,
};

use super::instruments::{
    DURATION_BOUNDS, INSTRUMENTS, Kind, Read, STORE_COMMIT_DURATION, UPSTREAM_DURATION, UPSTREAM_FAILED,
    UPSTREAM_REQUESTS,
};
use super::{EpisodeLog, EpisodeReport, Metrics};
use crate::config::TelemetryConfig;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot set up OTLP export of llmtap's metrics to [telemetry] otlp_endpoint {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// The synchronous instruments, recorded off the data path (see [`Metrics::record_exchange`] and
/// [`Metrics::record_commit`]).
#[derive(Debug)]
pub struct Recorded {
    upstream_requests: Counter<u64>,
    upstream_failed: Counter<u64>,
    upstream_duration: Histogram<f64>,
    store_commit: Histogram<f64>,
}

impl Recorded {
    fn new(meter: &Meter) -> Recorded {
        let counter = |name: &'static str| {
            let i = super::instruments::find(name);
            meter
                .u64_counter(name)
                .with_description(i.map_or("", |i| i.help))
                .with_unit(i.map_or("", |i| i.unit))
                .build()
        };
        let histogram = |name: &'static str| {
            let i = super::instruments::find(name);
            meter
                .f64_histogram(name)
                .with_description(i.map_or("", |i| i.help))
                .with_unit(i.map_or("", |i| i.unit))
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build()
        };
        Recorded {
            upstream_requests: counter(UPSTREAM_REQUESTS),
            upstream_failed: counter(UPSTREAM_FAILED),
            upstream_duration: histogram(UPSTREAM_DURATION),
            store_commit: histogram(STORE_COMMIT_DURATION),
        }
    }

    pub(super) fn exchange(&self, upstream: &str, failed: bool, seconds: f64) {
        let attributes = [KeyValue::new("upstream", upstream.to_owned())];
        self.upstream_requests.add(1, &attributes);
        if failed {
            self.upstream_failed.add(1, &attributes);
        }
        self.upstream_duration.record(seconds, &attributes);
    }

    pub(super) fn commit(&self, seconds: f64) {
        self.store_commit.record(seconds, &[]);
    }
}

/// The manual reader, shared: the provider owns one handle, `/metrics` collects through the other.
#[derive(Debug, Clone)]
pub struct SharedReader(Arc<ManualReader>);

impl SharedReader {
    pub fn collect(&self) -> Option<ResourceMetrics> {
        let mut rm = ResourceMetrics::default();
        self.0.collect(&mut rm).ok().map(|()| rm)
    }
}

impl MetricReader for SharedReader {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline)
    }
    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

/// The OTLP exporter, its failures counted (`llmtap_telemetry_export_failures`) and logged once an episode: the
/// SDK would otherwise drop them silently.
struct CountingExporter {
    inner: opentelemetry_otlp::MetricExporter,
    metrics: Arc<Metrics>,
    endpoint: String,
    episodes: EpisodeLog,
}

impl std::fmt::Debug for CountingExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CountingExporter")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl PushMetricExporter for CountingExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let result = self.inner.export(metrics).await;
        match &result {
            Ok(()) => {
                if let Some(unreported) = self.episodes.success() {
                    tracing::info!(endpoint = %self.endpoint, unreported, "Self-telemetry export recovered");
                }
            }
            Err(error) => {
                self.metrics.telemetry_export_failures.inc();
                match self.episodes.failure() {
                    EpisodeReport::First => tracing::warn!(
                        endpoint = %self.endpoint, %error,
                        "Cannot push llmtap's own metrics over OTLP (counted in llmtap_telemetry_export_failures_total; \
                         /metrics is unaffected)"
                    ),
                    EpisodeReport::Summary { count } => tracing::warn!(
                        endpoint = %self.endpoint, %error, "{count} more self-telemetry pushes failed"
                    ),
                    EpisodeReport::Quiet => {}
                }
            }
        }
        result
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }
    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

/// The running meter provider: [`SelfTelemetry::shutdown`] pushes a last OTLP export.
#[derive(Debug)]
pub struct SelfTelemetry {
    provider: SdkMeterProvider,
}

impl SelfTelemetry {
    /// A last collection and export (when OTLP is configured), then the provider stops.
    pub fn shutdown(&self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::debug!(%error, "Self-telemetry shutdown");
        }
    }
}

/// Build the meter provider over `metrics` and make `/metrics` and the recorded instruments live. With
/// `[telemetry] otlp_endpoint`, call inside a Tokio runtime: the gRPC channel's connection task is spawned on it.
pub fn install(
    metrics: &Arc<Metrics>,
    config: &TelemetryConfig,
    resource: &[(String, String)],
) -> Result<SelfTelemetry, TelemetryError> {
    let reader = SharedReader(Arc::new(ManualReader::builder().build()));
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_attributes(resource.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())))
        .build();
    let mut builder = SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(reader.clone());
    if let Some(endpoint) = &config.otlp_endpoint {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|source| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                source,
            })?;
        let exporter = CountingExporter {
            inner: exporter,
            metrics: metrics.clone(),
            endpoint: endpoint.clone(),
            episodes: EpisodeLog::default(),
        };
        builder = builder.with_reader(PeriodicReader::builder(exporter).with_interval(config.interval).build());
    }
    let provider = builder.build();
    let meter = provider.meter("llmtap");
    register_observables(&meter, metrics);
    let _ = metrics.recorded.set(Recorded::new(&meter));
    let _ = metrics.exposition.set(super::exposition::Exposition::new(reader));
    Ok(SelfTelemetry { provider })
}

/// One observable instrument per [`INSTRUMENTS`] entry that reads atomics; its callback runs on each collection.
/// The SDK keeps the callbacks registered for the provider's life, whether or not the handles are kept.
fn register_observables(meter: &Meter, metrics: &Arc<Metrics>) {
    for i in INSTRUMENTS.iter().filter(|i| !matches!(i.read, Read::Recorded)) {
        let m = metrics.clone();
        // The SDK has one builder per value type and kind; each reads the instrument's points the same way.
        macro_rules! observe {
            ($builder:ident, $value:ident) => {{
                meter
                    .$builder(i.name)
                    .with_description(i.help)
                    .with_unit(i.unit)
                    .with_callback(move |o| {
                        i.observe(&m)
                            .iter()
                            .for_each(|p| o.observe(p.value.$value(), &p.attributes))
                    })
                    .build();
            }};
        }
        match (i.kind, i.float) {
            (Kind::Counter, false) => observe!(u64_observable_counter, as_u64),
            (Kind::Counter, true) => observe!(f64_observable_counter, as_f64),
            (Kind::Gauge, false) => observe!(u64_observable_gauge, as_u64),
            (Kind::Gauge, true) => observe!(f64_observable_gauge, as_f64),
            // A histogram has no observable form: it is recorded.
            (Kind::Histogram, _) => {}
        }
    }
}
