//! llmtap's own metrics, through the real binary: a few captured calls to a scripted upstream (one answered
//! with an error) and one export sink that rejects every batch. The numbers must be the expected ones, and the
//! same on `/metrics` (read with a Prometheus text parser), in `llmtap status`, and at an OTLP/gRPC metrics
//! receiver (`[telemetry] otlp_endpoint`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::scripted::Scripted;
use common::*;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AV;
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point};
use prost::Message;
use serde_json::json;

/// Every metrics export received, in order.
#[derive(Clone, Default)]
struct MetricsReceiver(Arc<Mutex<Vec<ExportMetricsServiceRequest>>>);

#[tonic::async_trait]
impl MetricsService for MetricsReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// Attribute (label) names and values, sorted.
type Attributes = Vec<(String, String)>;

/// A series: metric name (as on /metrics) and its labels.
type Series = (String, Attributes);

impl MetricsReceiver {
    async fn serve(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = MetricsServiceServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(llmtap::api::incoming(listener))
                .await
                .unwrap();
        });
        addr
    }

    /// The latest export, as Prometheus names its samples (`_total` on monotonic sums, `_count` / `_sum` of a
    /// histogram), plus the resource's attributes.
    fn latest(&self) -> Option<(BTreeMap<Series, f64>, Attributes)> {
        let all = self.0.lock().unwrap();
        let last = all.last()?;
        let mut out = BTreeMap::new();
        let mut resource = Vec::new();
        for rm in &last.resource_metrics {
            if let Some(r) = &rm.resource {
                resource.extend(r.attributes.iter().map(|kv| (kv.key.clone(), any_string(&kv.value))));
            }
            for sm in &rm.scope_metrics {
                for m in &sm.metrics {
                    match &m.data {
                        Some(metric::Data::Sum(s)) => {
                            assert!(s.is_monotonic, "{} is a counter", m.name);
                            for p in &s.data_points {
                                out.insert((format!("{}_total", m.name), labels(&p.attributes)), number(&p.value));
                            }
                        }
                        Some(metric::Data::Gauge(g)) => {
                            for p in &g.data_points {
                                out.insert((m.name.clone(), labels(&p.attributes)), number(&p.value));
                            }
                        }
                        Some(metric::Data::Histogram(h)) => {
                            for p in &h.data_points {
                                // The family name stands for its +Inf bucket, as parse_prometheus reads it.
                                out.insert((m.name.clone(), labels(&p.attributes)), p.count as f64);
                                out.insert((format!("{}_count", m.name), labels(&p.attributes)), p.count as f64);
                                out.insert((format!("{}_sum", m.name), labels(&p.attributes)), p.sum.unwrap_or(0.0));
                            }
                        }
                        other => panic!("{}: unexpected data {other:?}", m.name),
                    }
                }
            }
        }
        Some((out, resource))
    }
}

fn any_string(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AV::StringValue(s)) => s.clone(),
        Some(AV::IntValue(i)) => i.to_string(),
        other => format!("{other:?}"),
    }
}

fn labels(attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> Vec<(String, String)> {
    let mut out: Vec<_> = attributes
        .iter()
        .map(|kv| (kv.key.clone(), any_string(&kv.value)))
        .collect();
    out.sort();
    out
}

fn number(v: &Option<number_data_point::Value>) -> f64 {
    match v {
        Some(number_data_point::Value::AsInt(i)) => *i as f64,
        Some(number_data_point::Value::AsDouble(d)) => *d,
        None => f64::NAN,
    }
}

/// A Prometheus text exposition parsed by `prometheus-parse`: each sample by name and labels (a histogram's
/// `_bucket` series as the count of its `+Inf` bucket under the family name).
fn parse_prometheus(text: &str) -> BTreeMap<Series, f64> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    let mut out = BTreeMap::new();
    for s in scrape.samples {
        let mut labels: Vec<(String, String)> = s.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        labels.sort();
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than.is_infinite())
                .map(|b| b.count)
                .unwrap(),
            prometheus_parse::Value::Summary(_) => panic!("no summaries expected"),
        };
        out.insert((s.metric, labels), value);
    }
    out
}

fn series(name: &str, labels: &[(&str, &str)]) -> Series {
    let mut l: Vec<(String, String)> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    l.sort();
    (name.to_owned(), l)
}

/// An OTLP/HTTP traces endpoint that refuses every batch with 400 (OTLP forbids retrying it), keeping the
/// bodies it was sent.
async fn refusing_sink() -> (SocketAddr, Arc<Mutex<Vec<bytes::Bytes>>>) {
    use http_body_util::BodyExt;
    let received: Arc<Mutex<Vec<bytes::Bytes>>> = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let keep = received.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let keep = keep.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let keep = keep.clone();
                    async move {
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        keep.lock().unwrap().push(body);
                        let mut resp = http::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(b"no")));
                        *resp.status_mut() = http::StatusCode::BAD_REQUEST;
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, received)
}

async fn poll<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_metrics_read_the_same_on_metrics_in_status_and_over_otlp() {
    let up = Scripted::start_plain().await;
    let receiver = MetricsReceiver::default();
    let otlp = receiver.serve().await;
    let (sink, sink_received) = refusing_sink().await;
    let extra = format!(
        "[telemetry]\notlp_endpoint = \"http://{otlp}\"\ninterval_secs = 1\n\
         [[export.otlp]]\nname = \"refusing\"\nendpoint = \"http://{}\"\nprotocol = \"http/protobuf\"\n\
         compression = \"none\"\nmetrics = false\nretry_initial_ms = 50\nretry_max_ms = 1000\ntimeout_secs = 2\n",
        sink
    );
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, &extra), dir.path());

    // Three captured calls to one upstream, the last answered 500.
    let client = client();
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello"}]});
    for status in ["", "", "500"] {
        let mut headers = vec![
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
        ];
        if !status.is_empty() {
            headers.push(("x-scripted-status", status));
        }
        let url = tap.url("/anthropic/v1/messages");
        let r = send(&client, "POST", &url, &headers, serde_json::to_vec(&body).unwrap()).await;
        assert_eq!(r.status, if status.is_empty() { 200 } else { 500 });
    }
    tap.wait_for_traces(3);
    tap.wait_settled();

    // The sink refused every batch once (no retry): the spans it was sent are the ones given up on.
    let refused_spans = || -> u64 {
        sink_received
            .lock()
            .unwrap()
            .iter()
            .map(|body| {
                let req = ExportTraceServiceRequest::decode(&body[..]).unwrap();
                req.resource_spans
                    .iter()
                    .flat_map(|rs| &rs.scope_spans)
                    .map(|ss| ss.spans.len() as u64)
                    .sum::<u64>()
            })
            .sum()
    };
    let scrape = || async {
        let r = send(&client, "GET", &tap.url("/metrics"), &[], Vec::new()).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.headers.get("content-type").unwrap(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
        parse_prometheus(std::str::from_utf8(&r.body).unwrap())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let prom = loop {
        let prom = scrape().await;
        let caught_up = prom.get(&series("llmtap_exporter_queue_size", &[("exporter", "refusing")])) == Some(&0.0);
        let failed = prom
            .get(&series(
                "llmtap_exporter_send_failed_items_total",
                &[("exporter", "refusing")],
            ))
            .copied();
        if caught_up && failed.is_some_and(|f| f > 0.0 && f == refused_spans() as f64) {
            break prom;
        }
        assert!(Instant::now() < deadline, "the sink never caught up: {prom:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let anthropic = [("upstream", "anthropic")];
    let refusing = [("exporter", "refusing")];
    let spans = refused_spans() as f64;
    let expected: Vec<(Series, f64)> = vec![
        (series("llmtap_requests_total", &[]), 3.0),
        (series("llmtap_captured_total", &[]), 3.0),
        (series("llmtap_processed_total", &[]), 3.0),
        (series("llmtap_capture_dropped_total", &[]), 0.0),
        (series("llmtap_capture_spilled_total", &[]), 0.0),
        (series("llmtap_upstream_requests_total", &anthropic), 3.0),
        (series("llmtap_upstream_failed_requests_total", &anthropic), 1.0),
        (series("llmtap_upstream_duration_seconds_count", &anthropic), 3.0),
        (series("llmtap_exporter_sent_items_total", &refusing), 0.0),
        (series("llmtap_exporter_send_failed_items_total", &refusing), spans),
        (series("llmtap_exporter_queue_size", &refusing), 0.0),
        (series("llmtap_export_failed_total", &[]), spans),
        (series("llmtap_exported_total", &[]), 0.0),
        (series("llmtap_export_lag", &[("sink", "refusing")]), 0.0),
        (series("llmtap_store_errors_total", &[]), 0.0),
    ];
    for (s, want) in &expected {
        assert_eq!(prom.get(s), Some(want), "/metrics {s:?}");
    }
    // Every committed batch was timed; the histogram's buckets add up to its count.
    let commits = prom[&series("llmtap_store_commit_duration_seconds_count", &[])];
    assert!(commits >= 1.0, "store commits timed");
    assert_eq!(prom[&series("llmtap_store_commit_duration_seconds", &[])], commits);
    assert!(prom[&series("llmtap_upstream_duration_seconds_sum", &anthropic)] > 0.0);
    for process in [
        "llmtap_process_cpu_seconds_total",
        "llmtap_process_memory_rss_bytes",
        "llmtap_process_open_fds",
    ] {
        assert!(prom[&series(process, &[])] > 0.0, "{process}");
    }
    // llmtap status prints the same samples.
    let status = parse_prometheus(&tap.metrics());
    for (s, want) in &expected {
        assert_eq!(status.get(s), Some(want), "llmtap status {s:?}");
    }

    // The viewer's metrics page reads the same collection.
    let viewer = tap.viewer_addr.expect("the viewer listens");
    let r = send(&client, "GET", &format!("http://{viewer}/api/metrics"), &[], Vec::new()).await;
    assert_eq!(r.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let mut from_viewer = BTreeMap::new();
    for family in v["metrics"].as_array().unwrap() {
        let name = family["name"].as_str().unwrap();
        for sample in family["samples"].as_array().unwrap() {
            let mut labels: Vec<(String, String)> = sample["labels"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect();
            labels.sort();
            match sample.get("count") {
                Some(count) => {
                    from_viewer.insert((format!("{name}_count"), labels), count.as_f64().unwrap());
                }
                None => {
                    from_viewer.insert((name.to_owned(), labels), sample["value"].as_f64().unwrap());
                }
            }
        }
    }
    for (s, want) in &expected {
        assert_eq!(from_viewer.get(s), Some(want), "viewer api/metrics {s:?}");
    }

    // The OTLP receiver gets the same instruments: wait for an export taken after everything settled.
    let same = poll(Duration::from_secs(20), || {
        let (got, resource) = receiver.latest()?;
        let all_same = expected.iter().all(|(s, want)| got.get(s) == Some(want))
            && got.get(&series("llmtap_store_commit_duration_seconds_count", &[])) == Some(&commits)
            && got.get(&series("llmtap_stored_total", &[])) == prom.get(&series("llmtap_stored_total", &[]));
        all_same.then_some((got, resource))
    })
    .await;
    let Some((got, resource)) = same else {
        panic!(
            "OTLP never matched /metrics; latest OTLP: {:#?}\n/metrics: {prom:#?}",
            receiver.latest().map(|l| l.0)
        );
    };
    assert!(
        resource.contains(&("service.name".to_owned(), "llmtap".to_owned())),
        "{resource:?}"
    );
    for process in [
        "llmtap_process_cpu_seconds_total",
        "llmtap_process_memory_rss_bytes",
        "llmtap_process_open_fds",
    ] {
        assert!(got[&series(process, &[])] > 0.0, "{process} over OTLP");
    }
    // Every family on /metrics is one instrument over OTLP too (the histogram's buckets aside).
    let otlp_names: std::collections::BTreeSet<&str> = got.keys().map(|(n, _)| n.as_str()).collect();
    for (name, _) in prom.keys() {
        assert!(
            otlp_names.contains(name.as_str()),
            "{name} is on /metrics but not over OTLP"
        );
    }
}

/// A self-telemetry destination that is down: each failed push is counted (and logged), /metrics and the
/// traffic are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_otlp_push_is_counted_and_metrics_stay_served() {
    let up = Scripted::start_plain().await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let extra = format!("[telemetry]\notlp_endpoint = \"http://{closed}\"\ninterval_secs = 1\ntimeout_secs = 1\n");
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, &extra), dir.path());
    let client = client();
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello"}]});
    let headers = [
        ("content-type", "application/json"),
        ("anthropic-version", "2023-06-01"),
    ];
    let r = send(
        &client,
        "POST",
        &tap.url("/anthropic/v1/messages"),
        &headers,
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    let failures = poll(Duration::from_secs(30), || {
        (tap.metric("llmtap_telemetry_export_failures_total") >= 1).then_some(())
    })
    .await;
    assert!(failures.is_some(), "failed pushes are counted:\n{}", tap.metrics());
    assert_eq!(tap.metric("llmtap_requests_total"), 1);
}
