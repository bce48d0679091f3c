//! A scripted WebSocket upstream and a recording client, for the relay's tests.
//!
//! The upstream accepts upgrades on any path and speaks by path: `.../responses` is OpenAI's Responses
//! WebSocket mode (`response.create` → `response.created`, an output item, two text deltas, `response.completed`
//! with usage; `stream_id` echoed; a request whose input contains `[[hold]]` is answered only after the next
//! one, so the events of two lanes interleave), `.../realtime` is a Realtime session (`session.created` on
//! connect; `response.create` → ... → `response.done` with usage), anything else echoes every message.
//! A request that is not an upgrade is counted in [`WsUpstream::http_requests`] (a client's HTTP fallback).
//! Both ends record every byte they read and wrote, so tests compare the two sides of llmtap byte for byte.
//! [`WsUpstream::start_tls`] serves the same over TLS (a certificate for the provider hosts under a test CA), for
//! forward-proxy tests that send a provider host here with `[forward] resolve`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{Request as WsRequest, Response as WsResponse};

/// A stream that keeps a copy of every byte read from and written to it.
pub struct Recording<S> {
    inner: S,
    pub read: Arc<Mutex<Vec<u8>>>,
    pub written: Arc<Mutex<Vec<u8>>>,
}

impl<S> Recording<S> {
    pub fn new(inner: S) -> Recording<S> {
        Recording {
            inner,
            read: Default::default(),
            written: Default::default(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Recording<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.read.lock().unwrap().extend_from_slice(&buf.filled()[before..]);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Recording<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = polled {
            self.written.lock().unwrap().extend_from_slice(&data[..n]);
        }
        polled
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The bytes after the HTTP head (the upgrade request or the 101): the WebSocket frames.
pub fn after_handshake(bytes: &[u8]) -> &[u8] {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n").expect("an HTTP head") + 4;
    &bytes[end..]
}

/// One upgraded connection as the upstream saw it.
#[derive(Clone)]
pub struct WsConn {
    pub path: String,
    /// The upgrade request's headers (lower-case names).
    pub headers: Vec<(String, String)>,
    pub read: Arc<Mutex<Vec<u8>>>,
    pub written: Arc<Mutex<Vec<u8>>>,
    pub closed: Arc<std::sync::atomic::AtomicBool>,
}

pub struct WsUpstream {
    pub addr: SocketAddr,
    pub conns: Arc<Mutex<Vec<WsConn>>>,
    /// Connections whose request was not a WebSocket upgrade.
    pub http_requests: Arc<AtomicU64>,
    /// Their request lines (`POST /v1/responses`, ...): a client's HTTP fallback shows here.
    pub http_log: Arc<Mutex<Vec<String>>>,
    /// The test CA of a TLS upstream (llmtap's `[forward] ca_file`); None for plain TCP.
    pub ca_pem_path: Option<std::path::PathBuf>,
    _dir: Option<tempfile::TempDir>,
}

/// Any byte stream the scripts can speak over (plain TCP or TLS).
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type BoxIo = Box<dyn Io>;

/// A stream that first yields bytes already read from it (the request head read to tell an upgrade from plain
/// HTTP, which a TLS stream cannot peek).
struct Prefixed {
    prefix: Vec<u8>,
    inner: BoxIo,
}

impl AsyncRead for Prefixed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.drain(..n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What the Responses script reports for its `n`th response: (input, output, cached) tokens.
pub fn responses_usage(n: u64) -> (u64, u64, u64) {
    (100 * n, 5 * n, 10 * n)
}

/// The Realtime script's usage for its `n`th response: (input, output, cached).
pub fn realtime_usage(n: u64) -> (u64, u64, u64) {
    (50 * n, 7 * n, 4 * n)
}

impl WsUpstream {
    pub async fn start() -> WsUpstream {
        WsUpstream::start_with(false).await
    }

    /// Over TLS, with a certificate for the provider hosts (`ca_pem_path` is its test CA).
    pub async fn start_tls() -> WsUpstream {
        WsUpstream::start_with(true).await
    }

    async fn start_with(tls: bool) -> WsUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (acceptor, ca_pem_path, dir) = if tls {
            let (acceptor, pem, dir) = tls_acceptor();
            (Some(acceptor), Some(pem), Some(dir))
        } else {
            (None, None, None)
        };
        let conns: Arc<Mutex<Vec<WsConn>>> = Default::default();
        let http_requests = Arc::new(AtomicU64::new(0));
        let http_log: Arc<Mutex<Vec<String>>> = Default::default();
        let responses = Arc::new(AtomicU64::new(0));
        let (c, h, l) = (conns.clone(), http_requests.clone(), http_log.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (conns, http, log, responses) = (c.clone(), h.clone(), l.clone(), responses.clone());
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let (stream, line): (BoxIo, Option<String>) = match acceptor {
                        None => {
                            let line = plain_http(&tcp).await;
                            (Box::new(tcp), line)
                        }
                        Some(acceptor) => {
                            let Ok(tls) = acceptor.accept(tcp).await else { return };
                            let mut tls: BoxIo = Box::new(tls);
                            let Some(head) = read_head(&mut tls).await else { return };
                            let line = not_upgrade(&String::from_utf8_lossy(&head));
                            (
                                Box::new(Prefixed {
                                    prefix: head,
                                    inner: tls,
                                }),
                                line,
                            )
                        }
                    };
                    if let Some(line) = line {
                        http.fetch_add(1, Ordering::SeqCst);
                        log.lock().unwrap().push(line.clone());
                        answer_http(stream, &line).await;
                        return;
                    }
                    serve(stream, conns, http, responses).await
                });
            }
        });
        WsUpstream {
            addr,
            conns,
            http_requests,
            http_log,
            ca_pem_path,
            _dir: dir,
        }
    }

    pub fn conns(&self) -> Vec<WsConn> {
        self.conns.lock().unwrap().clone()
    }
}

/// The request line of a connection whose first request is not a WebSocket upgrade (read without consuming).
async fn plain_http(tcp: &TcpStream) -> Option<String> {
    let mut buf = vec![0u8; 16 * 1024];
    let head = loop {
        let n = tcp.peek(&mut buf).await.ok()?;
        let seen = &buf[..n];
        if seen.windows(4).any(|w| w == b"\r\n\r\n") || n == buf.len() {
            break String::from_utf8_lossy(seen).into_owned();
        }
        if n == 0 {
            return None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    not_upgrade(&head)
}

/// The request line of `head` when it is not a WebSocket upgrade.
fn not_upgrade(head: &str) -> Option<String> {
    let upgrade = head.to_ascii_lowercase().contains("upgrade: websocket");
    (!upgrade).then(|| head.lines().next().unwrap_or("").to_owned())
}

/// Reads up to the end of the first request head (byte by byte: what follows is the WebSocket's or the body's).
async fn read_head(stream: &mut BoxIo) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
        if stream.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    Some(head)
}

/// A TLS acceptor with a certificate for the provider hosts; the test CA's PEM file and its directory.
fn tls_acceptor() -> (tokio_rustls::TlsAcceptor, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(
        ["localhost", "api.openai.com", "chatgpt.com"]
            .map(String::from)
            .to_vec(),
    )
    .unwrap();
    let pem = dir.path().join("ws-upstream-ca.pem");
    std::fs::write(&pem, cert.cert.pem()).unwrap();
    let key = rustls_pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)
        .unwrap();
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), pem, dir)
}

/// A plain HTTP request: an empty model list for `GET .../models`, else 404 (the scripted upstream only speaks
/// WebSocket). The connection closes after the answer.
async fn answer_http(mut tcp: BoxIo, line: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    let _ = tokio::time::timeout(std::time::Duration::from_millis(200), tcp.read(&mut buf)).await;
    let (status, body) = if line.starts_with("GET ") && line.contains("/models") {
        ("200 OK", r#"{"object":"list","data":[],"models":[]}"#)
    } else {
        (
            "404 Not Found",
            r#"{"error":{"message":"this scripted upstream speaks WebSocket only"}}"#,
        )
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tcp.write_all(reply.as_bytes()).await;
    let _ = tcp.shutdown().await;
}

/// The upgrade request's path and headers.
type Handshake = (String, Vec<(String, String)>);

// tungstenite's handshake callback returns its own (large) error type.
#[allow(clippy::result_large_err)]
async fn serve(tcp: BoxIo, conns: Arc<Mutex<Vec<WsConn>>>, http: Arc<AtomicU64>, responses: Arc<AtomicU64>) {
    let stream = Recording::new(tcp);
    let (read, written) = (stream.read.clone(), stream.written.clone());
    let seen: Arc<Mutex<Handshake>> = Default::default();
    let s = seen.clone();
    let callback = move |req: &WsRequest, resp: WsResponse| {
        let headers = req
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
            .collect();
        *s.lock().unwrap() = (req.uri().to_string(), headers);
        Ok(resp)
    };
    let ws = match tokio_tungstenite::accept_hdr_async(stream, callback).await {
        Ok(ws) => ws,
        Err(_) => {
            http.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    let (path, headers) = seen.lock().unwrap().clone();
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    conns.lock().unwrap().push(WsConn {
        path: path.clone(),
        headers,
        read,
        written,
        closed: closed.clone(),
    });
    let route = path.split('?').next().unwrap_or("").trim_end_matches('/').to_owned();
    if route.ends_with("/responses") {
        responses_script(ws, &responses).await;
    } else if route.ends_with("/realtime") {
        realtime_script(ws).await;
    } else {
        echo(ws).await;
    }
    closed.store(true, Ordering::SeqCst);
}

type Ws = WebSocketStream<Recording<BoxIo>>;

async fn send(ws: &mut Ws, event: Value) {
    let _ = ws.send(Message::text(event.to_string())).await;
}

// Sending consumes the message, so the send cannot be a match guard.
#[allow(clippy::collapsible_match)]
async fn echo(mut ws: Ws) {
    while let Some(Ok(m)) = ws.next().await {
        match m {
            Message::Text(_) | Message::Binary(_) => {
                if ws.send(m).await.is_err() {
                    return;
                }
            }
            Message::Close(_) => {
                let _ = ws.close(None).await;
                return;
            }
            _ => {}
        }
    }
}

/// A held response: its request and number, its `response.created` already sent.
struct Held {
    request: Value,
    n: u64,
}

async fn responses_script(mut ws: Ws, counter: &AtomicU64) {
    let mut held: Option<Held> = None;
    while let Some(Ok(m)) = ws.next().await {
        let Message::Text(text) = m else {
            if let Message::Close(_) = m {
                let _ = ws.close(None).await;
                return;
            }
            continue;
        };
        let request: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if request["type"] != "response.create" {
            continue;
        }
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        if held.is_none() && request["input"].to_string().contains("[[hold]]") {
            send(&mut ws, created(&request, n)).await;
            held = Some(Held { request, n });
            continue;
        }
        send(&mut ws, created(&request, n)).await;
        rest_of_response(&mut ws, &request, n).await;
        if let Some(h) = held.take() {
            rest_of_response(&mut ws, &h.request, h.n).await;
        }
    }
}

fn with_stream_id(mut event: Value, request: &Value) -> Value {
    if let Some(s) = request.get("stream_id") {
        event["stream_id"] = s.clone();
    }
    event
}

fn created(request: &Value, n: u64) -> Value {
    let model = request["model"].as_str().unwrap_or("gpt-test");
    with_stream_id(
        json!({"type": "response.created", "sequence_number": 0, "response": {
            "id": format!("resp_{n}"), "object": "response", "status": "in_progress", "model": model, "output": []}}),
        request,
    )
}

/// The text of response `n`.
pub fn responses_text(n: u64) -> String {
    format!("Answer {n}.")
}

async fn rest_of_response(ws: &mut Ws, request: &Value, n: u64) {
    let model = request["model"].as_str().unwrap_or("gpt-test");
    let (input, output, cached) = responses_usage(n);
    let item = json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": responses_text(n), "annotations": []}]});
    let events = [
        json!({"type": "response.output_item.added", "output_index": 0, "sequence_number": 1,
            "item": {"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "in_progress", "content": []}}),
        json!({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "sequence_number": 2,
            "item_id": format!("msg_{n}"), "delta": "Answer "}),
        json!({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "sequence_number": 3,
            "item_id": format!("msg_{n}"), "delta": format!("{n}.")}),
        json!({"type": "response.output_item.done", "output_index": 0, "sequence_number": 4, "item": item}),
        json!({"type": "response.completed", "sequence_number": 5, "response": {
            "id": format!("resp_{n}"), "object": "response", "status": "completed", "model": model, "output": [item],
            "usage": {"input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output}}}),
    ];
    for e in events {
        send(ws, with_stream_id(e, request)).await;
    }
}

/// The text of Realtime response `n`.
pub fn realtime_text(n: u64) -> String {
    format!("Realtime answer {n}.")
}

async fn realtime_script(mut ws: Ws) {
    send(
        &mut ws,
        json!({"type": "session.created", "event_id": "event_0", "session": {
            "id": "sess_rt1", "object": "realtime.session", "model": "gpt-realtime", "instructions": "Be brief.",
            "output_modalities": ["text"]}}),
    )
    .await;
    let mut n = 0u64;
    while let Some(Ok(m)) = ws.next().await {
        let Message::Text(text) = m else {
            if let Message::Close(_) = m {
                let _ = ws.close(None).await;
                return;
            }
            continue;
        };
        let event: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        match event["type"].as_str() {
            Some("conversation.item.create") => {
                let mut item = event["item"].clone();
                item["id"] = json!(format!("item_user_{n}"));
                send(&mut ws, json!({"type": "conversation.item.created", "item": item})).await;
            }
            Some("response.create") => {
                n += 1;
                let (input, output, cached) = realtime_usage(n);
                let id = format!("resp_rt{n}");
                let item = json!({"id": format!("item_{n}"), "object": "realtime.item", "type": "message",
                    "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": realtime_text(n)}]});
                for e in [
                    json!({"type": "response.created", "response": {"id": id, "object": "realtime.response", "status": "in_progress", "output": []}}),
                    json!({"type": "response.output_item.added", "response_id": id, "output_index": 0, "item": item}),
                    json!({"type": "response.output_text.delta", "response_id": id, "item_id": format!("item_{n}"),
                        "output_index": 0, "content_index": 0, "delta": realtime_text(n)}),
                    json!({"type": "response.output_item.done", "response_id": id, "output_index": 0, "item": item}),
                    json!({"type": "response.done", "response": {"id": id, "object": "realtime.response",
                        "status": "completed", "output": [item],
                        "usage": {"total_tokens": input + output, "input_tokens": input, "output_tokens": output,
                            "input_token_details": {"cached_tokens": cached, "text_tokens": input, "audio_tokens": 0},
                            "output_token_details": {"text_tokens": output, "audio_tokens": 0}}}}),
                ] {
                    send(&mut ws, e).await;
                }
            }
            _ => {}
        }
    }
}
