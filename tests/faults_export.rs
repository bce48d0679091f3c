//! Export faults through the real binary, against an OTLP/HTTP sink scripted here: a sink that throttles with
//! `Retry-After`, one that never finishes its response body, one that refuses our token and later accepts, one
//! that rejects every batch; per-sink lag; retention counting what it evicts before export.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use hyper::body::Frame;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use prost::Message;
use tokio::sync::mpsc;

/// How the scripted sink answers one traces request.
#[derive(Clone, Copy, Debug)]
enum Answer {
    Accept,
    Status(u16, Option<&'static str>),
    /// 200 and the first bytes of a body that never ends.
    HangBody,
}

type FrameTx = mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>;

/// A response body fed from a channel: a sender kept alive and silent is a body that never ends.
struct ChanBody(mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>);

impl hyper::body::Body for ChanBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx)
    }
}

type Script = Arc<dyn Fn(usize) -> Answer + Send + Sync>;

#[derive(Clone)]
struct ScriptedSink {
    script: Script,
    /// When each traces request arrived.
    requests: Arc<Mutex<Vec<Instant>>>,
    /// Span ids of every accepted request.
    spans: Arc<Mutex<HashSet<Vec<u8>>>>,
    /// Bodies left hanging, kept open for the test's life.
    hung: Arc<Mutex<Vec<FrameTx>>>,
}

impl ScriptedSink {
    async fn start(script: impl Fn(usize) -> Answer + Send + Sync + 'static) -> (ScriptedSink, SocketAddr) {
        let sink = ScriptedSink {
            script: Arc::new(script),
            requests: Arc::default(),
            spans: Arc::default(),
            hung: Arc::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let s = sink.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| s.clone().answer(req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (sink, addr)
    }

    async fn answer(
        self,
        req: http::Request<hyper::body::Incoming>,
    ) -> Result<http::Response<ChanBody>, std::convert::Infallible> {
        let (tx, rx) = mpsc::channel(4);
        let mut resp = http::Response::new(ChanBody(rx));
        let is_traces = req.uri().path() == "/v1/traces";
        let body = req.into_body().collect().await.unwrap().to_bytes();
        if !is_traces {
            return Ok(resp);
        }
        let n = {
            let mut r = self.requests.lock().unwrap();
            r.push(Instant::now());
            r.len() - 1
        };
        match (self.script)(n) {
            Answer::Accept => {
                let parsed = ExportTraceServiceRequest::decode(&body[..]).unwrap();
                let mut spans = self.spans.lock().unwrap();
                for rs in parsed.resource_spans {
                    for ss in rs.scope_spans {
                        spans.extend(ss.spans.into_iter().map(|s| s.span_id));
                    }
                }
                let _ = tx.try_send(Ok(Frame::data(Bytes::from(
                    ExportTraceServiceResponse::default().encode_to_vec(),
                ))));
            }
            Answer::Status(code, retry_after) => {
                *resp.status_mut() = http::StatusCode::from_u16(code).unwrap();
                if let Some(v) = retry_after {
                    resp.headers_mut().insert("retry-after", v.parse().unwrap());
                }
                let _ = tx.try_send(Ok(Frame::data(Bytes::from_static(b"no"))));
            }
            Answer::HangBody => {
                let _ = tx.try_send(Ok(Frame::data(Bytes::from_static(b"\x0a"))));
                self.hung.lock().unwrap().push(tx);
            }
        }
        Ok(resp)
    }

    fn attempts(&self) -> Vec<Instant> {
        self.requests.lock().unwrap().clone()
    }

    /// Wait (up to `within`) until every span id in `want` was accepted; returns those still missing.
    async fn wait_for_spans(&self, want: &HashSet<Vec<u8>>, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let missing = want.difference(&self.spans.lock().unwrap()).count();
            if missing == 0 || Instant::now() > deadline {
                return missing;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// One `[[export.otlp]]` section for a scripted sink (HTTP/protobuf, no gzip, no metrics: spans only).
fn sink_section(name: &str, addr: SocketAddr, extra: &str) -> String {
    format!(
        "[[export.otlp]]\nname = \"{name}\"\nendpoint = \"http://{addr}\"\nprotocol = \"http/protobuf\"\n\
         compression = \"none\"\nmetrics = false\nretry_initial_ms = 50\nretry_max_ms = 1000\ntimeout_secs = 2\n{extra}"
    )
}

/// Send `calls` through llmtap and return the chat span ids of the stored traces.
async fn send_calls(tap: &Llmtap, calls: &[Fixture]) -> HashSet<Vec<u8>> {
    let client = client();
    for f in calls {
        assert_eq!(send_fixture(&client, tap, f, &[]).await.status, f.status, "{}", f.name);
    }
    let traces = tap.wait_for_traces(calls.len());
    assert_eq!(traces.len(), calls.len());
    traces
        .iter()
        .map(|t| llmtap::export::otlp::spans::chat_span_id(t["id"].as_str().unwrap()))
        .collect()
}

/// Every call of two agent sessions (tool results and closed trajectories interleave with the calls).
fn session_calls() -> Vec<Fixture> {
    let mut calls = session("pydantic-ai__gemini_tool_loop_5calls");
    calls.extend(session("pydantic-ai__openai_chat_stream_agent_3calls"));
    calls
}

/// The value of `family{sink="name"}` in `llmtap status`, if present.
fn sink_metric(tap: &Llmtap, family: &str, sink: &str) -> Option<u64> {
    let prefix = format!("{family}{{sink=\"{sink}\"}} ");
    tap.metrics()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).and_then(|v| v.trim().parse().ok()))
}

/// Poll `cond` every 100 ms for up to `within`; true once it held.
async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_up_to_retry_max_and_export_catches_up() {
    let up = Upstream::start(ReplayOptions::default()).await;
    // Throttled for three requests, asking for an hour each time; then healthy.
    let (sink, addr) = ScriptedSink::start(|n| {
        if n < 3 {
            Answer::Status(503, Some("3600"))
        } else {
            Answer::Accept
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream_config(&up, &sink_section("throttled", addr, "batch_size = 4\n")),
        dir.path(),
    );
    let want = send_calls(&tap, &session_calls()).await;
    let missing = sink.wait_for_spans(&want, Duration::from_secs(20)).await;
    assert_eq!(missing, 0, "every stored call reaches the sink once it answers");
    let attempts = sink.attempts();
    for pair in attempts[..4].windows(2) {
        // Honoured (not replaced by the 50 ms backoff), but only up to retry_max (1 s), not an hour.
        assert!(
            pair[1] - pair[0] >= Duration::from_millis(900),
            "Retry-After honoured up to retry_max: {:?}",
            pair[1] - pair[0]
        );
    }
    assert_eq!(tap.metric("llmtap_export_failed_total"), 0, "nothing dropped");
    assert!(tap.metric("llmtap_export_retries_total") >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_body_that_never_ends_times_out_and_the_batch_is_sent_again() {
    let up = Upstream::start(ReplayOptions::default()).await;
    // The first two requests get headers and a byte of body, then nothing, forever.
    let (sink, addr) = ScriptedSink::start(|n| if n < 2 { Answer::HangBody } else { Answer::Accept }).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream_config(&up, &sink_section("hanging", addr, "batch_size = 4\n")),
        dir.path(),
    );
    let want = send_calls(&tap, &session_calls()).await;
    // Two hung requests cost two timeouts (2 s each); the rest must follow at once.
    let missing = sink.wait_for_spans(&want, Duration::from_secs(20)).await;
    assert_eq!(missing, 0, "a hung body is timed out and retried; every call arrives");
    assert!(sink.attempts().len() >= 3);
    assert_eq!(tap.metric("llmtap_export_failed_total"), 0, "nothing dropped");
    assert!(eventually(Duration::from_secs(10), || tap.metric("llmtap_export_lag") == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_is_per_sink_and_the_aggregate_is_the_slowest() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let (fast, fast_addr) = ScriptedSink::start(|_| Answer::Accept).await;
    let (_locked, locked_addr) = ScriptedSink::start(|_| Answer::Status(401, None)).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(
        &up,
        &format!(
            "{}{}",
            sink_section("fast", fast_addr, ""),
            sink_section("locked", locked_addr, "")
        ),
    );
    let tap = Llmtap::start(&config, dir.path());
    let calls = session_calls();
    let want = send_calls(&tap, &calls).await;
    assert_eq!(fast.wait_for_spans(&want, Duration::from_secs(20)).await, 0);
    // The locked sink owes at least every call (plus tool and agent entries); the fast one nothing.
    let settled = eventually(Duration::from_secs(15), || {
        sink_metric(&tap, "llmtap_export_lag", "fast") == Some(0)
            && sink_metric(&tap, "llmtap_export_lag", "locked").unwrap_or(0) >= calls.len() as u64
    })
    .await;
    assert!(settled, "per-sink lag:\n{}", tap.metrics());
    let locked_lag = sink_metric(&tap, "llmtap_export_lag", "locked").unwrap();
    assert_eq!(
        tap.metric("llmtap_export_lag"),
        locked_lag,
        "the aggregate is the slowest sink's lag"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_refusing_our_token_is_paused_loses_nothing_and_resumes() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let token_fixed = Arc::new(AtomicBool::new(false));
    let fixed = token_fixed.clone();
    let (sink, addr) = ScriptedSink::start(move |_| {
        if fixed.load(Ordering::SeqCst) {
            Answer::Accept
        } else {
            Answer::Status(401, None)
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream_config(&up, &sink_section("auth", addr, "batch_size = 4\n")),
        dir.path(),
    );
    let want = send_calls(&tap, &session_calls()).await;
    let paused = eventually(Duration::from_secs(15), || {
        sink_metric(&tap, "llmtap_export_paused", "auth") == Some(1)
    })
    .await;
    assert!(paused, "the sink shows as paused:\n{}", tap.metrics());
    assert!(
        tap.metrics()
            .contains("llmtap_export_last_error{sink=\"auth\",error=\"export unauthorized: HTTP 401\"} 1"),
        "{}",
        tap.metrics()
    );
    // Probed (every retry_max = 1 s) while paused, and nothing is dropped meanwhile.
    let attempts = sink.attempts().len();
    assert!(
        eventually(Duration::from_secs(15), || sink.attempts().len() >= attempts + 2).await,
        "probed again while paused"
    );
    assert_eq!(tap.metric("llmtap_export_failed_total"), 0, "a 401 drops nothing");
    assert_eq!(tap.metric("llmtap_exported_total"), 0);

    // The token is fixed: the sink resumes by itself, from where it stopped.
    token_fixed.store(true, Ordering::SeqCst);
    let missing = sink.wait_for_spans(&want, Duration::from_secs(20)).await;
    assert_eq!(missing, 0, "every call arrives once the sink accepts");
    assert!(
        eventually(Duration::from_secs(5), || sink_metric(
            &tap,
            "llmtap_export_paused",
            "auth"
        ) == Some(0))
        .await
    );
    assert!(!tap.metrics().contains("llmtap_export_last_error{sink=\"auth\""));
    assert_eq!(tap.metric("llmtap_export_failed_total"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_log_once_per_episode_not_once_per_batch() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let (sink, addr) = ScriptedSink::start(|_| Answer::Status(400, None)).await;
    let dir = tempfile::tempdir().unwrap();
    let (tap, log) = Llmtap::start_capturing_log(
        &upstream_config(&up, &sink_section("picky", addr, "batch_size = 1\n")),
        dir.path(),
    );
    let calls = session_calls();
    send_calls(&tap, &calls).await;
    // One batch per export-log entry, every one rejected (and, as OTLP says, not retried).
    let all_rejected = eventually(Duration::from_secs(20), || {
        tap.metric("llmtap_export_failed_total") >= calls.len() as u64
    })
    .await;
    assert!(all_rejected, "{}", tap.metrics());
    // The failure counter counts spans, the sink's attempts batches: wait for the batches too.
    let all_sent = eventually(Duration::from_secs(20), || sink.attempts().len() >= calls.len()).await;
    assert!(all_sent, "{} attempts", sink.attempts().len());
    assert_eq!(tap.metric("llmtap_export_retries_total"), 0);
    let rejected_lines: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.to_ascii_lowercase().contains("rejected"))
        .cloned()
        .collect();
    assert_eq!(
        rejected_lines.len(),
        1,
        "the first failure of the episode is logged, the rest counted: {rejected_lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_unexported_counts_traces_the_slowest_sink_had_not_exported() {
    let up = Upstream::start(ReplayOptions::default()).await;
    // A sink that never accepts: its cursor stays where the test puts it.
    let (_sink, addr) = ScriptedSink::start(|_| Answer::Status(503, None)).await;
    let dir = tempfile::tempdir().unwrap();
    let section = sink_section("behind", addr, "");
    let calls = session_calls();
    let traces = record_calls(&upstream_config(&up, &section), dir.path(), &calls).await;

    // The sink had exported up to (and including) the third call's span: put its cursor there.
    let db = open_store_db(dir.path());
    let chats: Vec<(i64, String)> = db
        .prepare("SELECT seq, ref FROM export_log WHERE kind = 'chat' ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(chats.len(), calls.len());
    let exported: HashSet<&str> = chats[..3].iter().map(|(_, id)| id.as_str()).collect();
    db.execute(
        "INSERT INTO cursors (sink, seq) VALUES ('behind', ?1) ON CONFLICT(sink) DO UPDATE SET seq = excluded.seq",
        [chats[2].0],
    )
    .unwrap();
    drop(db);

    // Restarted with room for one trace: every other trace is evicted at start.
    let config = upstream_config(&up, &format!("[store]\nmax_traces = 1\n{section}"));
    let tap = Llmtap::start(&config, dir.path());
    let kept = tap.wait_for_at_most_traces(1);
    assert_eq!(kept.len(), 1);
    let kept_id = kept[0]["id"].as_str().unwrap();
    let evicted: Vec<&str> = traces
        .iter()
        .filter_map(|t| t["id"].as_str())
        .filter(|id| *id != kept_id)
        .collect();
    let unexported = evicted.iter().filter(|id| !exported.contains(**id)).count() as u64;
    assert!(unexported > 0 && unexported < evicted.len() as u64);
    assert!(
        eventually(Duration::from_secs(10), || tap.metric("llmtap_evicted_total")
            == evicted.len() as u64)
        .await
    );
    assert_eq!(
        tap.metric("llmtap_evicted_unexported_total"),
        unexported,
        "evicted before the sink exported them"
    );
}

/// A gRPC receiver that answers UNAVAILABLE with `RetryInfo{1 day}` to its first request, then accepts.
#[derive(Clone, Default)]
struct ThrottlingGrpc {
    attempts: Arc<Mutex<Vec<Instant>>>,
    spans: Arc<Mutex<HashSet<Vec<u8>>>>,
}

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService for ThrottlingGrpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        use tonic_types::StatusExt;
        let first = {
            let mut a = self.attempts.lock().unwrap();
            a.push(Instant::now());
            a.len() == 1
        };
        if first {
            return Err(tonic::Status::with_error_details(
                tonic::Code::Unavailable,
                "come back tomorrow",
                tonic_types::ErrorDetails::with_retry_info(Some(Duration::from_secs(86_400))),
            ));
        }
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans.into_iter().map(|s| s.span_id));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_info_is_capped_by_retry_max() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let receiver = ThrottlingGrpc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer::new(
        receiver.clone(),
    )
    .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(llmtap::api::incoming(listener)),
    );
    let dir = tempfile::tempdir().unwrap();
    let section = format!(
        "[[export.otlp]]\nname = \"grpc\"\nendpoint = \"http://{addr}\"\nprotocol = \"grpc\"\nmetrics = false\n\
         retry_initial_ms = 50\nretry_max_ms = 1000\ntimeout_secs = 2\n"
    );
    let tap = Llmtap::start(&upstream_config(&up, &section), dir.path());
    let want = send_calls(&tap, &json_calls(3)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !want.is_subset(&receiver.spans.lock().unwrap()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        want.is_subset(&receiver.spans.lock().unwrap()),
        "a day's RetryInfo is capped at retry_max (1 s): {} attempts, {}",
        receiver.attempts.lock().unwrap().len(),
        tap.metrics()
    );
    let attempts = receiver.attempts.lock().unwrap().clone();
    assert!(
        attempts[1] - attempts[0] >= Duration::from_millis(900),
        "but honoured up to it"
    );
    assert_eq!(tap.metric("llmtap_export_failed_total"), 0);
}

/// Issue 36 item 11: `llmtap_export_lag` of a sink that stops is exact when it is read. The sink accepts the
/// first batch, then answers 503 and the driver waits a minute before trying again; calls keep coming meanwhile.
/// The gauge must be what the store holds after the sink's cursor (the export log's last seq minus the cursor),
/// not what the sink was behind when it last read a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_of_a_sink_that_stops_is_exact_when_read() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let (sink, addr) = ScriptedSink::start(|n| {
        if n == 0 {
            Answer::Accept
        } else {
            Answer::Status(503, None)
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let section = format!(
        "[[export.otlp]]\nname = \"stuck\"\nendpoint = \"http://{addr}\"\nprotocol = \"http/protobuf\"\n\
         compression = \"none\"\nmetrics = false\nretry_initial_ms = 60000\nretry_max_ms = 60000\ntimeout_secs = 2\n"
    );
    let tap = Llmtap::start(&upstream_config(&up, &section), dir.path());
    let calls = session_calls();
    let client = client();
    let send_one = |f: &Fixture| {
        let (client, tap, f) = (&client, &tap, f.clone());
        async move { assert_eq!(send_fixture(client, tap, &f, &[]).await.status, f.status, "{}", f.name) }
    };
    // The first call's batch is accepted; the second call's is refused, and the driver then waits a minute.
    send_one(&calls[0]).await;
    assert!(eventually(Duration::from_secs(20), || !sink.attempts().is_empty()).await);
    send_one(&calls[1]).await;
    assert!(eventually(Duration::from_secs(20), || sink.attempts().len() >= 2).await);
    for f in &calls[2..] {
        send_one(f).await;
    }
    tap.wait_for_traces(calls.len());
    let db = open_store_db(dir.path());
    let behind = || -> u64 {
        let head: i64 = db
            .query_row("SELECT COALESCE(MAX(seq), 0) FROM export_log", [], |r| r.get(0))
            .unwrap();
        let cursor: i64 = db
            .query_row("SELECT seq FROM cursors WHERE sink = 'stuck'", [], |r| r.get(0))
            .unwrap();
        (head - cursor) as u64
    };
    // Read twice in a row equal: the store may still commit a closing record between the two reads.
    let mut last = None;
    let exact = eventually(Duration::from_secs(10), || {
        let (gauge, truth) = (sink_metric(&tap, "llmtap_export_lag", "stuck"), behind());
        let ok = gauge == Some(truth) && last == Some(truth);
        last = (gauge == Some(truth)).then_some(truth);
        ok
    })
    .await;
    assert!(
        exact,
        "lag {:?}, the store holds {} entries after the cursor",
        sink_metric(&tap, "llmtap_export_lag", "stuck"),
        behind()
    );
    assert!(behind() >= (calls.len() - 1) as u64, "the later calls are owed");
    assert_eq!(sink.attempts().len(), 2, "the driver was waiting all along");
    assert_eq!(tap.metric("llmtap_export_lag"), behind(), "the aggregate");
}
