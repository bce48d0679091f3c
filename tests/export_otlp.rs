//! OTLP export to real receivers: a tonic gRPC TraceService and a hyper OTLP/HTTP endpoint, in this process.
//! Replayed fixture sessions must arrive as GenAI spans with the right tree and values; outages and restarts
//! lose nothing; rejections are not retried.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTracePartialSuccess, ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AV;
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Accept,
    Invalid,
    Partial,
}

type ResourceAttrs = Vec<(String, String)>;

#[derive(Clone)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
    resources: Arc<Mutex<Vec<ResourceAttrs>>>,
    attempts: Arc<Mutex<usize>>,
    metrics: Arc<Mutex<Vec<Metric>>>,
    mode: Mode,
}

impl Receiver {
    fn new(mode: Mode) -> Receiver {
        Receiver {
            spans: Arc::default(),
            resources: Arc::default(),
            attempts: Arc::default(),
            metrics: Arc::default(),
            mode,
        }
    }

    fn take(&self, req: ExportTraceServiceRequest) -> Result<ExportTraceServiceResponse, tonic::Status> {
        *self.attempts.lock().unwrap() += 1;
        match self.mode {
            Mode::Invalid => return Err(tonic::Status::invalid_argument("bad data")),
            Mode::Partial => {
                return Ok(ExportTraceServiceResponse {
                    partial_success: Some(ExportTracePartialSuccess {
                        rejected_spans: 1,
                        error_message: "one span too many".into(),
                    }),
                });
            }
            Mode::Accept => {}
        }
        for rs in req.resource_spans {
            let attrs = rs
                .resource
                .map(|r| r.attributes.into_iter().map(|kv| (kv.key, str_of(&kv.value))).collect())
                .unwrap_or_default();
            self.resources.lock().unwrap().push(attrs);
            for ss in rs.scope_spans {
                self.spans.lock().unwrap().extend(ss.spans);
            }
        }
        Ok(ExportTraceServiceResponse::default())
    }

    fn take_metrics(&self, req: ExportMetricsServiceRequest) {
        for rm in req.resource_metrics {
            for sm in rm.scope_metrics {
                self.metrics.lock().unwrap().extend(sm.metrics);
            }
        }
    }

    /// (sum, count) of a histogram over every data point whose attributes include `with`.
    fn histogram(&self, name: &str, with: Option<(&str, &str)>) -> (f64, u64) {
        let mut out = (0.0, 0);
        for m in self.metrics.lock().unwrap().iter().filter(|m| m.name == name) {
            if let Some(metric::Data::Histogram(h)) = &m.data {
                for p in &h.data_points {
                    let ok =
                        with.is_none_or(|(k, v)| p.attributes.iter().any(|kv| kv.key == k && str_of(&kv.value) == v));
                    if ok {
                        out.0 += p.sum.unwrap_or(0.0);
                        out.1 += p.count;
                    }
                }
            }
        }
        out
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    async fn wait_for(&self, pred: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.spans();
            if pred(&s) || Instant::now() > deadline {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.take(request.into_inner()).map(tonic::Response::new)
    }
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.take_metrics(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// Serve gRPC on `addr` (port 0: any free port) until the returned sender is dropped; returns the bound address.
/// The listener is bound here and handed to the server, so no other test can take the port in between.
async fn serve_grpc(r: Receiver, addr: SocketAddr) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = TraceServiceServer::new(r.clone()).accept_compressed(tonic::codec::CompressionEncoding::Gzip);
    let msvc = MetricsServiceServer::new(r).accept_compressed(tonic::codec::CompressionEncoding::Gzip);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .add_service(msvc)
            .serve_with_incoming_shutdown(llmtap::api::incoming(listener), async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    (addr, tx)
}

/// OTLP/HTTP: POST /v1/traces, protobuf or JSON, optionally gzip.
async fn serve_http(r: Receiver) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let r = r.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let r = r.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        assert!(path == "/v1/traces" || path == "/v1/metrics", "{path}");
                        let json = req.headers()["content-type"] == "application/json";
                        let gz = req.headers().get("content-encoding").is_some_and(|v| v == "gzip");
                        let mut body = req.into_body().collect().await.unwrap().to_bytes().to_vec();
                        if gz {
                            use std::io::Read;
                            let mut out = Vec::new();
                            flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut out).unwrap();
                            body = out;
                        }
                        if path == "/v1/metrics" {
                            let m: ExportMetricsServiceRequest = if json {
                                serde_json::from_slice(&body).unwrap()
                            } else {
                                ExportMetricsServiceRequest::decode(&body[..]).unwrap()
                            };
                            r.take_metrics(m);
                            let resp = ExportMetricsServiceResponse::default();
                            let body = if json {
                                serde_json::to_vec(&resp).unwrap()
                            } else {
                                resp.encode_to_vec()
                            };
                            return Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                                bytes::Bytes::from(body),
                            )));
                        }
                        let parsed: ExportTraceServiceRequest = if json {
                            serde_json::from_slice(&body).unwrap()
                        } else {
                            ExportTraceServiceRequest::decode(&body[..]).unwrap()
                        };
                        let resp = r.take(parsed).unwrap();
                        let body = if json {
                            serde_json::to_vec(&resp).unwrap()
                        } else {
                            resp.encode_to_vec()
                        };
                        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from(body),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

fn str_of(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AV::StringValue(s)) => s.clone(),
        Some(AV::IntValue(i)) => i.to_string(),
        Some(AV::BoolValue(b)) => b.to_string(),
        Some(AV::DoubleValue(d)) => d.to_string(),
        Some(AV::ArrayValue(a)) => a
            .values
            .iter()
            .map(|x| str_of(&Some(x.clone())))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes.iter().find(|kv| kv.key == key).map(|kv| str_of(&kv.value))
}

fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A loopback port for a receiver that is down for a while: bound but not listening, so connections to it are
/// refused and no other test's `bind(0)` is handed the same port meanwhile. (With a released port, a concurrent
/// test's gRPC server once took it during the outage; llmtap exported there, was answered `Unimplemented`, and
/// dropped the batch.) Drop the reservation right before serving on the port.
fn reserve_port() -> (socket2::Socket, SocketAddr) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    socket.bind(&any.into()).unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    (socket, addr)
}

fn otlp_config(up: &Upstream, endpoint: &str, protocol: &str, extra: &str) -> String {
    upstream_config(
        up,
        &format!(
            "[[export.otlp]]\nname = \"test\"\nendpoint = \"{endpoint}\"\nprotocol = \"{protocol}\"\nretry_initial_ms = 50\nretry_max_ms = 500\ntimeout_secs = 2\n{extra}"
        ),
    )
}

async fn replay(tap: &Llmtap, sessions: &[&str]) -> usize {
    let client = client();
    let mut n = 0;
    for name in sessions {
        for f in session(name) {
            assert_eq!(send_fixture(&client, tap, &f, &[]).await.status, f.status, "{}", f.name);
            n += 1;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_receiver_gets_the_genai_span_tree() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let receiver = Receiver::new(Mode::Accept);
    let (addr, _server) = serve_grpc(receiver.clone(), any_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut tap = Llmtap::start(
        &otlp_config(&up, &format!("http://{addr}"), "grpc", "capture_content = true\n"),
        dir.path(),
    );
    let n = replay(
        &tap,
        &[
            "pydantic-ai__anthropic_parallel_tools_agent",
            "openllmetry__openai_agents_sdk_handoff_hierarchy",
        ],
    )
    .await;
    tap.wait_for_traces(n);
    let steps = tap.export("steps", &[]);
    let traces = tap.export("provider-traces", &[]);
    // SIGTERM closes the open trajectories (invoke_agent spans) and flushes.
    assert!(tap.terminate().success());

    let spans = receiver.spans();
    let by_op = |op: &str| {
        spans
            .iter()
            .filter(|s| attr(s, "gen_ai.operation.name").as_deref() == Some(op))
            .collect::<Vec<_>>()
    };
    let chats = by_op("chat");
    let llm_traces: Vec<&serde_json::Value> = traces.iter().filter(|t| t["api"] != "other").collect();
    assert_eq!(chats.len(), llm_traces.len());
    for t in &llm_traces {
        let id = llmtap::export::otlp::spans::chat_span_id(t["id"].as_str().unwrap());
        let span = chats
            .iter()
            .find(|s| s.span_id == id)
            .unwrap_or_else(|| panic!("no chat span for {}", t["id"]));
        assert_eq!(span.kind, 3, "CLIENT");
        let model = t["request"]["model"].as_str().unwrap();
        assert_eq!(span.name, format!("chat {model}"));
        assert_eq!(attr(span, "gen_ai.request.model").as_deref(), Some(model));
        assert_eq!(attr(span, "server.address").as_deref(), Some("127.0.0.1"));
        let usage = &t["usage"];
        assert_eq!(
            attr(span, "gen_ai.usage.input_tokens").unwrap(),
            usage["input"].to_string()
        );
        assert_eq!(
            attr(span, "gen_ai.usage.output_tokens").unwrap(),
            usage["output"].to_string()
        );
        assert_eq!(
            attr(span, "gen_ai.conversation.id").as_deref(),
            t["trajectory_id"].as_str()
        );
        assert!(attr(span, "gen_ai.input.messages").unwrap().starts_with('['));
        let provider = attr(span, "gen_ai.provider.name").unwrap();
        assert_eq!(
            provider,
            if t["api"] == "anthropic.messages" {
                "anthropic"
            } else {
                "openai"
            }
        );
        assert_eq!(
            span.end_time_unix_nano - span.start_time_unix_nano,
            (t["timings"]["duration_ms"].as_f64().unwrap() * 1e6).round() as u64
        );
    }
    // Anthropic recorded usage: input = input + cache_read + cache_creation.
    let anth = llm_traces.iter().find(|t| t["api"] == "anthropic.messages").unwrap();
    let raw = &anth["response"]["usage"];
    let want = raw["input_tokens"].as_u64().unwrap()
        + raw["cache_read_input_tokens"].as_u64().unwrap_or(0)
        + raw["cache_creation_input_tokens"].as_u64().unwrap_or(0);
    let span = chats
        .iter()
        .find(|s| s.span_id == llmtap::export::otlp::spans::chat_span_id(anth["id"].as_str().unwrap()))
        .unwrap();
    assert_eq!(attr(span, "gen_ai.usage.input_tokens").unwrap(), want.to_string());

    // One invoke_agent per trajectory; every span of a trajectory shares its trace id and hangs under it.
    let agents = by_op("invoke_agent");
    let trajectories: HashSet<&str> = steps.iter().map(|s| s["trajectory_id"].as_str().unwrap()).collect();
    assert_eq!(agents.len(), trajectories.len());
    let agent_of: HashMap<Vec<u8>, &Span> = agents.iter().map(|s| (s.span_id.clone(), *s)).collect();
    for s in chats.iter().chain(by_op("execute_tool").iter()) {
        let parent = agent_of
            .get(&s.parent_span_id)
            .unwrap_or_else(|| panic!("{} has no invoke_agent parent", s.name));
        assert_eq!(parent.trace_id, s.trace_id);
    }
    // Tool spans: one per linked observation.
    let tools = by_op("execute_tool");
    let linked: usize = steps
        .iter()
        .map(|s| {
            s["observations"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|o| o["error"].is_null())
                .count()
        })
        .sum();
    let unique: HashSet<&Vec<u8>> = tools.iter().map(|s| &s.span_id).collect();
    assert!(
        unique.len() >= linked,
        "{} tool spans for {linked} results",
        unique.len()
    );
    assert!(tools.iter().all(|s| s.name.starts_with("execute_tool ") && s.kind == 1));
    // The handoff child's invoke_agent sits under the parent's execute_tool span, in the parent's trace.
    let child = steps.iter().find(|s| s["call_type"] == "subagent").unwrap();
    let child_agent = agents
        .iter()
        .find(|s| attr(s, "llmtap.trajectory_id").as_deref() == child["trajectory_id"].as_str())
        .unwrap();
    let parent_tool = llmtap::export::otlp::spans::tool_span_id(
        child["parent_trajectory_id"].as_str().unwrap(),
        child["parent_tool_call_id"].as_str().unwrap(),
    );
    assert_eq!(child_agent.parent_span_id, parent_tool);
    let parent_agent = agents
        .iter()
        .find(|s| attr(s, "llmtap.trajectory_id").as_deref() == child["parent_trajectory_id"].as_str())
        .unwrap();
    assert_eq!(child_agent.trace_id, parent_agent.trace_id);
    let res = receiver.resources.lock().unwrap();
    assert!(
        res.iter()
            .all(|r| r.iter().any(|(k, v)| k == "service.name" && v == "llmtap"))
    );
    drop(res);

    // GenAI client metrics agree with the spans.
    let input_sum: u64 = chats
        .iter()
        .map(|s| attr(s, "gen_ai.usage.input_tokens").unwrap().parse::<u64>().unwrap())
        .sum();
    let (sum, count) = receiver.histogram("gen_ai.client.token.usage", Some(("gen_ai.token.type", "input")));
    assert_eq!((sum as u64, count as usize), (input_sum, chats.len()));
    let (_, durations) = receiver.histogram("gen_ai.client.operation.duration", None);
    assert_eq!(durations as usize, chats.len());
    let streamed = chats
        .iter()
        .filter(|s| attr(s, "gen_ai.response.time_to_first_chunk").is_some())
        .count();
    assert!(streamed > 0);
    assert_eq!(
        receiver
            .histogram("gen_ai.client.operation.time_to_first_chunk", None)
            .1 as usize,
        streamed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_protobuf_and_json_receivers_get_spans() {
    for protocol in ["http/protobuf", "http/json"] {
        let up = Upstream::start(ReplayOptions::default()).await;
        let receiver = Receiver::new(Mode::Accept);
        let addr = serve_http(receiver.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let tap = Llmtap::start(&otlp_config(&up, &format!("http://{addr}"), protocol, ""), dir.path());
        let n = replay(&tap, &["pydantic-ai__gemini_tool_loop_5calls"]).await;
        let spans = receiver
            .wait_for(|s| s.iter().filter(|x| x.name.starts_with("chat ")).count() >= n)
            .await;
        let chats: Vec<&Span> = spans.iter().filter(|s| s.name.starts_with("chat ")).collect();
        assert_eq!(chats.len(), n, "{protocol}");
        assert!(
            chats
                .iter()
                .all(|s| attr(s, "gen_ai.provider.name").as_deref() == Some("gcp.gemini"))
        );
        assert!(
            chats
                .iter()
                .all(|s| attr(s, "gen_ai.usage.reasoning.output_tokens").is_some())
        );
        // Content capture is off by default.
        assert!(chats.iter().all(|s| attr(s, "gen_ai.input.messages").is_none()));
        let tools = receiver
            .wait_for(|s| s.iter().filter(|x| x.name.starts_with("execute_tool")).count() >= 6)
            .await;
        assert!(
            tools.iter().filter(|x| x.name.starts_with("execute_tool")).count() >= 6,
            "{protocol}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while receiver.histogram("gen_ai.client.operation.duration", None).1 < n as u64 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            receiver.histogram("gen_ai.client.operation.duration", None).1,
            n as u64,
            "{protocol} metrics"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_and_restart_lose_no_span() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let (reservation, addr) = reserve_port();
    let dir = tempfile::tempdir().unwrap();
    let config = otlp_config(&up, &format!("http://{addr}"), "grpc", "");
    // The receiver is down while traffic flows.
    let mut tap = Llmtap::start(&config, dir.path());
    let n1 = replay(&tap, &["pydantic-ai__openai_chat_stream_agent_3calls"]).await;
    tap.wait_for_traces(n1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while tap.metric("llmtap_export_retries_total") == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        tap.metric("llmtap_export_retries_total") > 0,
        "retries visible in the metrics"
    );
    assert_eq!(tap.metric("llmtap_exported_total"), 0);
    // Three more retries: still nothing may be dropped.
    let retries = tap.metric("llmtap_export_retries_total");
    wait::poll_until_async("three more retries", Duration::from_secs(15), || {
        tap.metric("llmtap_export_retries_total") >= retries + 3
    })
    .await;
    assert_eq!(
        tap.metric("llmtap_export_failed_total"),
        0,
        "an unreachable receiver is retried, never dropped"
    );
    // Restart llmtap while the receiver is still down; more traffic after the restart.
    tap.terminate();
    let tap = Llmtap::start(&config, dir.path());
    let n2 = replay(&tap, &["pydantic-ai__anthropic_parallel_tools_agent"]).await;
    let traces = tap.wait_for_traces(n1 + n2);
    // The receiver comes back.
    let receiver = Receiver::new(Mode::Accept);
    drop(reservation);
    let (_, _server) = serve_grpc(receiver.clone(), addr).await;
    let want: HashSet<Vec<u8>> = traces
        .iter()
        .map(|t| llmtap::export::otlp::spans::chat_span_id(t["id"].as_str().unwrap()))
        .collect();
    let spans = receiver
        .wait_for(|s| {
            let got: HashSet<Vec<u8>> = s.iter().map(|x| x.span_id.clone()).collect();
            want.is_subset(&got)
        })
        .await;
    let got: HashSet<Vec<u8>> = spans
        .iter()
        .filter(|s| s.name.starts_with("chat "))
        .map(|x| x.span_id.clone())
        .collect();
    assert_eq!(got, want, "every chat span arrives, none invented");
    // Tool spans for every linked result, and nothing dropped along the way.
    let steps = tap.export("steps", &[]);
    let tools: HashSet<Vec<u8>> = steps
        .iter()
        .flat_map(|s| {
            let traj = s["trajectory_id"].as_str().unwrap().to_owned();
            s["observations"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |o| llmtap::export::otlp::spans::tool_span_id(&traj, o["source_call_id"].as_str().unwrap()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!tools.is_empty());
    let spans = receiver
        .wait_for(|s| tools.iter().all(|t| s.iter().any(|x| &x.span_id == t)))
        .await;
    assert!(
        tools.iter().all(|t| spans.iter().any(|x| &x.span_id == t)),
        "every tool span arrives"
    );
    assert_eq!(
        tap.metric("llmtap_export_failed_total"),
        0,
        "nothing dropped during the outage"
    );
    // The first run's trajectory was closed at its shutdown: its invoke_agent span arrives too.
    assert!(spans.iter().any(|s| s.name.starts_with("invoke_agent")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_and_partial_success_are_not_retried() {
    for mode in [Mode::Invalid, Mode::Partial] {
        let up = Upstream::start(ReplayOptions::default()).await;
        let receiver = Receiver::new(mode);
        let (addr, _server) = serve_grpc(receiver.clone(), any_port()).await;
        let dir = tempfile::tempdir().unwrap();
        let tap = Llmtap::start(&otlp_config(&up, &format!("http://{addr}"), "grpc", ""), dir.path());
        let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
        assert_eq!(send_fixture(&client(), &tap, &f, &[]).await.status, 200);
        tap.wait_for_traces(1);
        // The exporter is done with the batch: it counted the refusal and moved its cursor past it (lag 0). A
        // retry would come before that (backoff 50 ms here), with the lag still at the batch's entries.
        wait::poll_until_async("the exporter to move past the batch", Duration::from_secs(15), || {
            *receiver.attempts.lock().unwrap() > 0
                && tap.metric("llmtap_export_failed_total") >= 1
                && tap.metric("llmtap_export_lag") == 0
        })
        .await;
        assert_eq!(*receiver.attempts.lock().unwrap(), 1, "sent once, never retried");
        assert_eq!(tap.metric("llmtap_export_retries_total"), 0);
        assert!(tap.metric("llmtap_export_failed_total") >= 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_otel_variables_and_an_incoming_traceparent_are_honoured() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let receiver = Receiver::new(Mode::Accept);
    let addr = serve_http(receiver.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{addr}");
    let tap = Llmtap::start_with_env(
        &upstream_config(&up, ""),
        dir.path(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=acme"),
            ("OTEL_SERVICE_NAME", "my-agent"),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=ml%20ops"),
        ],
    );
    let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(
        send_fixture(&client(), &tap, &f, &[("traceparent", tp)]).await.status,
        200
    );
    // The agent's own trace context is forwarded to the provider untouched.
    assert_eq!(up.received()[0].headers["traceparent"], tp);
    let spans = receiver.wait_for(|s| !s.is_empty()).await;
    let chat = spans.iter().find(|s| s.name.starts_with("chat ")).expect("chat span");
    assert_eq!(hex(&chat.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(hex(&chat.parent_span_id), "00f067aa0ba902b7");
    let res = receiver.resources.lock().unwrap();
    let r = &res[0];
    assert!(r.contains(&("service.name".into(), "my-agent".into())));
    assert!(r.contains(&("deployment.environment".into(), "test".into())));
    assert!(r.contains(&("team".into(), "ml ops".into())));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_destinations_each_get_everything() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let (grpc, http) = (Receiver::new(Mode::Accept), Receiver::new(Mode::Accept));
    let (gaddr, _server) = serve_grpc(grpc.clone(), any_port()).await;
    let haddr = serve_http(http.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(
        &up,
        &format!(
            "[[export.otlp]]\nname = \"a\"\nendpoint = \"http://{gaddr}\"\nprotocol = \"grpc\"\nretry_initial_ms = 50\n\
             [[export.otlp]]\nname = \"b\"\nendpoint = \"http://{haddr}\"\nprotocol = \"http/protobuf\"\nretry_initial_ms = 50\n"
        ),
    );
    let tap = Llmtap::start(&config, dir.path());
    let n = replay(&tap, &["pydantic-ai__openai_chat_stream_agent_3calls"]).await;
    let chats = |r: &Receiver| r.spans().iter().filter(|s| s.name.starts_with("chat ")).count();
    let deadline = Instant::now() + Duration::from_secs(20);
    while (chats(&grpc) < n || chats(&http) < n) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(chats(&grpc), n);
    assert_eq!(chats(&http), n);
    let ids = |r: &Receiver| r.spans().iter().map(|s| s.span_id.clone()).collect::<HashSet<_>>();
    assert_eq!(ids(&grpc), ids(&http), "both destinations get the same spans");
}

/// A span's id, name, sorted attributes and status code.
type ComparableSpan = (Vec<u8>, String, Vec<(String, String)>, Option<i32>);

/// Chat spans are built from the facts stored with each call; a store whose rows have no facts (written before
/// they were kept) is read from its bodies and exports the same spans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_from_stored_facts_equal_spans_read_from_the_bodies() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let sessions = [
        "pydantic-ai__anthropic_parallel_tools_agent",
        "pydantic-ai__gemini_tool_loop_5calls",
        "pydantic-ai__groq_retry_after_midstream_error",
    ];
    let chat_spans = |spans: Vec<Span>| -> Vec<ComparableSpan> {
        let mut out: Vec<_> = spans
            .into_iter()
            .filter(|s| s.name.starts_with("chat"))
            .map(|s| {
                let mut attrs: Vec<(String, String)> = s
                    .attributes
                    .iter()
                    .map(|kv| (kv.key.clone(), str_of(&kv.value)))
                    .collect();
                attrs.sort();
                (s.span_id, s.name, attrs, s.status.map(|st| st.code))
            })
            .collect();
        out.sort();
        out
    };
    // First run: every row has its facts.
    let receiver = Receiver::new(Mode::Accept);
    let (addr, server) = serve_grpc(receiver.clone(), any_port()).await;
    let config = otlp_config(&up, &format!("http://{addr}"), "grpc", "");
    let mut tap = Llmtap::start(&config, dir.path());
    let n = replay(&tap, &sessions).await;
    tap.wait_for_traces(n);
    let from_facts = receiver
        .wait_for(|s| s.iter().filter(|x| x.name.starts_with("chat")).count() >= n)
        .await;
    tap.terminate();
    drop(server);
    let from_facts = chat_spans(from_facts);
    assert_eq!(from_facts.len(), n);
    assert!(
        from_facts
            .iter()
            .any(|(_, _, attrs, _)| attrs.iter().any(|(k, _)| k == "gen_ai.response.finish_reasons")),
        "facts carry what the bodies said"
    );
    // The same store as an older llmtap left it: no facts, and the sink to export everything again.
    {
        let db = open_store_db(dir.path());
        db.execute_batch("UPDATE traces SET facts = NULL; DELETE FROM cursors;")
            .unwrap();
    }
    let receiver = Receiver::new(Mode::Accept);
    let (addr, _server) = serve_grpc(receiver.clone(), any_port()).await;
    let _tap = Llmtap::start(&otlp_config(&up, &format!("http://{addr}"), "grpc", ""), dir.path());
    let from_bodies = receiver
        .wait_for(|s| s.iter().filter(|x| x.name.starts_with("chat")).count() >= n)
        .await;
    assert_eq!(chat_spans(from_bodies), from_facts);
}

/// A chat span carries its call's cost: `gen_ai.usage.cost` (the total, USD) and `llmtap.cost.<part>_usd`; a call
/// without a known cost carries none (never 0). Anthropic prompt-cache call: input 3, cache write 418, cache
/// read 1111, output 33 at claude-sonnet-4-5's $3 / $3.75 / $0.30 / $15 per Mtok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_spans_carry_the_calls_cost() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let receiver = Receiver::new(Mode::Accept);
    let (addr, _server) = serve_grpc(receiver.clone(), any_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&otlp_config(&up, &format!("http://{addr}"), "grpc", ""), dir.path());
    let client = client();
    for name in [
        "anthropic_messages/pydantic-ai__prompt_cache/01",
        "openai_chat/simonw-llm__tools_streaming/00",
    ] {
        let f = fixture(name);
        assert_eq!(send_fixture(&client, &tap, &f, &[]).await.status, f.status, "{name}");
    }
    let model = |s: &Span| attr(s, "gen_ai.response.model").unwrap_or_default();
    let spans = receiver
        .wait_for(|s| s.iter().any(|s| model(s).starts_with("claude")) && s.iter().any(|s| model(s).contains("kimi")))
        .await;
    let chat = |m: &str| {
        spans
            .iter()
            .find(|s| attr(s, "gen_ai.operation.name").as_deref() == Some("chat") && model(s).contains(m))
            .unwrap_or_else(|| panic!("no chat span of {m}"))
    };
    let double = |s: &Span, key: &str| match s
        .attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref().and_then(|v| v.value.clone()))
    {
        Some(AV::DoubleValue(d)) => Some(d),
        None => None,
        other => panic!("{key} is not a double: {other:?}"),
    };
    let claude = chat("claude");
    assert_eq!(double(claude, "gen_ai.usage.cost"), Some(0.0024048));
    assert_eq!(double(claude, "llmtap.cost.input_usd"), Some(0.000009));
    assert_eq!(double(claude, "llmtap.cost.cache_write_usd"), Some(0.0015675));
    assert_eq!(double(claude, "llmtap.cost.cache_read_usd"), Some(0.0003333));
    assert_eq!(double(claude, "llmtap.cost.output_usd"), Some(0.000495));
    assert_eq!(double(claude, "llmtap.cost.reasoning_usd"), Some(0.0));
    // The development conventions' names next to the released ones: cache writes under both names, the cost
    // under the proposed gen_ai.usage.cost.* as well (computed here: source `local`).
    assert_eq!(
        attr(claude, "gen_ai.usage.cache_write.input_tokens").as_deref(),
        Some("418")
    );
    assert_eq!(
        attr(claude, "gen_ai.usage.cache_creation.input_tokens").as_deref(),
        Some("418")
    );
    assert_eq!(double(claude, "gen_ai.usage.cost.amount"), Some(0.0024048));
    assert_eq!(attr(claude, "gen_ai.usage.cost.currency").as_deref(), Some("USD"));
    assert_eq!(attr(claude, "gen_ai.usage.cost.source").as_deref(), Some("local"));
    let kimi = chat("kimi");
    assert!(attr(kimi, "gen_ai.usage.input_tokens").is_some(), "the call has usage");
    assert_eq!(double(kimi, "gen_ai.usage.cost"), None, "unknown cost: no attribute");
    assert_eq!(double(kimi, "gen_ai.usage.cost.amount"), None);
    assert_eq!(attr(kimi, "gen_ai.usage.cost.currency"), None);
}
