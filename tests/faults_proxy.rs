//! Faults on the proxy side, through the real binary: compression bombs, capture memory under concurrent
//! uploads, slow and idle clients, the connection limit, HTTP/2 clients in front of HTTP/1.1-only upstreams,
//! dot segments, shutdown with a hung upstream, and an upstream answering before it has read the request. The
//! upstream here is scripted (plain HTTP/1.1 only, like a local vLLM or Ollama), so each test decides exactly
//! what it answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};

use common::Llmtap;
use serde_json::Value;

/// What the scripted upstream saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: http::HeaderMap,
    body_len: usize,
}

type Script = Arc<dyn Fn(&Seen) -> Answer + Send + Sync>;

enum Answer {
    Json(u16, Bytes, Vec<(&'static str, &'static str)>),
    /// Read the request, then never answer.
    Hang,
}

struct ScriptedUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedUpstream {
    async fn start(script: Script) -> ScriptedUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let script = script.clone();
                let log = log.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let script = script.clone();
                        let log = log.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                            let seen = Seen {
                                method: parts.method.to_string(),
                                path: parts.uri.path().to_owned(),
                                headers: parts.headers,
                                body_len: body.len(),
                            };
                            log.lock().unwrap().push(seen.clone());
                            match script(&seen) {
                                Answer::Json(status, body, headers) => {
                                    let mut resp = Response::builder()
                                        .status(status)
                                        .header("content-type", "application/json");
                                    for (k, v) in headers {
                                        resp = resp.header(k, v);
                                    }
                                    Ok::<_, Infallible>(resp.body(Full::new(body)).unwrap())
                                }
                                Answer::Hang => std::future::pending().await,
                            }
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        ScriptedUpstream { addr, seen, task }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// llmtap config routing `/local/...` to this upstream (plain http, so HTTP/1.1 only).
    fn config(&self, extra: &str) -> String {
        format!(
            "[upstreams.local]\nurl = \"http://{}/prefix\"\napi = \"openai\"\n[api]\nlisten = \"off\"\n{extra}",
            self.addr
        )
    }
}

const CHAT_RESPONSE: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
const CHAT_REQUEST: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

fn ok_script() -> Script {
    Arc::new(|_| Answer::Json(200, Bytes::from_static(CHAT_RESPONSE.as_bytes()), vec![]))
}

/// Peak resident memory of a process, in MiB.
fn peak_rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        / 1024
}

/// `n` gzip members of 1 MiB of spaces each: ~1 KiB per member on the wire, `n` MiB once inflated.
fn gzip_bomb(n: usize) -> Vec<u8> {
    let mut member = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    member.write_all(&vec![b' '; 1 << 20]).unwrap();
    let member = member.finish().unwrap();
    member.repeat(n)
}

fn trace_for<'a>(traces: &'a [serde_json::Value], path_part: &str) -> &'a serde_json::Value {
    traces
        .iter()
        .find(|t| t["path"].as_str().unwrap_or("").contains(path_part))
        .unwrap_or_else(|| panic!("no trace for {path_part}: {traces:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_bombs_in_either_direction_are_forwarded_untouched_and_captured_cut_at_the_cap() {
    // 300 MiB once inflated, 300 KiB on the wire: the response as an upstream sends it, the request as a client.
    let bomb = Bytes::from(gzip_bomb(300));
    let response_bomb = bomb.clone();
    let upstream = ScriptedUpstream::start(Arc::new(move |seen| {
        if seen.path.ends_with("/bomb") {
            Answer::Json(200, response_bomb.clone(), vec![("content-encoding", "gzip")])
        } else {
            Answer::Json(200, Bytes::from_static(CHAT_RESPONSE.as_bytes()), vec![])
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config("[capture]\nmax_body_bytes = 4194304\n"), dir.path());
    let client = common::client();

    let reply = common::send(&client, "POST", &tap.url("/local/v1/bomb"), &[], CHAT_REQUEST.into()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.body, bomb,
        "the client gets the upstream's bytes, still compressed"
    );
    let reply = common::send(
        &client,
        "POST",
        &tap.url("/local/v1/chat/completions"),
        &[("content-type", "application/json"), ("content-encoding", "gzip")],
        bomb.to_vec(),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        upstream.seen()[1].body_len,
        bomb.len(),
        "the upstream gets the request as sent"
    );

    let traces = tap.wait_for_traces(2);
    for path in ["/bomb", "/chat/completions"] {
        assert_eq!(trace_for(&traces, path)["outcome"], "truncated", "{path}");
    }
    assert!(tap.metric("llmtap_capture_truncated_total") >= 2);
    let peak = peak_rss_mib(tap.pid());
    assert!(
        peak < 200,
        "llmtap peaked at {peak} MiB decoding two 300 MiB bombs with a 4 MiB cap"
    );
}

/// Uploads in flight hold their captured bodies until they finish: those bytes count against
/// `capture.queue_bytes` as they are kept, and what does not fit is forwarded but not captured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_bytes_in_flight_stay_within_the_capture_budget() {
    // A watch, not a Notify: a handler that has not reached its wait yet still sees the release.
    let (release, released) = tokio::sync::watch::channel(false);
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // An upstream that takes every upload and answers only once all of them are in.
    let gate = released;
    let upstream = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let gate = gate.clone();
            let started = started_tx.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let gate = gate.clone();
                    let started = started.clone();
                    async move {
                        let _ = req.into_body().collect().await;
                        let _ = started.send(());
                        let mut gate = gate.clone();
                        let _ = gate.wait_for(|open| *open).await;
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(CHAT_RESPONSE.as_bytes()))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[upstreams.local]\nurl = \"http://{addr}\"\n[api]\nlisten = \"off\"\n[capture]\nqueue_bytes = 4194304\n"
    );
    let tap = Llmtap::start(&config, dir.path());
    let baseline = peak_rss_mib(tap.pid());
    const UPLOADS: usize = 12;
    const SIZE: usize = 16 << 20;
    let mut sends = Vec::new();
    for i in 0..UPLOADS {
        let url = tap.url("/local/v1/chat/completions");
        sends.push(tokio::spawn(async move {
            let body = vec![b'a' + i as u8; SIZE];
            common::send(&common::client(), "POST", &url, &[], body).await.status
        }));
    }
    for _ in 0..UPLOADS {
        tokio::time::timeout(Duration::from_secs(60), started_rx.recv())
            .await
            .expect("every upload reached the upstream");
    }
    // Every upload has passed through llmtap and is waiting for its answer: what capture holds is in memory now.
    let peak = peak_rss_mib(tap.pid());
    release.send_replace(true);
    for s in sends {
        let status = tokio::time::timeout(Duration::from_secs(60), s)
            .await
            .expect("every upload answered");
        assert_eq!(status.unwrap(), 200);
    }
    upstream.abort();
    // Counted once per body whose capture was cut: every upload but (at most) the one that had the budget to
    // itself. (The outcome alone can read client_gone instead of truncated when a client closes as the last
    // bytes go out, so the count is what is asserted.)
    let cut = tap.metric("llmtap_capture_over_budget_total");
    let traces = tap.wait_for_traces(UPLOADS);
    let outcomes: Vec<&Value> = traces.iter().map(|t| &t["outcome"]).collect();
    assert!(
        cut >= UPLOADS as u64 - 1,
        "{cut} of {UPLOADS} uploads cut at the 4 MiB budget; outcomes {outcomes:?}"
    );
    assert!(
        peak < baseline + 96,
        "{UPLOADS} uploads of 16 MiB held {peak} MiB (baseline {baseline} MiB) with a 4 MiB capture budget"
    );
    assert_eq!(tap.metric("llmtap_capture_queue_bytes"), 0, "every charge given back");
}

/// Read from `stream` until the peer closes it; how long that took (None if still open at `limit`).
fn time_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut buf = [0u8; 4096];
    while started.elapsed() < limit {
        match stream.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return Some(started.elapsed()),
        }
    }
    None
}

/// The head of an HTTP/1.1 JSON POST to `path` with a body of `length` bytes, as raw bytes on the wire.
fn post_head(path: &str, length: usize) -> String {
    format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n")
}

/// A whole HTTP/1.1 chat completion request for `path`, as raw bytes on the wire.
fn chat_request(path: &str) -> String {
    post_head(path, CHAT_REQUEST.len()) + CHAT_REQUEST
}

/// One header byte every 300 ms on `stream` (for up to 18 s, or until the write fails): always something
/// arriving, never a complete header block.
fn dribble_a_header(stream: &TcpStream) -> std::thread::JoinHandle<()> {
    let mut writer = stream.try_clone().unwrap();
    std::thread::spawn(move || {
        for _ in 0..60 {
            if writer.write_all(b"x").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_dribbling_its_headers_is_cut_at_the_header_timeout() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config("[server]\nheader_read_timeout_secs = 2\n"), dir.path());
    let mut stream = TcpStream::connect(tap.addr).unwrap();
    stream
        .write_all(b"POST /local/v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .unwrap();
    let dribble = dribble_a_header(&stream);
    let closed = time_until_closed(&mut stream, Duration::from_secs(15));
    assert!(closed.is_some(), "still open after 15 s of dribbled headers");
    dribble.join().unwrap();
    assert!(upstream.seen().is_empty());
}

/// On a kept-alive connection each head gets the whole header timeout, counted from when the connection starts
/// waiting for it (hyper's rule): a first request that outlasts the timeout (a slow upstream) does not make the
/// second head's time run out early, and the second head, dribbled, is still cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_on_a_kept_alive_connection_gets_its_own_header_timeout() {
    let upstream = ScriptedUpstream::start(Arc::new(|seen| {
        if seen.path.ends_with("/slow") {
            std::thread::sleep(Duration::from_millis(3000));
        }
        Answer::Json(200, Bytes::from_static(CHAT_RESPONSE.as_bytes()), vec![])
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config("[server]\nheader_read_timeout_secs = 2\n"), dir.path());
    let mut stream = TcpStream::connect(tap.addr).unwrap();
    let request = chat_request("/local/v1/slow");
    // The first head arrives in two parts, so its timeout is armed (and expires while the upstream is slow):
    // the rest is sent once llmtap has read the first part.
    stream.write_all(&request.as_bytes()[..20]).unwrap();
    common::wait::poll_until("llmtap to read the head's first part", Duration::from_secs(10), || {
        common::wait::peer_read_all(&stream)
    });
    stream.write_all(&request.as_bytes()[20..]).unwrap();
    let mut reply = [0u8; 4096];
    assert!(
        stream.read(&mut reply).unwrap() > 0,
        "the slow first request is answered"
    );
    stream
        .write_all(b"POST /local/v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .unwrap();
    let dribble = dribble_a_header(&stream);
    let closed = time_until_closed(&mut stream, Duration::from_secs(15)).expect("the dribbled second head is cut");
    assert!(
        closed >= Duration::from_millis(1900),
        "cut {closed:?} after the first answer, before its own timeout"
    );
    dribble.join().unwrap();
    assert_eq!(upstream.seen().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_with_nothing_in_flight_is_closed_at_the_idle_timeout() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config("[server]\nidle_timeout_secs = 1\n"), dir.path());
    let mut stream = TcpStream::connect(tap.addr).unwrap();
    let request = chat_request("/local/v1/chat/completions");
    stream.write_all(request.as_bytes()).unwrap();
    // The response arrives, the connection stays open for the next request ... until it has been idle 1 s.
    let closed = time_until_closed(&mut stream, Duration::from_secs(15)).expect("closed when idle");
    assert!(closed < Duration::from_secs(10), "{closed:?}");
    assert_eq!(upstream.seen().len(), 1);
}

/// A hung upstream keeps a request in flight longer than the idle timeout: the connection is not idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_waiting_for_its_answer_is_not_idle() {
    let upstream = ScriptedUpstream::start(Arc::new(|seen| {
        if seen.path.ends_with("/slow") {
            std::thread::sleep(Duration::from_millis(3500));
        }
        Answer::Json(200, Bytes::from_static(CHAT_RESPONSE.as_bytes()), vec![])
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config("[server]\nidle_timeout_secs = 1\n"), dir.path());
    let reply = common::send(
        &common::client(),
        "POST",
        &tap.url("/local/v1/slow"),
        &[],
        CHAT_REQUEST.into(),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(&reply.body[..], CHAT_RESPONSE.as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_limit_new_clients_wait_until_a_connection_closes() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let (tap, log) = Llmtap::start_capturing_log(&upstream.config("[server]\nmax_connections = 3\n"), dir.path());
    let held: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(tap.addr).unwrap()).collect();
    // llmtap accepted all three and stopped accepting: it says so when it reaches the limit.
    common::wait::poll_until_async("the limit to be reached", Duration::from_secs(10), || {
        log.lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("Connection limit reached"))
    })
    .await;
    let url = tap.url("/local/v1/chat/completions");
    let waiting =
        tokio::spawn(async move { common::send(&common::client(), "POST", &url, &[], CHAT_REQUEST.into()).await });
    // The fourth client is connected, and waits in the listen backlog, not accepted.
    common::wait::poll_until_async("the fourth client in the backlog", Duration::from_secs(10), || {
        common::wait::accept_backlog(tap.addr) == 1
    })
    .await;
    assert!(
        !waiting.is_finished(),
        "a fourth connection was served while three were open"
    );
    assert!(upstream.seen().is_empty());
    drop(held);
    let reply = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("served once a connection closed")
        .unwrap();
    assert_eq!(reply.status, 200);
    assert!(tap.metric("llmtap_connections_at_limit_total") >= 1);
}

/// Out of file descriptors, accept fails on every try: the failure is logged when it starts and then only
/// summarised, not once per failed accept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_failures_are_logged_once_per_episode_and_counted() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("llmtap.toml");
    std::fs::write(&config_path, upstream.config("")).unwrap();
    let stderr_path = dir.path().join("stderr.log");
    let mut child = common::clean_env(&mut std::process::Command::new("sh"))
        .arg("-c")
        .arg(format!(
            "ulimit -n 48 && exec {} serve --listen 127.0.0.1:0 --config {} --data-dir {} 2>{}",
            common::bin(),
            config_path.display(),
            dir.path().join("data").display(),
            stderr_path.display()
        ))
        // Each failure after the first is logged at debug level: the test sees the episode go on.
        .env("RUST_LOG", "warn,llmtap::proxy=debug")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    let addr: SocketAddr = line.trim().rsplit("http://").next().unwrap().parse().unwrap();
    // More idle connections than the process has descriptors: accepts start failing with EMFILE.
    let held: Vec<TcpStream> = (0..80).filter_map(|_| TcpStream::connect(addr).ok()).collect();
    common::wait::poll_until("the first accept failure", Duration::from_secs(15), || {
        std::fs::read_to_string(&stderr_path).is_ok_and(|log| log.contains("Accept failed"))
    });
    // The fault goes on until five more accepts have failed (the listener cannot serve /metrics meanwhile).
    common::wait::poll_until("five more accept failures", Duration::from_secs(15), || {
        std::fs::read_to_string(&stderr_path).is_ok_and(|log| log.matches("Accept retry failed").count() >= 5)
    });
    drop(held);
    // Descriptors come back as llmtap sees the held connections close; then it answers again.
    let mut metrics = String::new();
    common::wait::poll_until("llmtap to answer again", Duration::from_secs(20), || {
        let out = common::llmtap_command()
            .args(["status", "--addr", &addr.to_string()])
            .output()
            .unwrap();
        metrics = String::from_utf8(out.stdout).unwrap();
        out.status.success()
    });
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&stderr_path).unwrap();
    let logged = log.matches("Accept failed").count();
    let failures: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("llmtap_accept_errors_total"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        failures >= 5,
        "accept kept failing while descriptors were out: {failures}\n{metrics}"
    );
    assert_eq!(logged, 1, "one line for the episode, not one per failure:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_reaches_an_http1_only_upstream() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config(""), dir.path());
    let h2: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let req = Request::post(tap.url("/local/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(CHAT_REQUEST.as_bytes())))
        .unwrap();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], CHAT_RESPONSE.as_bytes());
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["outcome"], "complete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_never_leave_the_route() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config(""), dir.path());
    for path in [
        "/local/../x",
        "/local/v1/%2e%2e/%2E%2E/x",
        "/local/./v1/chat/completions",
    ] {
        let mut stream = TcpStream::connect(tap.addr).unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 400"), "{path}: {reply}");
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
}

/// The upstream sees the client's headers, not llmtap's additions: no `accept-encoding` the client did not
/// send, no `content-length: 0` on a bodiless GET or HEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_gets_no_header_the_client_did_not_send() {
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config(""), dir.path());
    for method in ["GET", "HEAD"] {
        let mut stream = TcpStream::connect(tap.addr).unwrap();
        stream
            .write_all(
                format!("{method} /local/v1/models HTTP/1.1\r\nhost: x\r\nx-mine: 1\r\nconnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).unwrap();
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        let mut names: Vec<&str> = s.headers.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["host", "x-mine"], "{} {:?}", s.method, s.headers);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_llmtap_within_the_grace_even_with_a_hung_upstream_and_keeps_the_exchange() {
    let upstream = ScriptedUpstream::start(Arc::new(|seen| {
        if seen.path.ends_with("/hang") {
            Answer::Hang
        } else {
            Answer::Json(200, Bytes::from_static(CHAT_RESPONSE.as_bytes()), vec![])
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream.config("[server]\nshutdown_grace_secs = 1\n");
    let mut tap = Llmtap::start(&config, dir.path());
    let client = common::client();
    assert_eq!(
        common::send(
            &client,
            "POST",
            &tap.url("/local/v1/chat/completions"),
            &[],
            CHAT_REQUEST.into()
        )
        .await
        .status,
        200
    );
    // An HTTP/1.1 client and an HTTP/2 one, each waiting on an upstream that never answers.
    let url = tap.url("/local/v1/hang");
    let h1 = tokio::spawn({
        let url = url.clone();
        async move {
            let _ = common::client()
                .request(
                    Request::post(url)
                        .body(Full::new(Bytes::from_static(CHAT_REQUEST.as_bytes())))
                        .unwrap(),
                )
                .await;
        }
    });
    let h2 = tokio::spawn(async move {
        let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http();
        let _ = client
            .request(
                Request::post(url)
                    .body(Full::new(Bytes::from_static(CHAT_REQUEST.as_bytes())))
                    .unwrap(),
            )
            .await;
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while upstream.seen().len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(upstream.seen().len(), 3, "both hung requests reached the upstream");
    let started = Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        let status = tap.terminate();
        (tap, status)
    });
    let (_tap, status) = tokio::time::timeout(Duration::from_secs(20), status)
        .await
        .expect("llmtap still running 20 s after SIGTERM with a 1 s grace")
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(12), "{:?}", started.elapsed());
    h1.abort();
    h2.abort();

    let tap = Llmtap::start(&config, dir.path());
    let traces = tap.wait_for_traces(3);
    let hung: Vec<_> = traces
        .iter()
        .filter(|t| t["path"].as_str().unwrap().ends_with("/hang"))
        .collect();
    assert_eq!(hung.len(), 2, "{traces:#?}");
    for t in hung {
        assert_eq!(t["outcome"], "client_gone");
        assert_eq!(t["request"]["model"], "m", "the request as captured");
    }
}

/// An upstream that answers each request as soon as it has its headers, then reads (and drops) its body before
/// the next request on the connection: a server rejecting an upload early, or one that does not need the body.
fn early_answering_upstream() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                loop {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if stream.read(&mut byte).unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHAT_RESPONSE}",
                        CHAT_RESPONSE.len()
                    );
                    if stream.write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                    let body = content_length(&String::from_utf8_lossy(&head)) as u64;
                    if std::io::copy(&mut (&mut stream).take(body), &mut std::io::sink()).unwrap_or(0) < body {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn content_length(head: &str) -> usize {
    head.lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or(0)
}

/// Reads one HTTP/1.1 response with a content-length from `stream`: (status line, body).
fn read_response(stream: &mut TcpStream) -> (String, Vec<u8>) {
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&data[..end]).into_owned();
            let length = content_length(&head);
            if data.len() >= end + 4 + length {
                let status = head.lines().next().unwrap_or_default().to_owned();
                return (status, data[end + 4..end + 4 + length].to_vec());
            }
        }
        let n = stream.read(&mut buf).expect("the response before the request's end");
        assert!(n > 0, "connection closed before the whole response");
        data.extend_from_slice(&buf[..n]);
    }
}

/// An upstream may answer before it has read the whole request. The client gets the answer as sent; the trace is
/// kept with what arrived, and says `truncated`, not `complete`: its request was still coming when the response
/// ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_ends_before_its_request_is_captured_as_truncated() {
    let upstream = early_answering_upstream();
    let config =
        format!("[upstreams.local]\nurl = \"http://{upstream}/prefix\"\napi = \"openai\"\n[api]\nlisten = \"off\"\n");
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config, dir.path());

    // The request's body is 1 MiB; the client sends its first 64 KiB, waits for the whole answer, then the rest.
    let body = {
        let pad = "x".repeat(1024 * 1024 - CHAT_REQUEST.len() - 20);
        format!(r#"{{"model":"m","pad":"{pad}","messages":[{{"role":"user","content":"hi"}}]}}"#)
    };
    let mut stream = TcpStream::connect(tap.addr).unwrap();
    stream
        .write_all(post_head("/local/v1/chat/completions", body.len()).as_bytes())
        .unwrap();
    stream.write_all(&body.as_bytes()[..64 * 1024]).unwrap();
    let (status, answer) = read_response(&mut stream);
    assert!(status.contains(" 200"), "{status}");
    assert_eq!(
        answer,
        CHAT_RESPONSE.as_bytes(),
        "the client gets the upstream's answer as sent"
    );
    let _ = stream.write_all(&body.as_bytes()[64 * 1024..]);
    drop(stream);

    let traces = tap.wait_for_traces(1);
    assert_eq!(traces.len(), 1, "{traces:?}");
    assert_eq!(traces[0]["outcome"], "truncated", "{}", traces[0]);
    assert_eq!(traces[0]["status"], 200);
    assert_eq!(tap.metric("llmtap_capture_truncated_total"), 1);

    // A call answered after its whole request is still complete.
    let client = common::client();
    let reply = common::send(
        &client,
        "POST",
        &tap.url("/local/v1/chat/completions"),
        &[],
        CHAT_REQUEST.into(),
    )
    .await;
    assert_eq!(reply.status, 200);
    let traces = tap.wait_for_traces(2);
    let outcomes: Vec<&str> = traces.iter().filter_map(|t| t["outcome"].as_str()).collect();
    assert!(outcomes.contains(&"complete"), "{outcomes:?}");
}

/// `mib` MiB of NUL bytes, gzip: ~1 KiB per MiB on the wire. As JSON text a NUL is six bytes (`\u0000`), so a
/// body of them that is kept as text grows sixfold.
fn gzip_zeros(mib: usize) -> Vec<u8> {
    let mut member = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    member.write_all(&vec![0u8; 1 << 20]).unwrap();
    member.finish().unwrap().repeat(mib)
}

/// The high-water mark of a process's resident memory (VmHWM), in KiB.
fn hwm_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

const BOMB_CAP: usize = 8 << 20;

/// An upstream answering `/bomb` with `bomb` (gzip) and anything else with a chat completion, and llmtap in
/// front of it with `BOMB_CAP` as its capture cap and `extra` config, warmed up by one ordinary call (so that
/// what the first exchange sets up is in the baseline).
async fn bomb_setup(bomb: Bytes, extra: &str) -> (ScriptedUpstream, Llmtap, tempfile::TempDir) {
    let upstream = ScriptedUpstream::start(Arc::new(move |seen| {
        if seen.path.ends_with("/bomb") {
            Answer::Json(200, bomb.clone(), vec![("content-encoding", "gzip")])
        } else {
            Answer::Json(200, Bytes::from_static(CHAT_RESPONSE.as_bytes()), vec![])
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream.config(&format!("[capture]\nmax_body_bytes = {BOMB_CAP}\n{extra}"));
    let tap = Llmtap::start(&config, dir.path());
    let reply = common::send(
        &common::client(),
        "POST",
        &tap.url("/local/v1/chat/completions"),
        &[],
        CHAT_REQUEST.into(),
    )
    .await;
    assert_eq!(reply.status, 200);
    tap.wait_for_traces(1);
    (upstream, tap, dir)
}

/// A compression bomb of NUL bytes (128 MiB inflated, 128 KiB on the wire), as a response and as a request: the
/// peak memory each adds stays within one and a half times the capture cap, whatever it inflates to and however its
/// text grows when kept as JSON (decoding, escaping, parsing, redaction, chunking and compression for the store).
/// Measured: about 9.6 MiB for the response bomb, 10 MiB with the request bomb after it, with the 8 MiB cap (the
/// decoded body, escaped in its own buffer, and the decoder's first megabyte). Before: 19-25 MiB, the decoded
/// body and its escaped copy side by side, each grown in 2 MiB huge pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compression_bomb_costs_a_bounded_multiple_of_the_capture_cap() {
    let bomb = Bytes::from(gzip_zeros(128));
    let (_upstream, tap, _dir) = bomb_setup(bomb.clone(), "").await;
    let client = common::client();
    let base = hwm_kib(tap.pid());
    // Issue 36 asks for at most twice the cap. Asserted: one and a half times, that is the cap (the decoded
    // body, escaped in place) and half of it again for what processing a large body allocates besides its text
    // (the decoder's first megabyte before it reserves the cap, its state, the 64 KiB view an adapter reads, the
    // store's compression context). The decoded body and an escaped copy side by side (twice the cap, ~16.5 MiB
    // measured even without huge pages) do not fit.
    let bound = (3 * BOMB_CAP as u64 / 2) / 1024;

    let reply = common::send(&client, "POST", &tap.url("/local/v1/bomb"), &[], CHAT_REQUEST.into()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, bomb, "the client gets the upstream's bytes");
    let traces = tap.wait_for_traces(2);
    assert_eq!(trace_for(&traces, "/bomb")["outcome"], "truncated");
    let response_bomb = hwm_kib(tap.pid()) - base;

    let reply = common::send(
        &client,
        "POST",
        &tap.url("/local/v1/chat/completions"),
        &[("content-type", "application/json"), ("content-encoding", "gzip")],
        bomb.to_vec(),
    )
    .await;
    assert_eq!(reply.status, 200);
    let traces = tap.wait_for_traces(3);
    let both = hwm_kib(tap.pid()) - base;
    let outcomes: Vec<(&Value, &Value)> = traces.iter().map(|t| (&t["path"], &t["outcome"])).collect();
    assert_eq!(
        traces.iter().filter(|t| t["outcome"] == "truncated").count(),
        2,
        "{outcomes:?}"
    );
    println!(
        "peak RSS growth: {} KiB with the response bomb, {} KiB with the request bomb after it ({} MiB cap)",
        response_bomb,
        both,
        BOMB_CAP >> 20
    );
    assert!(
        response_bomb <= bound && both <= bound,
        "peak RSS grew by {} MiB with a response bomb, {} MiB with it and a request bomb after it; the bound is \
         {} MiB (one and a half times the {} MiB cap)",
        response_bomb / 1024,
        both / 1024,
        bound / 1024,
        BOMB_CAP >> 20
    );
}

/// Twenty bombs at once: what their bodies decode to counts against `capture.queue_bytes` while it waits for
/// the store, so the peak stays within that budget and one bomb being decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_compression_bombs_stay_within_the_capture_budget() {
    const BOMBS: usize = 20;
    const QUEUE_BYTES: u64 = 32 << 20;
    let bomb = Bytes::from(gzip_zeros(64));
    let (_upstream, tap, _dir) = bomb_setup(bomb.clone(), &format!("queue_bytes = {QUEUE_BYTES}\n")).await;
    let base = hwm_kib(tap.pid());
    let mut sends = Vec::new();
    for _ in 0..BOMBS {
        let url = tap.url("/local/v1/bomb");
        sends.push(tokio::spawn(async move {
            common::send(&common::client(), "POST", &url, &[], CHAT_REQUEST.into()).await
        }));
    }
    for s in sends {
        let reply = s.await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, bomb);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while tap.metric("llmtap_processed_total") < 1 + BOMBS as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let traces = tap.wait_for_traces(1 + BOMBS);
    assert_eq!(traces.len(), 1 + BOMBS);
    let growth = hwm_kib(tap.pid()) - base;
    println!("peak RSS growth: {growth} KiB with {BOMBS} concurrent bombs");
    // One bomb being decoded costs at most 1.5x the cap (see `a_compression_bomb_costs_…`); measured: ~18 MiB.
    let bound = (QUEUE_BYTES + 3 * BOMB_CAP as u64 / 2) / 1024;
    assert!(
        growth <= bound,
        "{BOMBS} concurrent bombs grew peak RSS by {} MiB; the bound is {} MiB (the {} MiB capture budget and \
         one bomb decoding, 1.5 times the cap)",
        growth / 1024,
        bound / 1024,
        QUEUE_BYTES >> 20
    );
    assert_eq!(tap.metric("llmtap_capture_queue_bytes"), 0, "every charge given back");
}

/// Established TCP connections a process holds, either side (client and upstream connections): its socket
/// descriptors looked up in the kernel's TCP table (other sockets, such as a runtime's internal pairs, come and
/// go on their own).
fn open_sockets(pid: u32) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| {
            let t = t.to_string_lossy().into_owned();
            Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // State 01 is ESTABLISHED; the tenth field is the socket's inode.
            fields.get(3) == Some(&"01") && fields.get(9).is_some_and(|inode| inodes.contains(*inode))
        })
        .count()
}

/// Polls `done` every 100 ms until it holds or `limit` passes; whether it held.
fn eventually(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Clients that send complete headers and one byte of a 100-byte body, then nothing: each connection (and the
/// upstream connection it holds) is closed once the body has stalled for the body-read timeout, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stalls_its_request_body_is_cut_at_the_body_read_timeout() {
    const CLIENTS: usize = 20;
    let upstream = ScriptedUpstream::start(ok_script()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream.config("[server]\nbody_read_timeout_secs = 1\n"), dir.path());
    let baseline = open_sockets(tap.pid());
    let mut streams: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| {
            let mut stream = TcpStream::connect(tap.addr).unwrap();
            stream
                .write_all((post_head("/local/v1/chat/completions", 100) + "{").as_bytes())
                .unwrap();
            stream
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || open_sockets(tap.pid())
            >= baseline + 2 * CLIENTS),
        "each stalled upload holds its connection and an upstream connection"
    );
    for stream in &mut streams {
        let closed = time_until_closed(stream, Duration::from_secs(15));
        assert!(closed.is_some(), "a stalled upload still open after 15 s");
    }
    assert!(
        eventually(Duration::from_secs(10), || tap
            .metric("llmtap_body_read_timeouts_total")
            == CLIENTS as u64),
        "{} of {CLIENTS} counted",
        tap.metric("llmtap_body_read_timeouts_total")
    );
    assert!(
        eventually(Duration::from_secs(10), || open_sockets(tap.pid()) <= baseline),
        "llmtap holds {} sockets, {baseline} before the uploads",
        open_sockets(tap.pid())
    );
    // A client that keeps sending is not cut however long its upload takes.
    let mut stream = TcpStream::connect(tap.addr).unwrap();
    stream
        .write_all(post_head("/local/v1/chat/completions", CHAT_REQUEST.len()).as_bytes())
        .unwrap();
    for byte in CHAT_REQUEST.as_bytes().chunks(CHAT_REQUEST.len() / 6 + 1) {
        std::thread::sleep(Duration::from_millis(400));
        stream.write_all(byte).unwrap();
    }
    let (status, body) = read_response(&mut stream);
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body, CHAT_RESPONSE.as_bytes());
}

/// A client that sends its request and then reads nothing of a large response: its connection is closed once
/// nothing has been taken for the send timeout, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_its_response_is_cut_at_the_send_timeout() {
    // Far more than the loopback socket buffers on both sides hold.
    let big = Bytes::from(vec![b' '; 64 << 20]);
    let upstream = ScriptedUpstream::start(Arc::new(move |_| Answer::Json(200, big.clone(), vec![]))).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream.config("[server]\nsend_timeout_secs = 1\n[capture]\nmax_body_bytes = 1048576\n"),
        dir.path(),
    );
    let baseline = open_sockets(tap.pid());
    let mut stream = TcpStream::connect(tap.addr).unwrap();
    stream
        .write_all(chat_request("/local/v1/chat/completions").as_bytes())
        .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || tap.metric("llmtap_send_timeouts_total")
            == 1),
        "a client reading nothing was not cut"
    );
    assert!(
        eventually(Duration::from_secs(10), || open_sockets(tap.pid()) <= baseline),
        "llmtap holds {} sockets, {baseline} before the request",
        open_sockets(tap.pid())
    );
    // What the socket buffers held arrives, then the end.
    assert!(time_until_closed(&mut stream, Duration::from_secs(15)).is_some());
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["outcome"], "client_gone");
}
