//! The GenAI client metrics (semantic conventions v1.41.1 §metrics), derived from the `chat` spans of an export
//! batch so spans and metrics can never disagree: `gen_ai.client.token.usage` (input/output),
//! `gen_ai.client.operation.duration`, `gen_ai.client.operation.time_to_first_chunk`. Delta histograms, one data
//! point per attribute set per batch, with the conventions' bucket boundaries.

use std::collections::BTreeMap;

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Histogram, HistogramDataPoint, Metric, ResourceMetrics, ScopeMetrics, metric,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::Span;

use crate::semconv as sc;

const TOKEN_BOUNDS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0,
    67108864.0,
];
const SECONDS_BOUNDS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// Attributes shared by every GenAI metric, taken from the span.
const COMMON: [&str; 6] = [
    sc::GEN_AI_OPERATION_NAME,
    sc::GEN_AI_PROVIDER_NAME,
    sc::GEN_AI_REQUEST_MODEL,
    sc::GEN_AI_RESPONSE_MODEL,
    sc::SERVER_ADDRESS,
    sc::SERVER_PORT,
];

#[derive(Default)]
struct Acc {
    count: u64,
    sum: f64,
    buckets: Vec<u64>,
    start: u64,
    end: u64,
}

type Key = (&'static str, Vec<(String, String)>);

fn attr_value(span: &Span, key: &str) -> Option<String> {
    let v = span
        .attributes
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match v {
        any_value::Value::StringValue(s) => s.clone(),
        any_value::Value::IntValue(i) => i.to_string(),
        any_value::Value::DoubleValue(d) => d.to_string(),
        any_value::Value::BoolValue(b) => b.to_string(),
        _ => return None,
    })
}

fn int_attr(span: &Span, key: &str) -> Option<f64> {
    attr_value(span, key).and_then(|v| v.parse().ok())
}

pub fn from_spans(resource: &[(String, String)], spans: &[Span]) -> Option<ExportMetricsServiceRequest> {
    let mut acc: BTreeMap<Key, Acc> = BTreeMap::new();
    let mut record = |name: &'static str, attrs: Vec<(String, String)>, v: f64, bounds: &[f64], s: &Span| {
        let a = acc.entry((name, attrs)).or_default();
        if a.buckets.is_empty() {
            a.buckets = vec![0; bounds.len() + 1];
            a.start = s.start_time_unix_nano;
        }
        a.count += 1;
        a.sum += v;
        let i = bounds.iter().position(|b| v <= *b).unwrap_or(bounds.len());
        a.buckets[i] += 1;
        a.start = a.start.min(s.start_time_unix_nano);
        a.end = a.end.max(s.end_time_unix_nano);
    };
    for s in spans
        .iter()
        .filter(|s| attr_value(s, sc::GEN_AI_OPERATION_NAME).as_deref() == Some(sc::OP_CHAT))
    {
        let common: Vec<(String, String)> = COMMON
            .iter()
            .filter_map(|k| attr_value(s, k).map(|v| ((*k).to_owned(), v)))
            .collect();
        for (ty, key) in [
            ("input", sc::GEN_AI_USAGE_INPUT_TOKENS),
            ("output", sc::GEN_AI_USAGE_OUTPUT_TOKENS),
        ] {
            if let Some(v) = int_attr(s, key) {
                let mut a = common.clone();
                a.push(("gen_ai.token.type".into(), ty.into()));
                record("gen_ai.client.token.usage", a, v, &TOKEN_BOUNDS, s);
            }
        }
        let mut with_error = common.clone();
        if let Some(e) = attr_value(s, sc::ERROR_TYPE) {
            with_error.push((sc::ERROR_TYPE.into(), e));
        }
        let secs = s.end_time_unix_nano.saturating_sub(s.start_time_unix_nano) as f64 / 1e9;
        record("gen_ai.client.operation.duration", with_error, secs, &SECONDS_BOUNDS, s);
        if let Some(t) = attr_value(s, sc::GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK).and_then(|v| v.parse().ok()) {
            record(
                "gen_ai.client.operation.time_to_first_chunk",
                common.clone(),
                t,
                &SECONDS_BOUNDS,
                s,
            );
        }
    }
    if acc.is_empty() {
        return None;
    }
    let mut metrics: BTreeMap<&'static str, Vec<HistogramDataPoint>> = BTreeMap::new();
    for ((name, attrs), a) in acc {
        let bounds: &[f64] = if name == "gen_ai.client.token.usage" {
            &TOKEN_BOUNDS
        } else {
            &SECONDS_BOUNDS
        };
        metrics.entry(name).or_default().push(HistogramDataPoint {
            attributes: attrs
                .into_iter()
                .map(|(k, v)| KeyValue {
                    key: k,
                    value: Some(AnyValue {
                        value: Some(any_value::Value::StringValue(v)),
                    }),
                    ..KeyValue::default()
                })
                .collect(),
            start_time_unix_nano: a.start,
            time_unix_nano: a.end.max(a.start),
            count: a.count,
            sum: Some(a.sum),
            bucket_counts: a.buckets,
            explicit_bounds: bounds.to_vec(),
            ..HistogramDataPoint::default()
        });
    }
    let metrics = metrics
        .into_iter()
        .map(|(name, points)| Metric {
            name: name.to_owned(),
            unit: if name == "gen_ai.client.token.usage" {
                "{token}".into()
            } else {
                "s".into()
            },
            description: String::new(),
            data: Some(metric::Data::Histogram(Histogram {
                data_points: points,
                aggregation_temporality: AggregationTemporality::Delta as i32,
            })),
            ..Metric::default()
        })
        .collect();
    Some(ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: resource
                    .iter()
                    .map(|(k, v)| KeyValue {
                        key: k.clone(),
                        value: Some(AnyValue {
                            value: Some(any_value::Value::StringValue(v.clone())),
                        }),
                        ..KeyValue::default()
                    })
                    .collect(),
                ..Resource::default()
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: "llmtap".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..InstrumentationScope::default()
                }),
                metrics,
                ..ScopeMetrics::default()
            }],
            ..ResourceMetrics::default()
        }],
    })
}
