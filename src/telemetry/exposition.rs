//! Reading the instruments on demand: one collection by the meter provider's manual reader, as families of
//! samples in [`INSTRUMENTS`] order. `/metrics` writes them in the Prometheus text format with
//! `prometheus-client` (the official Rust client's encoder), and the viewer's `/api/metrics` as JSON. The
//! numbers are the ones OTLP export sends: every reader collects the same instruments.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData};

use super::instruments::{INSTRUMENTS, Instrument, Kind, Value};
use super::sdk::SharedReader;

/// The Content-Type of [`Exposition::render`].
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Label name and value pairs, in the order the instrument declares its attributes.
pub type Labels = Vec<(String, String)>;

/// One instrument's points at one collection.
#[derive(Debug)]
pub struct Family {
    pub instrument: &'static Instrument,
    pub samples: Vec<(Labels, Sample)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Sample {
    Number(Value),
    /// Bucket upper bounds with the count in each bucket (not cumulative), the last bound `+Inf`.
    Histogram {
        count: u64,
        sum: f64,
        buckets: Vec<(f64, u64)>,
    },
}

#[derive(Debug)]
pub struct Exposition {
    reader: SharedReader,
    registry: Registry,
}

impl Exposition {
    pub fn new(reader: SharedReader) -> Exposition {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(ReaderCollector(reader.clone())));
        Exposition { reader, registry }
    }

    /// The Prometheus text exposition (format 0.0.4) of one collection.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(error) = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry) {
            tracing::debug!(%error, "Cannot encode /metrics");
        }
        out
    }

    /// One collection, every instrument that has points.
    pub fn families(&self) -> Vec<Family> {
        families(&self.reader)
    }
}

fn families(reader: &SharedReader) -> Vec<Family> {
    let Some(rm) = reader.collect() else {
        return Vec::new();
    };
    let collected: Vec<&Metric> = rm.scope_metrics().flat_map(|s| s.metrics()).collect();
    INSTRUMENTS
        .iter()
        .filter_map(|i| {
            let m = collected.iter().find(|m| m.name() == i.name)?;
            let mut samples = match m.data() {
                AggregatedMetrics::U64(d) => samples(d, Value::U64),
                AggregatedMetrics::F64(d) => samples(d, Value::F64),
                AggregatedMetrics::I64(d) => samples(d, |v: i64| Value::U64(v.max(0) as u64)),
            };
            // Labels in the order the instrument declares its attributes (the SDK sorts them by name).
            let rank = |k: &str| i.attributes.iter().position(|a| *a == k).unwrap_or(usize::MAX);
            for (labels, _) in &mut samples {
                labels.sort_by(|a, b| rank(&a.0).cmp(&rank(&b.0)).then_with(|| a.0.cmp(&b.0)));
            }
            samples.sort_by(|a, b| a.0.cmp(&b.0));
            Some(Family { instrument: i, samples })
        })
        .collect()
}

fn labels<'a>(attributes: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> Labels {
    let mut out: Labels = attributes
        .map(|kv| (kv.key.as_str().to_owned(), kv.value.to_string()))
        .collect();
    out.sort();
    out
}

fn samples<T: Copy>(data: &MetricData<T>, value: impl Fn(T) -> Value) -> Vec<(Labels, Sample)> {
    match data {
        MetricData::Sum(sum) => sum
            .data_points()
            .map(|p| (labels(p.attributes()), Sample::Number(value(p.value()))))
            .collect(),
        MetricData::Gauge(gauge) => gauge
            .data_points()
            .map(|p| (labels(p.attributes()), Sample::Number(value(p.value()))))
            .collect(),
        MetricData::Histogram(histogram) => histogram
            .data_points()
            .map(|p| {
                // The SDK's last count is the overflow bucket above the last bound.
                let buckets = p
                    .bounds()
                    .chain(std::iter::once(f64::INFINITY))
                    .zip(p.bucket_counts())
                    .collect();
                let sample = Sample::Histogram {
                    count: p.count(),
                    sum: value(p.sum()).as_f64(),
                    buckets,
                };
                (labels(p.attributes()), sample)
            })
            .collect(),
        // Not configured for any instrument.
        MetricData::ExponentialHistogram(_) => Vec::new(),
    }
}

/// Collects on each scrape and encodes the families (a family's samples together).
#[derive(Debug)]
struct ReaderCollector(SharedReader);

impl Collector for ReaderCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for family in families(&self.0) {
            let i = family.instrument;
            let metric_type = match i.kind {
                Kind::Counter => MetricType::Counter,
                Kind::Gauge => MetricType::Gauge,
                Kind::Histogram => MetricType::Histogram,
            };
            let mut metric = encoder.encode_descriptor(i.name, i.help, None, metric_type)?;
            for (labels, sample) in &family.samples {
                let mut point = metric.encode_family(labels)?;
                match (i.kind, sample) {
                    (Kind::Counter, Sample::Number(Value::U64(v))) => {
                        point.encode_counter::<Labels, _, f64>(v, None)?
                    }
                    (Kind::Counter, Sample::Number(Value::F64(v))) => {
                        point.encode_counter::<Labels, _, f64>(v, None)?
                    }
                    (_, Sample::Number(Value::U64(v))) => point.encode_gauge(v)?,
                    (_, Sample::Number(Value::F64(v))) => point.encode_gauge(v)?,
                    (_, Sample::Histogram { count, sum, buckets }) => {
                        point.encode_histogram::<Labels>(*sum, *count, buckets, None)?
                    }
                }
            }
        }
        Ok(())
    }
}

/// The families as JSON (the viewer's `/api/metrics`): `{"metrics": [{"name", "type", "unit", "help",
/// "samples": [{"labels": {...}, "value"} or {"labels", "count", "sum"}]}]}`, names as on /metrics.
pub fn to_json(families: &[Family]) -> serde_json::Value {
    use serde_json::json;
    let metrics: Vec<serde_json::Value> = families
        .iter()
        .map(|f| {
            let i = f.instrument;
            let samples: Vec<serde_json::Value> = f
                .samples
                .iter()
                .map(|(labels, s)| {
                    let labels: serde_json::Map<String, serde_json::Value> =
                        labels.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
                    match s {
                        Sample::Number(Value::U64(v)) => json!({"labels": labels, "value": v}),
                        Sample::Number(Value::F64(v)) => json!({"labels": labels, "value": v}),
                        Sample::Histogram { count, sum, .. } => json!({"labels": labels, "count": count, "sum": sum}),
                    }
                })
                .collect();
            json!({"name": i.prometheus_name(), "type": i.kind.as_str(), "unit": i.unit, "help": i.help,
                   "samples": samples})
        })
        .collect();
    json!({ "metrics": metrics })
}
