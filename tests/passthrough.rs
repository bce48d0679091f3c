//! The data path through the real binary and real sockets: every recorded interaction is forwarded
//! byte-for-byte in both directions and captured as a provider trace whose reassembled response is right.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fixture_is_forwarded_unchanged_and_captured() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let fixtures = all_fixtures();
    assert!(
        fixtures.len() >= 90,
        "expected the whole corpus, found {}",
        fixtures.len()
    );

    for f in &fixtures {
        let reply = send_fixture(&client, &tap, f, &[]).await;
        assert_eq!(reply.status, f.status, "{}: status", f.name);
        assert_eq!(
            reply.body.as_ref(),
            f.body.as_slice(),
            "{}: client must receive the provider's bytes",
            f.name
        );
        for (k, v) in &f.response_headers {
            let got: Vec<&str> = reply
                .headers
                .get_all(k.as_str())
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            assert!(
                got.contains(&v.as_str()),
                "{}: response header {k}: {v} missing (got {got:?})",
                f.name
            );
        }
    }
    let received = up.received();
    assert_eq!(received.len(), fixtures.len());
    for r in &received {
        assert!(
            r.body_matched,
            "{:?}: upstream must receive the client's request body unchanged",
            r.fixture
        );
        assert!(r.headers.get("x-llmtap-session").is_none());
    }

    let traces = tap.wait_for_traces(fixtures.len());
    assert_eq!(traces.len(), fixtures.len());
    // Everything captured was taken off the queue: its byte budget is whole again.
    assert!(tap.metric("llmtap_captured_total") >= fixtures.len() as u64);
    let metrics = tap.metrics();
    assert!(
        metrics.lines().any(|l| l.trim() == "llmtap_capture_queue_bytes 0"),
        "queue bytes gauge back to 0:\n{metrics}"
    );
    let by_path: HashMap<String, Vec<&Value>> = traces.iter().fold(HashMap::new(), |mut m, t| {
        m.entry(t["path"].as_str().unwrap().to_owned()).or_default().push(t);
        m
    });
    // Traces are in request order, which is fixture order.
    for (f, t) in fixtures.iter().zip(&traces) {
        assert_eq!(t["path"].as_str().unwrap(), f.upstream_path, "{}", f.name);
        assert_eq!(t["status"].as_u64(), Some(f.status as u64), "{}", f.name);
        let outcome = if f.status >= 400 { "upstream_error" } else { "complete" };
        assert_eq!(t["outcome"], outcome, "{}", f.name);
        if f.status >= 400 {
            // 429, 529 and the rest: the exchange completed on the wire, and it is an error (not a complete call).
            let error = t["error"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: no error for {}", f.name, f.status));
            assert!(!error.is_empty(), "{}", f.name);
        }
        let req: Value = serde_json::from_slice(&f.request).unwrap();
        assert_eq!(t["request"], req, "{}: captured request", f.name);
        match f.kind {
            BodyKind::Json | BodyKind::Gzip => {
                assert_eq!(
                    Some(&t["response"]),
                    f.response_json.as_ref(),
                    "{}: captured response",
                    f.name
                );
                assert_eq!(t["streamed"], false);
            }
            BodyKind::Sse => {
                assert_eq!(t["streamed"], true, "{}", f.name);
                assert!(
                    t["response"].is_object(),
                    "{}: stream reassembled into an object",
                    f.name
                );
                assert!(t["timings"]["first_byte"].is_string());
            }
            BodyKind::Empty => assert!(t["response"].is_null()),
        }
    }
    assert!(!by_path.is_empty());
}

/// Streams are reassembled into the body a non-streamed call returns. The expected bodies are golden files
/// (tests/golden/reassembled), reviewed by hand; `LLMTAP_BLESS=1` rewrites them.
#[test]
fn reassembled_streams_match_golden_bodies() {
    use llmtap::capture::sse::parse_events;
    use llmtap::provider::adapter_for;
    let golden_dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/reassembled");
    let bless = std::env::var_os("LLMTAP_BLESS").is_some();
    let mut checked = 0;
    for f in all_fixtures().iter().filter(|f| f.kind == BodyKind::Sse) {
        let api = f.api();
        let adapter = adapter_for(api).unwrap_or_else(|| panic!("{}: no adapter", f.name));
        let text = String::from_utf8(f.body.clone()).unwrap();
        let got = adapter.reassemble(&parse_events(&text)).unwrap();
        let file = golden_dir.join(format!("{}.json", f.name.replace('/', "__")));
        if bless {
            std::fs::create_dir_all(&golden_dir).unwrap();
            std::fs::write(&file, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        }
        let want: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(got, want, "{}", f.name);
        checked += 1;
    }
    assert!(checked >= 30, "{checked}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_is_forwarded_event_by_event_as_it_arrives() {
    let up = Upstream::start(ReplayOptions {
        event_delay: Duration::from_millis(100),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let f = fixture("anthropic_messages/pydantic-ai__thinking_stream");
    let events = split_sse(&f.body).len();
    assert!(events > 10);
    let client = client();
    let req = http::Request::post(tap.url(&f.client_path))
        .header("x-replay-fixture", f.name.as_str())
        .body(http_body_util::Full::new(bytes::Bytes::from(f.request.clone())))
        .unwrap();
    let start = Instant::now();
    let resp = client.request(req).await.unwrap();
    let mut body = resp.into_body();
    let mut arrivals = Vec::new();
    let mut got = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            arrivals.push(start.elapsed());
            got.extend_from_slice(&data);
        }
    }
    assert_eq!(got, f.body);
    let total = *arrivals.last().unwrap();
    // The upstream needs (events-1) * 100 ms to send everything; the first event must not wait for the rest.
    assert!(total >= Duration::from_millis(100 * (events as u64 - 2)), "{total:?}");
    assert!(
        arrivals[0] < total / 4,
        "first chunk at {:?} of {total:?}: stream was buffered",
        arrivals[0]
    );
    assert!(
        arrivals.len() >= events / 2,
        "{} frames for {events} events",
        arrivals.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_are_refused_and_nothing_is_forwarded() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    for path in [
        "/",
        "/v1/chat/completions",
        "/evil.example.com/v1/messages",
        "/s/abc/v1/messages",
        "/http://x/",
    ] {
        let r = send(&client, "POST", &tap.url(path), &[], b"{}".to_vec()).await;
        assert_eq!(r.status, 404, "{path}");
        let err: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(err["error"]["type"], "llmtap_no_route");
    }
    // An absolute-form request naming another host is routed by its path only, never to that host.
    assert!(up.received().is_empty());
    assert_eq!(tap.metric("llmtap_requests_unrouted_total"), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_the_upstream_but_never_the_store() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let anthropic = &fixture("anthropic_messages/pydantic-ai__thinking_stream");
    let gemini = &fixture("gemini/pydantic-ai__stream_text");
    let openai = &fixture("openai_chat/openllmetry__tool_call_stream");

    let a = send_fixture(
        &client,
        &tap,
        anthropic,
        &[
            ("x-api-key", "sk-ant-SECRET-aaaa"),
            ("authorization", "Bearer sk-ant-SECRET-bbbb"),
        ],
    )
    .await;
    assert_eq!(a.status, 200);
    let o = send_fixture(
        &client,
        &tap,
        openai,
        &[
            ("authorization", "Bearer sk-SECRET-cccc"),
            ("cookie", "sess=SECRET-dddd"),
        ],
    )
    .await;
    assert_eq!(o.status, 200);
    let gpath = format!("{}&key=AIzaSECRET-eeee", gemini.client_path);
    let g = send(
        &client,
        "POST",
        &tap.url(&gpath),
        &[
            ("x-replay-fixture", gemini.name.as_str()),
            ("x-goog-api-key", "AIzaSECRET-ffff"),
        ],
        gemini.request.clone(),
    )
    .await;
    assert_eq!(g.status, 200);

    // The upstream got every credential.
    let rec = up.received();
    assert_eq!(rec[0].headers["x-api-key"], "sk-ant-SECRET-aaaa");
    assert_eq!(rec[1].headers["authorization"], "Bearer sk-SECRET-cccc");
    assert!(rec[2].path.contains("key=AIzaSECRET-eeee"));
    assert_eq!(rec[2].headers["x-goog-api-key"], "AIzaSECRET-ffff");

    let traces = tap.wait_for_traces(3);
    assert_eq!(traces.len(), 3);
    assert_eq!(traces[0]["headers"]["request"]["x-api-key"], "REDACTED");
    assert!(traces[2]["path"].as_str().unwrap().ends_with("key=REDACTED"));
    let mut tap = tap;
    tap.terminate();
    // Nothing in any file of the data directory (database, WAL, shm, the capture spill) holds a secret.
    for file in common::files_under(dir.path()) {
        let bytes = std::fs::read(&file).unwrap();
        let hay = String::from_utf8_lossy(&bytes);
        assert!(!hay.contains("SECRET"), "secret found in {}", file.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_cancels_upstream_and_keeps_a_trace() {
    let up = Upstream::start(ReplayOptions {
        event_delay: Duration::from_millis(100),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let req = http::Request::post(tap.url("/openai/v1/chat/completions"))
        .header("x-replay-scenario", "slow-stream")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(body);
    drop(client);

    let traces = tap.wait_for_traces(1);
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0]["outcome"], "client_gone");
    // Wait for the upstream to notice that llmtap dropped its side.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !up.received()[0].cancelled.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        up.received()[0].cancelled.load(std::sync::atomic::Ordering::SeqCst),
        "upstream request was not cancelled"
    );
    assert_eq!(tap.metric("llmtap_client_gone_total"), 1);
    let steps = tap.export("steps", &[]);
    let agent = steps.iter().find(|s| s["role"] == "agent").unwrap();
    assert_eq!(agent["status"], "cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_refused_and_reset_are_reported_and_captured() {
    let up = Upstream::start(ReplayOptions::default()).await;
    // A port with nothing listening.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let extra = format!("[upstreams.dead]\nurl = \"http://127.0.0.1:{dead_port}\"\napi = \"anthropic\"\n");
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, &extra), dir.path());
    let client = client();

    let r = send(
        &client,
        "POST",
        &tap.url("/dead/v1/messages"),
        &[],
        br#"{"model":"claude","messages":[]}"#.to_vec(),
    )
    .await;
    assert_eq!(r.status, 502);
    let err: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(err["error"]["type"], "llmtap_upstream_unreachable");

    // Reset mid-stream: the client sees the stream end abnormally; the trace says upstream_error.
    let req = http::Request::post(tap.url("/openai/v1/chat/completions"))
        .header("x-replay-scenario", "reset-midstream")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"gpt-4o","stream":true,"messages":[]}"#,
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let collected = resp.into_body().collect().await;
    assert!(
        collected.is_err(),
        "a reset upstream must not look like a complete response"
    );

    let traces = tap.wait_for_traces(2);
    assert_eq!(traces.len(), 2);
    assert_eq!(traces[0]["outcome"], "upstream_error");
    assert!(traces[0]["error"].as_str().unwrap().contains("upstream unreachable"));
    assert!(traces[0]["status"].is_null());
    assert_eq!(traces[1]["outcome"], "upstream_error");
    assert_eq!(traces[1]["response"]["choices"][0]["message"]["content"], "partial");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_survives_kill_9_and_restart() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let f1 = &fixture("openai_chat/openllmetry__chat_basic_gzip");
    let f2 = &fixture("gemini/pydantic-ai__thoughts_nonstream");
    let client = client();
    {
        let mut tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
        assert_eq!(send_fixture(&client, &tap, f1, &[]).await.status, 200);
        assert_eq!(tap.wait_for_traces(1).len(), 1);
        tap.kill9();
    }
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    assert_eq!(send_fixture(&client, &tap, f2, &[]).await.status, 200);
    let traces = tap.wait_for_traces(2);
    assert_eq!(traces.len(), 2);
    assert_eq!(traces[0]["upstream"], "openai");
    assert_eq!(traces[1]["upstream"], "gemini");
    assert_eq!(traces[0]["response"], *f1.response_json.as_ref().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_metadata_from_headers_and_path_is_recorded_and_stripped() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let f = &fixture("openai_chat/openllmetry__chat_basic_gzip");
    send_fixture(
        &client,
        &tap,
        f,
        &[
            ("x-llmtap-session", "run-7"),
            ("x-llmtap-agent", "coder"),
            ("x-llmtap-tags", "a, b"),
        ],
    )
    .await;
    let path = format!("/s/run-8/a/planner{}", f.client_path);
    let r = send(
        &client,
        "POST",
        &tap.url(&path),
        &[("x-replay-fixture", f.name.as_str())],
        f.request.clone(),
    )
    .await;
    assert_eq!(r.status, 200);
    let rec = up.received();
    assert!(
        rec.iter()
            .all(|r| r.headers.keys().all(|k| !k.as_str().starts_with("x-llmtap")))
    );
    assert_eq!(rec[1].path, f.upstream_path);
    let traces = tap.wait_for_traces(2);
    assert_eq!(traces[0]["metadata"]["session"], "run-7");
    assert_eq!(traces[0]["metadata"]["agent"], "coder");
    assert_eq!(traces[0]["metadata"]["tags"], serde_json::json!(["a", "b"]));
    assert_eq!(traces[1]["metadata"]["session"], "run-8");
    assert_eq!(traces[1]["metadata"]["agent"], "planner");
    assert_eq!(tap.export("provider-traces", &["--session", "run-8"]).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_are_served_too() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let f = fixture("anthropic_messages/pydantic-ai__thinking_stream");
    // HTTP/2 with prior knowledge over plain TCP (h2c).
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let req = http::Request::post(tap.url(&f.client_path))
        .header("x-replay-fixture", f.name.as_str())
        .body(http_body_util::Full::new(bytes::Bytes::from(f.request.clone())))
        .unwrap();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.as_ref(), f.body.as_slice());
    assert!(up.received()[0].body_matched);
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["outcome"], "complete");
    assert_eq!(traces[0]["streamed"], true);
}
