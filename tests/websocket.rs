//! WebSocket upgrades through the real binary: relayed byte for byte both ways, captured per message off the
//! data path (Responses WebSocket mode, Realtime, or raw), bounded like bodies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::ws::{
    Recording, WsUpstream, after_handshake, realtime_text, realtime_usage, responses_text, responses_usage,
};
use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

type Client = WebSocketStream<Recording<TcpStream>>;

/// What the client read and wrote.
type Recorded = (Arc<Mutex<Vec<u8>>>, Arc<Mutex<Vec<u8>>>);

struct Opened {
    ws: Client,
    read: Arc<Mutex<Vec<u8>>>,
    written: Arc<Mutex<Vec<u8>>>,
}

async fn open(tap: &Llmtap, path: &str) -> Opened {
    let stream = Recording::new(TcpStream::connect(tap.addr).await.unwrap());
    let (read, written) = (stream.read.clone(), stream.written.clone());
    let (ws, resp) = tokio_tungstenite::client_async(format!("ws://{}{}", tap.addr, path), stream)
        .await
        .unwrap();
    assert_eq!(resp.status(), 101);
    Opened { ws, read, written }
}

fn config(up: &WsUpstream, extra: &str) -> String {
    format!(
        "[upstreams.openai]\nurl = \"http://{}\"\n[api]\nlisten = \"off\"\n{extra}",
        up.addr
    )
}

/// Close the client and wait until the upstream has seen its connection end.
async fn close(mut ws: Client, up: &WsUpstream, conn: usize) {
    ws.close(None).await.unwrap();
    while let Some(Ok(_)) = ws.next().await {}
    let deadline = Instant::now() + Duration::from_secs(10);
    while !up.conns()[conn].closed.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the upstream's connection did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What each side wrote is what the other read, after the two handshakes (which llmtap rewrites: `host`).
fn assert_bytes_identical(client: &Recorded, up: &WsUpstream, conn: usize) {
    let upstream = &up.conns()[conn];
    let (client_written, client_read) = (client.1.lock().unwrap().clone(), client.0.lock().unwrap().clone());
    let (up_written, up_read) = (
        upstream.written.lock().unwrap().clone(),
        upstream.read.lock().unwrap().clone(),
    );
    assert!(
        after_handshake(&client_written) == after_handshake(&up_read),
        "client → upstream bytes differ ({} vs {} bytes)",
        after_handshake(&client_written).len(),
        after_handshake(&up_read).len()
    );
    assert!(
        after_handshake(&up_written) == after_handshake(&client_read),
        "upstream → client bytes differ ({} vs {} bytes)",
        after_handshake(&up_written).len(),
        after_handshake(&client_read).len()
    );
    assert!(!after_handshake(&up_written).is_empty());
}

async fn next_json(ws: &mut Client) -> Value {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("an event in time")
        {
            Some(Ok(Message::Text(t))) => return serde_json::from_str(&t).unwrap(),
            Some(Ok(_)) => continue,
            other => panic!("socket ended: {other:?}"),
        }
    }
}

/// Events until `n` terminal events (`kind`) have arrived; returns the terminal events.
async fn until(ws: &mut Client, kind: &str, n: usize) -> Vec<Value> {
    let mut done = Vec::new();
    while done.len() < n {
        let e = next_json(ws).await;
        if e["type"] == kind {
            done.push(e);
        }
    }
    done
}

fn header<'a>(trace: &'a Value, side: &str, name: &str) -> Option<&'a str> {
    trace["headers"][side][name].as_str()
}

#[tokio::test]
async fn any_other_websocket_is_relayed_byte_for_byte_and_kept_raw_with_a_10_mib_frame_cut_and_marked() {
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config(&up, "[capture]\nmax_body_bytes = 1048576\n"), dir.path());
    let mut c = open(&tap, "/openai/v1/echo?x=1").await;
    let big: Vec<u8> = (0..10 << 20).map(|i| (i % 251) as u8).collect();
    c.ws.send(Message::text("hello")).await.unwrap();
    c.ws.send(Message::binary(big.clone())).await.unwrap();
    c.ws.send(Message::text("bye")).await.unwrap();
    let mut echoed = Vec::new();
    while echoed.len() < 3 {
        if let m @ (Message::Text(_) | Message::Binary(_)) = c.ws.next().await.unwrap().unwrap() {
            echoed.push(m);
        }
    }
    assert_eq!(echoed[1].clone().into_data().len(), big.len());
    assert_eq!(echoed[2].to_text().unwrap(), "bye");
    let Opened { ws, read, written } = c;
    close(ws, &up, 0).await;
    assert_bytes_identical(&(read, written), &up, 0);
    assert_eq!(up.conns()[0].path, "/v1/echo?x=1");

    let traces = tap.wait_for_traces(1);
    let t = traces
        .iter()
        .find(|t| t["path"] == "/v1/echo?x=1")
        .expect("the socket's raw trace");
    assert_eq!(t["api"], "other");
    assert_eq!(t["outcome"], "truncated", "the 10 MiB message is over the cap: {t:#}");
    assert_eq!(header(t, "request", "x-llmtap-websocket"), Some("raw"));
    let request = t["request"].as_str().unwrap_or_default();
    assert!(request.starts_with("hello\n<binary 10485760 bytes>"), "{request:.200}");
    let response = t["response"].as_str().unwrap_or_default();
    assert!(response.starts_with("hello\n"), "{response:.200}");
    assert!(t["bytes"]["request"].as_u64().unwrap() >= 10 << 20, "{t:#}");
}

#[tokio::test]
async fn responses_websocket_mode_turns_are_traces_with_their_whole_chained_request_across_two_streams() {
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config(&up, ""), dir.path());
    let mut c = open(&tap, "/openai/v1/responses").await;
    let create = |stream: &str, input: Value, previous: Option<&str>| {
        let mut e = json!({"type": "response.create", "model": "gpt-test", "stream_id": stream, "input": input,
            "instructions": "You are terse.", "store": false});
        if let Some(p) = previous {
            e["previous_response_id"] = json!(p);
        }
        Message::text(e.to_string())
    };
    let first_a = json!([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "[[hold]] first question A"}]}]);
    // Lane a's first response is held until lane b's is answered: their events interleave on the socket.
    c.ws.send(create("a", first_a, None)).await.unwrap();
    c.ws.send(create("b", json!("first question B"), None)).await.unwrap();
    let done = until(&mut c.ws, "response.completed", 2).await;
    let id_of = |stream: &str| {
        done.iter()
            .find(|e| e["stream_id"] == stream)
            .map(|e| e["response"]["id"].as_str().unwrap().to_owned())
            .unwrap()
    };
    let (a1, b1) = (id_of("a"), id_of("b"));
    assert_eq!((a1.as_str(), b1.as_str()), ("resp_1", "resp_2"));
    let second_a =
        json!([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "second question A"}]}]);
    c.ws.send(create("a", second_a, Some(&a1))).await.unwrap();
    until(&mut c.ws, "response.completed", 1).await;
    c.ws.send(create("b", json!("second question B"), Some(&b1)))
        .await
        .unwrap();
    until(&mut c.ws, "response.completed", 1).await;
    let Opened { ws, read, written } = c;
    close(ws, &up, 0).await;
    assert_bytes_identical(&(read, written), &up, 0);

    let traces: Vec<Value> = tap
        .wait_for_traces(4)
        .into_iter()
        .filter(|t| t["api"] == "openai.responses")
        .collect();
    assert_eq!(traces.len(), 4, "{traces:#?}");
    let by_response = |n: u64| {
        traces
            .iter()
            .find(|t| t["response"]["id"] == format!("resp_{n}").as_str())
            .unwrap_or_else(|| panic!("no trace for resp_{n}: {traces:#?}"))
    };
    for n in 1..=4 {
        let t = by_response(n);
        assert_eq!(t["outcome"], "complete", "{t:#}");
        assert_eq!(t["streamed"], true);
        assert_eq!(t["model"], "gpt-test");
        let (input, output, cached) = responses_usage(n);
        assert_eq!(t["usage"]["input"], input, "{t:#}");
        assert_eq!(t["usage"]["output"], output);
        assert_eq!(t["usage"]["cache_read"], cached);
        assert!(t["response"].to_string().contains(&responses_text(n)));
        assert!(t["request"].get("stream_id").is_none());
    }
    // The second turn of each lane: the whole conversation, rebuilt from the chain, without the server-side id.
    for (n, previous, texts) in [
        (
            3,
            "resp_1",
            ["[[hold]] first question A", "Answer 1.", "second question A"],
        ),
        (4, "resp_2", ["first question B", "Answer 2.", "second question B"]),
    ] {
        let t = by_response(n);
        let input = t["request"]["input"].as_array().unwrap();
        assert_eq!(input.len(), 3, "{t:#}");
        for (item, text) in input.iter().zip(texts) {
            assert!(item.to_string().contains(text), "{item} lacks {text}");
        }
        assert_eq!(input[1]["role"], "assistant");
        assert!(t["request"].get("previous_response_id").is_none());
        let marked = format!("previous_response_id={previous}");
        assert_eq!(header(t, "request", "x-llmtap-reconstructed"), Some(marked.as_str()));
    }
    assert_eq!(header(by_response(1), "request", "x-llmtap-reconstructed"), None);

    // Derivation as for HTTP calls: one trajectory per lane, each with its two agent steps.
    let trajectories = tap.steps_by_trajectory();
    assert_eq!(trajectories.len(), 2, "{trajectories:#?}");
    for steps in trajectories.values() {
        let contents: Vec<(&str, &str)> = steps
            .iter()
            .map(|s| (s["role"].as_str().unwrap(), s["content"].as_str().unwrap_or("")))
            .collect();
        let lane = if contents[0].1.contains('A') {
            (1, 3, "A")
        } else {
            (2, 4, "B")
        };
        let (first, second, name) = lane;
        let (t1, t2) = (responses_text(first), responses_text(second));
        let expected = [
            ("user", format!("first question {name}")),
            ("agent", t1),
            ("user", format!("second question {name}")),
            ("agent", t2),
        ];
        assert_eq!(contents.len(), 4, "{contents:?}");
        for ((role, content), (want_role, want)) in contents.iter().zip(&expected) {
            assert_eq!(role, want_role, "{contents:?}");
            assert!(content.ends_with(want.as_str()), "{contents:?}");
        }
    }
    assert_eq!(up.http_requests.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_realtime_session_is_one_trace_per_response_with_its_usage_and_the_socket_as_session() {
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config(&up, ""), dir.path());
    let mut c = open(&tap, "/openai/v1/realtime?model=gpt-realtime").await;
    assert_eq!(next_json(&mut c.ws).await["type"], "session.created");
    let say = |text: &str| {
        Message::text(
            json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]}})
            .to_string(),
        )
    };
    let respond =
        Message::text(json!({"type": "response.create", "response": {"output_modalities": ["text"]}}).to_string());
    c.ws.send(say("first realtime question")).await.unwrap();
    c.ws.send(respond.clone()).await.unwrap();
    until(&mut c.ws, "response.done", 1).await;
    c.ws.send(say("second realtime question")).await.unwrap();
    c.ws.send(respond).await.unwrap();
    until(&mut c.ws, "response.done", 1).await;
    let Opened { ws, read, written } = c;
    close(ws, &up, 0).await;
    assert_bytes_identical(&(read, written), &up, 0);

    let traces: Vec<Value> = tap
        .wait_for_traces(2)
        .into_iter()
        .filter(|t| t["api"] == "openai.responses")
        .collect();
    assert_eq!(traces.len(), 2, "{traces:#?}");
    for n in 1..=2u64 {
        let t = traces
            .iter()
            .find(|t| t["response"]["id"] == format!("resp_rt{n}").as_str())
            .unwrap_or_else(|| panic!("{traces:#?}"));
        let (input, output, cached) = realtime_usage(n);
        assert_eq!(t["outcome"], "complete", "{t:#}");
        assert_eq!(t["usage"]["input"], input, "{t:#}");
        assert_eq!(t["usage"]["output"], output);
        assert_eq!(t["usage"]["cache_read"], cached);
        assert_eq!(t["model"], "gpt-realtime");
        assert_eq!(t["request"]["instructions"], "Be brief.");
        assert!(t["response"].to_string().contains(&realtime_text(n)));
        assert_eq!(header(t, "request", "x-llmtap-websocket"), Some("realtime"));
        assert_eq!(t["session_id"], "sess_rt1", "{t:#}");
    }
    let second = traces.iter().find(|t| t["response"]["id"] == "resp_rt2").unwrap();
    let input = second["request"]["input"].to_string();
    for text in ["first realtime question", &realtime_text(1), "second realtime question"] {
        assert!(input.contains(text), "{input}");
    }
}

/// The OpenAI Python SDK's own WebSocket clients (`responses.connect()`, `realtime.connect()`, on the `websockets`
/// package, which offers permessage-deflate) work through llmtap by `OPENAI_BASE_URL` alone and are captured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_sdk_websocket_clients_work_through_llmtap_and_are_captured() {
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config(&up, ""), dir.path());
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/websocket.py");
    let base = format!("http://{}/openai/v1", tap.addr);
    let py = common::clients::python();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(py)
            .arg(script)
            .env("OPENAI_BASE_URL", base)
            .env("OPENAI_API_KEY", "sk-test-WSSECRET-openai")
            .env("OPENAI_MAX_RETRIES", "0")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "SDK script failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["responses_websocket"]["ids"], json!(["resp_1", "resp_2"]));
    assert_eq!(
        r["responses_websocket"]["texts"],
        json!([responses_text(1), responses_text(2)])
    );
    assert_eq!(r["realtime"]["texts"], json!([realtime_text(1), realtime_text(2)]));
    assert_eq!(
        r["realtime"]["usage"],
        json!([realtime_usage(1).0, realtime_usage(2).0])
    );
    assert_eq!(up.http_requests.load(Ordering::SeqCst), 0, "no HTTP fallback");

    let traces = tap.wait_for_traces(4);
    assert_eq!(traces.len(), 4, "{traces:#?}");
    let second = traces.iter().find(|t| t["response"]["id"] == "resp_2").unwrap();
    let input = second["request"]["input"].to_string();
    for text in ["sdk first question", &responses_text(1), "sdk second question"] {
        assert!(input.contains(text), "{input}");
    }
    assert_eq!(second["usage"]["input"], responses_usage(2).0);
    let rt2 = traces.iter().find(|t| t["response"]["id"] == "resp_rt2").unwrap();
    assert!(rt2["request"]["input"].to_string().contains("sdk realtime first"));
    assert_eq!(rt2["usage"]["output"], realtime_usage(2).1);
    // The key reached the upstream and never the store.
    let conn = &up.conns()[0];
    assert!(
        conn.headers
            .iter()
            .any(|(k, v)| k == "authorization" && v.contains("WSSECRET"))
    );
    let stored = serde_json::to_string(&traces).unwrap();
    assert!(!stored.contains("WSSECRET"), "the API key was stored");
}

/// One frame as RFC 6455 lays it out (for the hand-built peers below).
fn frame(fin: bool, rsv1: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut f = vec![(u8::from(fin) << 7) | (u8::from(rsv1) << 6) | opcode];
    let m = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => f.push(m | n as u8),
        n if n < 65536 => {
            f.push(m | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(m | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        Some(k) => f.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4])),
        None => f.extend_from_slice(payload),
    }
    if let Some(k) = mask {
        let at = f.len() - payload.len();
        f.splice(at..at, k);
    }
    f
}

/// A permessage-deflate message body: a sync flush with its `00 00 ff ff` removed; the compressor keeps its
/// window across messages (context takeover).
fn deflated(c: &mut flate2::Compress, text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 64);
    c.compress_vec(text.as_bytes(), &mut out, flate2::FlushCompress::Sync)
        .unwrap();
    out.truncate(out.len() - 4);
    out
}

async fn read_head(s: &mut TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).await.unwrap(), 1, "connection ended in the HTTP head");
        head.push(b[0]);
    }
    String::from_utf8(head).unwrap()
}

/// permessage-deflate with context takeover both ways (what Codex and the `websockets` package offer), messages
/// fragmented, pings between fragments: relayed as they were and captured inflated.
#[tokio::test]
async fn permessage_deflate_sockets_are_relayed_unchanged_and_captured_inflated() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let events = [
        json!({"type": "response.created", "response": {"id": "resp_z1", "status": "in_progress", "model": "gpt-test", "output": []}}),
        json!({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "Deflated answer."}),
        json!({"type": "response.completed", "response": {"id": "resp_z1", "status": "completed", "model": "gpt-test",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Deflated answer."}]}],
            "usage": {"input_tokens": 42, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 40}}}}),
    ];
    let mut c = flate2::Compress::new(flate2::Compression::default(), false);
    let mut server_bytes = Vec::new();
    for e in &events {
        let body = deflated(&mut c, &e.to_string());
        let (a, b) = body.split_at(body.len() / 2);
        server_bytes.extend(frame(false, true, 0x1, a, None));
        server_bytes.extend(frame(true, false, 0x9, b"ka", None));
        server_bytes.extend(frame(true, false, 0x0, b, None));
    }
    server_bytes.extend(frame(true, false, 0x8, &1000u16.to_be_bytes(), None));
    let upstream_read = Arc::new(Mutex::new(Vec::new()));
    let (to_send, seen) = (server_bytes.clone(), upstream_read.clone());
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let head = read_head(&mut s).await;
        let key = head
            .lines()
            .find_map(|l| {
                l.strip_prefix("sec-websocket-key: ")
                    .or_else(|| l.strip_prefix("Sec-WebSocket-Key: "))
            })
            .unwrap()
            .trim()
            .to_owned();
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
        let reply = format!(
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {accept}\r\nsec-websocket-extensions: permessage-deflate\r\n\r\n"
        );
        s.write_all(reply.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).await.unwrap();
        seen.lock().unwrap().extend_from_slice(&buf[..n]);
        s.write_all(&to_send).await.unwrap();
        loop {
            let n = s.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            seen.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });

    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &format!("[upstreams.openai]\nurl = \"http://{addr}\"\n[api]\nlisten = \"off\"\n"),
        dir.path(),
    );
    let mut s = TcpStream::connect(tap.addr).await.unwrap();
    s.write_all(
        b"GET /openai/v1/responses HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
          sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\
          sec-websocket-extensions: permessage-deflate; client_max_window_bits\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("sec-websocket-extensions: permessage-deflate"),
        "{head}"
    );
    let mut cc = flate2::Compress::new(flate2::Compression::default(), false);
    let create = json!({"type": "response.create", "model": "gpt-test", "input": "compressed question"});
    let mut client_bytes = frame(
        true,
        true,
        0x1,
        &deflated(&mut cc, &create.to_string()),
        Some([1, 2, 3, 4]),
    );
    client_bytes.extend(frame(true, false, 0x8, &1000u16.to_be_bytes(), Some([5, 6, 7, 8])));
    s.write_all(&client_bytes).await.unwrap();
    let mut got = vec![0u8; server_bytes.len()];
    s.read_exact(&mut got).await.unwrap();
    assert!(
        got == server_bytes,
        "the upstream's frames reached the client unchanged"
    );
    s.shutdown().await.unwrap();
    server.await.unwrap();
    assert!(
        *upstream_read.lock().unwrap() == client_bytes,
        "the client's frames reached the upstream unchanged"
    );

    let traces = tap.wait_for_traces(1);
    let t = &traces[0];
    assert_eq!(t["api"], "openai.responses");
    assert_eq!(t["outcome"], "complete", "{t:#}");
    assert_eq!(t["request"]["input"], "compressed question");
    assert_eq!(t["usage"]["input"], 42);
    assert_eq!(t["usage"]["cache_read"], 40);
    assert!(t["response"].to_string().contains("Deflated answer."), "{t:#}");
}

/// A client that never reads: the upstream's sending stalls as it would without llmtap (llmtap holds no more
/// than one read), and when the client then goes away mid-message the socket is still captured, cut and marked.
#[tokio::test]
async fn a_client_that_never_reads_back_pressures_the_upstream_and_a_socket_cut_mid_message_is_captured_marked() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config(&up, "[capture]\nmax_body_bytes = 1048576\n"), dir.path());
    let mut s = TcpStream::connect(tap.addr).await.unwrap();
    s.write_all(
        b"GET /openai/v1/echo HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
          sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
    )
    .await
    .unwrap();
    assert!(read_head(&mut s).await.starts_with("HTTP/1.1 101"));
    // 32 MiB in four fragments; the echo sends it all back, and this client reads none of it.
    const PART: usize = 8 << 20;
    let part = vec![7u8; PART];
    for i in 0..4u8 {
        let opcode = if i == 0 { 0x2 } else { 0x0 };
        s.write_all(&frame(i == 3, false, opcode, &part, Some([i, 1, 2, 3])))
            .await
            .unwrap();
    }
    // The echo's writing stops well short of the message: the client's socket and llmtap's are full.
    let written = || up.conns()[0].written.lock().unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = (0, Instant::now());
    loop {
        let now = written();
        if now != last.0 {
            last = (now, Instant::now());
        } else if now > 0 && last.1.elapsed() > Duration::from_millis(500) {
            break;
        }
        assert!(Instant::now() < deadline, "the upstream's writing never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        last.0 < 4 * PART,
        "the upstream wrote {} of {} bytes to a client that reads nothing",
        last.0,
        4 * PART
    );
    // Read a little, then go away mid-message.
    let mut some = vec![0u8; 1024];
    s.read_exact(&mut some).await.unwrap();
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !up.conns()[0].closed.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the upstream's connection did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let traces = tap.wait_for_traces(1);
    let t = &traces[0];
    assert_eq!(t["api"], "other");
    assert_eq!(t["outcome"], "truncated", "{t:#}");
    assert!(
        t["request"]
            .as_str()
            .unwrap_or_default()
            .starts_with("<binary 33554432 bytes>"),
        "{t:#}"
    );
    let health = healthz(&tap).await;
    assert_eq!(health, "ok\n", "llmtap still serves");
}

async fn healthz(tap: &Llmtap) -> String {
    let reply = send(&common::client(), "GET", &tap.url("/healthz"), &[], Vec::new()).await;
    String::from_utf8(reply.body.to_vec()).unwrap()
}

/// Codex CLI on its built-in OpenAI provider, `OPENAI_BASE_URL` at llmtap: it opens the Responses WebSocket
/// through llmtap and never falls back to HTTP (no `POST /v1/responses` in the upstream's log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cli_uses_the_responses_websocket_through_llmtap_without_http_fallback() {
    let codex = match std::env::var_os("LLMTAP_TEST_CODEX") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            common::clients::node_package("@openai/codex");
            common::clients::node_clients_dir().join("node_modules/.bin/codex")
        }
    };
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&config(&up, ""), dir.path());
    let home = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    // A provider entry like the built-in OpenAI one (Responses wire API, WebSocket on), pointed at llmtap: this
    // Codex release reads its base URL from config, not from `OPENAI_BASE_URL`.
    let provider = format!(
        "model_providers.llmtap={{name=\"llmtap\",base_url=\"http://{}/openai/v1\",wire_api=\"responses\",\
         env_key=\"OPENAI_API_KEY\",supports_websockets=true,request_max_retries=0,stream_max_retries=0}}",
        tap.addr
    );
    let mut command = std::process::Command::new(&codex);
    command
        .args([
            "exec",
            "--skip-git-repo-check",
            "--sandbox",
            "read-only",
            "-m",
            "gpt-test",
        ])
        .args([
            "-c",
            "model_provider=\"llmtap\"",
            "-c",
            &provider,
            "-c",
            "web_search=\"disabled\"",
        ])
        .arg("Say hi.")
        .current_dir(work.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CODEX_HOME", home.path())
        .env("OPENAI_BASE_URL", format!("http://{}/openai/v1", tap.addr))
        .env("OPENAI_API_KEY", "sk-test-CODEXSECRET");
    let run = common::clients::run_client(command, 40).await;
    // Codex may open with a warm-up request; its answer is the last response's text.
    let answered: u64 = run
        .stdout
        .trim()
        .strip_prefix("Answer ")
        .and_then(|n| n.trim_end_matches('.').parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "Codex did not print the scripted answer:\n{}\n{}",
                run.stdout, run.stderr
            )
        });
    let fallbacks: Vec<String> = up
        .http_log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("/responses"))
        .cloned()
        .collect();
    assert!(fallbacks.is_empty(), "Codex fell back to HTTP: {fallbacks:?}");
    assert!(up.conns().iter().any(|c| c.path.ends_with("/responses")));
    let traces = tap.wait_for_traces(answered as usize);
    let id = format!("resp_{answered}");
    let t = traces
        .iter()
        .find(|t| t["response"]["id"] == id.as_str())
        .unwrap_or_else(|| panic!("Codex's turn was not captured: {traces:#?}"));
    assert_eq!(t["api"], "openai.responses");
    assert_eq!(t["outcome"], "complete", "{t:#}");
    assert_eq!(t["usage"]["input"], responses_usage(answered).0, "{t:#}");
    assert!(t["request"]["input"].to_string().contains("Say hi."), "{t:#}");
    assert!(!serde_json::to_string(&traces).unwrap().contains("CODEXSECRET"));
}

/// An open socket keeps the `max_connections` slot of the connection it came on and is counted; at SIGTERM it is
/// closed once the HTTP connections are done (not after the whole grace), and what it carried is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_socket_holds_its_connection_slot_and_is_closed_and_stored_at_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = WsUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut tap = Llmtap::start(
        &config(&up, "[server]\nmax_connections = 2\nshutdown_grace_secs = 60\n"),
        dir.path(),
    );
    let mut c = open(&tap, "/openai/v1/echo").await;
    c.ws.send(Message::text("kept at shutdown")).await.unwrap();
    loop {
        if let Message::Text(t) = c.ws.next().await.unwrap().unwrap() {
            assert_eq!(t.as_str(), "kept at shutdown");
            break;
        }
    }
    // One slot left: `llmtap status` reads the metrics on a connection of its own, then closes it.
    let metrics = tap.metrics();
    let read = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<u64>().ok()))
    };
    assert_eq!(read("llmtap_websockets_open "), Some(1), "{metrics}");
    assert_eq!(read("llmtap_websockets_total "), Some(1), "{metrics}");

    // A second connection takes the last slot (its answer shows it was accepted); a third is not served while
    // the socket is open, however much the socket carries meanwhile, and is served once the second goes.
    let mut second = TcpStream::connect(tap.addr).await.unwrap();
    second
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), second.read_exact(&mut head))
        .await
        .expect("the second connection is served")
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let mut third = TcpStream::connect(tap.addr).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let (answered_tx, mut answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut answer = String::new();
        let _ = third.read_to_string(&mut answer).await;
        let _ = answered_tx.send(answer);
    });
    for i in 0..50 {
        let text = format!("round trip {i}");
        c.ws.send(Message::text(text.clone())).await.unwrap();
        loop {
            if let Message::Text(t) = c.ws.next().await.unwrap().unwrap() {
                assert_eq!(t.as_str(), text);
                break;
            }
        }
    }
    assert!(
        answered.try_recv().is_err(),
        "the third connection was served while the socket and the second held both slots"
    );
    drop(second);
    let answer = tokio::time::timeout(Duration::from_secs(10), answered)
        .await
        .expect("served once a slot is free")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // SIGTERM with the socket open: llmtap closes it rather than waiting out the 60 s grace, and stores it.
    let stopping = Instant::now();
    assert!(tap.terminate().success());
    assert!(
        stopping.elapsed() < Duration::from_secs(20),
        "shutdown waited {:?} for an open socket",
        stopping.elapsed()
    );
    assert!(
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(Ok(_)) = c.ws.next().await {}
        })
        .await
        .is_ok(),
        "the client's socket ends when llmtap stops"
    );
    let traces = tap.export("provider-traces", &[]);
    let t = traces
        .iter()
        .find(|t| t["path"] == "/v1/echo")
        .unwrap_or_else(|| panic!("the socket's trace is stored at shutdown: {traces:#?}"));
    for side in ["request", "response"] {
        let text = t[side].as_str().unwrap_or_default();
        assert!(text.starts_with("kept at shutdown"), "{side}: {t:#}");
    }
}
