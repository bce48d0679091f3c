//! Test harness: the recorded fixtures, a replaying HTTPS upstream, and the real `llmtap` binary.
//!
//! The upstream serves `tests/fixtures` (a copy of the shared corpus of recorded traffic, provenance in its
//! `SOURCES.md`) over TLS (a fresh rcgen CA per run, handed to llmtap as
//! `ca_file`). A request names its recording with the `x-replay-fixture` header (forwarded unchanged by llmtap,
//! as any client header is); without it, the upstream matches the request body against every recording of
//! that path. SSE bodies are sent one event per frame, optionally paced.
//!
//! `scripted` is the other upstream: it answers whatever a real client sends (tool calls, then text) for the four
//! API shapes; `clients` finds and runs the real agent clients that scripts/test.sh installs.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::sync::mpsc;

pub mod browser;
pub mod claude;
pub mod clients;
pub mod cloud;
pub mod nginx;
pub mod postgres;
pub mod scripted;
pub mod wait;
pub mod ws;

// === fixtures ===

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Sse,
    Json,
    Gzip,
    Empty,
}

#[derive(Debug, Clone)]
pub struct Fixture {
    /// Directory relative to the fixtures root, e.g. `anthropic_messages/pydantic-ai__thinking_stream`.
    pub name: String,
    pub method: String,
    /// Route name in llmtap (openai, anthropic, gemini, groq, openrouter).
    pub upstream: &'static str,
    /// Path and query as the upstream receives it.
    pub upstream_path: String,
    /// Path and query the client sends to llmtap.
    pub client_path: String,
    pub status: u16,
    pub response_headers: Vec<(String, String)>,
    pub kind: BodyKind,
    /// The response body bytes exactly as the provider sent them (gzip bytes for gzip).
    pub body: Vec<u8>,
    pub request: Vec<u8>,
    /// The recorded non-streamed JSON (decoded for gzip).
    pub response_json: Option<Value>,
}

pub fn fixtures_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// (host, path prefix that the upstream URL carries) → llmtap route name.
fn route_for(host: &str) -> Option<(&'static str, &'static str)> {
    Some(match host {
        "api.openai.com" => ("openai", ""),
        "api.anthropic.com" => ("anthropic", ""),
        "generativelanguage.googleapis.com" => ("gemini", ""),
        "api.groq.com" => ("groq", "/openai"),
        "openrouter.ai" => ("openrouter", "/api"),
        _ => return None,
    })
}

pub fn load_fixture(dir: &Path) -> Option<Fixture> {
    let meta: Value = serde_json::from_slice(&std::fs::read(dir.join("meta.json")).ok()?).ok()?;
    let request = std::fs::read(dir.join("request.json")).ok()?;
    let url = meta["url"].as_str()?;
    let rest = url.strip_prefix("https://")?;
    let (host, path) = rest.split_at(rest.find('/')?);
    let (upstream, prefix) = route_for(host)?;
    let client_path = format!("/{upstream}{}", path.strip_prefix(prefix)?);
    let (kind, body, response_json) = if dir.join("response.sse").exists() {
        (BodyKind::Sse, std::fs::read(dir.join("response.sse")).ok()?, None)
    } else if dir.join("response.body.gz").exists() {
        let json = serde_json::from_slice(&std::fs::read(dir.join("response.json")).ok()?).ok();
        (BodyKind::Gzip, std::fs::read(dir.join("response.body.gz")).ok()?, json)
    } else if dir.join("response.json").exists() {
        let raw = std::fs::read(dir.join("response.json")).ok()?;
        let json = serde_json::from_slice(&raw).ok();
        (BodyKind::Json, raw, json)
    } else {
        (BodyKind::Empty, Vec::new(), None)
    };
    let mut response_headers = Vec::new();
    if let Some(h) = meta["response_headers"].as_object() {
        for (k, vs) in h {
            let lower = k.to_ascii_lowercase();
            // Framing headers are the server's business; content-encoding is set from the body kind.
            if [
                "content-length",
                "transfer-encoding",
                "connection",
                "content-encoding",
                "keep-alive",
            ]
            .contains(&lower.as_str())
            {
                continue;
            }
            for v in vs.as_array().into_iter().flatten() {
                if let Some(v) = v.as_str() {
                    response_headers.push((lower.clone(), v.to_owned()));
                }
            }
        }
    }
    if kind == BodyKind::Gzip {
        response_headers.push(("content-encoding".into(), "gzip".into()));
    }
    let root = fixtures_root();
    Some(Fixture {
        name: dir.strip_prefix(&root).unwrap_or(dir).to_string_lossy().into_owned(),
        method: meta["method"].as_str().unwrap_or("POST").to_owned(),
        upstream,
        upstream_path: path.to_owned(),
        client_path,
        status: meta["status"]["code"].as_u64().unwrap_or(200) as u16,
        response_headers,
        kind,
        body,
        request,
        response_json,
    })
}

impl Fixture {
    /// The exchange the data path would capture for this recording: its request and response bytes as one
    /// frame each (an SSE body gets its content type if the recording lacks it), timed from `start`.
    pub fn raw_exchange(&self, start: i64, first_byte_after: i64, end_after: i64) -> llmtap::capture::RawExchange {
        use llmtap::capture::{Captured, ExchangeMeta, Outcome, RawExchange, Timings};
        let mut headers: Vec<(String, String)> = self.response_headers.clone();
        if self.kind == BodyKind::Sse && !headers.iter().any(|(k, _)| k == "content-type") {
            headers.push(("content-type".into(), "text/event-stream".into()));
        }
        RawExchange {
            id: llmtap::capture::exchange_id(start),
            upstream: self.upstream.into(),
            api: self.api(),
            method: http::Method::POST,
            path: self.upstream_path.clone(),
            status: Some(self.status),
            request: Captured {
                body: [self.request.clone().into()].into(),
                len: self.request.len() as u64,
                ended: true,
                ..Default::default()
            },
            response: Some(Captured {
                headers: headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
                body: [self.body.clone().into()].into(),
                len: self.body.len() as u64,
                ended: true,
                ..Default::default()
            }),
            timings: Timings {
                start,
                first_byte: Some(start + first_byte_after),
                end: start + end_after,
            },
            outcome: Outcome::Complete,
            error: None,
            meta: ExchangeMeta::default(),
            charge: Default::default(),
        }
    }

    /// The response as a non-streamed body and the normalized call, through the provider adapter (None when
    /// no adapter reads this API).
    pub fn normalize(&self) -> Option<(Value, llmtap::model::call::NormalizedCall)> {
        use llmtap::model::json::Json;
        let adapter = llmtap::provider::adapter_for(self.api())?;
        // The request through the borrowed view the pipeline uses, parsed from the recorded bytes.
        let request = Json::parse_slice(&self.request).unwrap();
        let response = match self.kind {
            BodyKind::Sse => adapter
                .reassemble(&llmtap::capture::sse::parse_events(
                    &String::from_utf8(self.body.clone()).unwrap(),
                ))
                .unwrap(),
            BodyKind::Json | BodyKind::Gzip => self.response_json.clone().unwrap_or(Value::Null),
            BodyKind::Empty => Value::Null,
        };
        let path = self.upstream_path.split('?').next().unwrap().to_owned();
        let ctx = llmtap::provider::CallContext {
            path: &path,
            status: Some(self.status),
        };
        let call = adapter.normalize(&ctx, &request, &Json::from_value(&response)).unwrap();
        Some((response, call))
    }

    /// The API this recording speaks, from its path (as llmtap's router decides it).
    pub fn api(&self) -> llmtap::capture::Api {
        use llmtap::capture::Api;
        let p = self.upstream_path.split('?').next().unwrap_or("");
        if p.ends_with("/chat/completions") {
            Api::OpenAiChat
        } else if p.ends_with("/responses") {
            Api::OpenAiResponses
        } else if p.ends_with("/messages") {
            Api::AnthropicMessages
        } else if p.contains(":generateContent") || p.contains(":streamGenerateContent") {
            Api::GeminiGenerateContent
        } else {
            Api::Other
        }
    }
}

/// Every replayable interaction (a request and a response), sorted by name.
pub fn all_fixtures() -> Vec<Fixture> {
    let mut dirs = Vec::new();
    collect_dirs(&fixtures_root(), &mut dirs);
    let mut out: Vec<Fixture> = dirs.iter().filter_map(|d| load_fixture(d)).collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Every file under `dir`, subdirectories included (the store, its WAL, the capture spill's segments).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                dirs.push(entry.path());
            } else {
                files.push(entry.path());
            }
        }
    }
    files
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.join("meta.json").exists() && p.join("request.json").exists() {
                out.push(p.clone());
            }
            collect_dirs(&p, out);
        }
    }
}

/// One recording by name (`anthropic_messages/pydantic-ai__thinking_stream`).
pub fn fixture(name: &str) -> Fixture {
    all_fixtures()
        .into_iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("no fixture {name}"))
}

/// The calls of one multi-call session, in recorded order.
pub fn session(name: &str) -> Vec<Fixture> {
    let dir = fixtures_root().join("agent_sessions").join(name);
    let mut calls: Vec<Fixture> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| load_fixture(&e.path()))
        .collect();
    calls.sort_by(|a, b| a.name.cmp(&b.name));
    calls
}

pub fn session_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_root().join("agent_sessions"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Split an SSE body into events, each keeping its own trailing blank line, so that the concatenation is the
/// original bytes.
pub fn split_sse(body: &[u8]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < body.len() {
        let sep = if body[i..].starts_with(b"\r\n\r\n") {
            4
        } else if body[i..].starts_with(b"\n\n") {
            2
        } else {
            0
        };
        if sep > 0 {
            out.push(Bytes::copy_from_slice(&body[start..i + sep]));
            i += sep;
            start = i;
        } else {
            i += 1;
        }
    }
    if start < body.len() {
        out.push(Bytes::copy_from_slice(&body[start..]));
    }
    out
}

// === replaying upstream ===

#[derive(Debug, Clone)]
pub struct Received {
    pub fixture: Option<String>,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    /// The host the request named (`Host` over HTTP/1.1, `:authority` over HTTP/2).
    pub authority: Option<String>,
    pub body: Bytes,
    /// Whether the body equals the recording's request bytes.
    pub body_matched: bool,
    /// Set when the upstream could not send the whole response (the peer went away).
    pub cancelled: Arc<AtomicBool>,
}

#[derive(Clone, Default)]
pub struct ReplayOptions {
    /// Pause between SSE events.
    pub event_delay: Duration,
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub ca_pem_path: PathBuf,
    pub received: Arc<Mutex<Vec<Received>>>,
    /// TCP connections accepted so far.
    pub connections: Arc<std::sync::atomic::AtomicUsize>,
    _dir: tempfile::TempDir,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct ReplayState {
    by_name: HashMap<String, Fixture>,
    options: ReplayOptions,
    received: Arc<Mutex<Vec<Received>>>,
    /// How many times each recording was served by body match (to walk through duplicates in order).
    served: Mutex<HashMap<String, usize>>,
}

impl Upstream {
    pub async fn start(options: ReplayOptions) -> Upstream {
        Self::start_on(options, "127.0.0.1:0".parse().unwrap()).await
    }

    pub async fn start_on(options: ReplayOptions, bind: SocketAddr) -> Upstream {
        let received = Arc::new(Mutex::new(Vec::new()));
        let state = Arc::new(ReplayState {
            by_name: all_fixtures().into_iter().map(|f| (f.name.clone(), f)).collect(),
            options,
            received: received.clone(),
            served: Mutex::new(HashMap::new()),
        });
        serve_tls(bind, received, move |req| replay(state.clone(), req)).await
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

/// An HTTPS server on `bind` (a fresh self-signed certificate, written to `ca_pem_path` for llmtap's
/// `ca_file`), HTTP/1.1 and HTTP/2, answering every request with `handler`.
pub async fn serve_tls<F, Fut>(bind: SocketAddr, received: Arc<Mutex<Vec<Received>>>, handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<ChannelBody>, std::io::Error>> + Send + 'static,
{
    serve(bind, true, received, handler).await
}

/// As [`serve_tls`], or plain HTTP/1.1 when `tls` is false (an `http://` upstream; `ca_pem_path` then names
/// a file that does not exist).
pub async fn serve<F, Fut>(bind: SocketAddr, tls: bool, received: Arc<Mutex<Vec<Received>>>, handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<ChannelBody>, std::io::Error>> + Send + 'static,
{
    let dir = tempfile::tempdir().unwrap();
    // The provider hosts too: forward-proxy tests send them here with `[forward] resolve`.
    let ca = rcgen::generate_simple_self_signed(
        [
            "localhost",
            "127.0.0.1",
            "api.anthropic.com",
            "api.openai.com",
            "bedrock-runtime.us-east-1.amazonaws.com",
        ]
        .map(String::from)
        .to_vec(),
    )
    .unwrap();
    let ca_pem_path = dir.path().join("upstream-ca.pem");
    if tls {
        std::fs::write(&ca_pem_path, ca.cert.pem()).unwrap();
    }
    let cert = rustls_pki_types::CertificateDer::from(ca.cert.der().to_vec());
    let key = rustls_pki_types::PrivateKeyDer::try_from(ca.signing_key.serialize_der()).unwrap();
    let mut server_tls =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
    server_tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls));
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let accepted = connections.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            accepted.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            let handler = handler.clone();
            if !tls {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(handler);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
                continue;
            }
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let svc = hyper::service::service_fn(handler);
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    Upstream {
        addr,
        ca_pem_path,
        received,
        connections,
        _dir: dir,
        task,
    }
}

/// The host a request named: `:authority` (HTTP/2, or an absolute URI), else the `Host` header.
pub fn authority_of(parts: &http::request::Parts) -> Option<String> {
    parts.uri.authority().map(|a| a.to_string()).or_else(|| {
        parts
            .headers
            .get("host")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    })
}

/// A response body fed from a channel, so the server can pace events and notice a peer that left.
pub struct ChannelBody(mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx)
    }
}

async fn replay(state: Arc<ReplayState>, req: Request<Incoming>) -> Result<Response<ChannelBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let scenario = parts
        .headers
        .get("x-replay-scenario")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let named = parts
        .headers
        .get("x-replay-fixture")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let fixture = match &named {
        Some(n) => state.by_name.get(n).cloned(),
        None => match_by_body(&state, &path, &body),
    };
    let cancelled = Arc::new(AtomicBool::new(false));
    state.received.lock().unwrap().push(Received {
        fixture: fixture.as_ref().map(|f| f.name.clone()),
        method: parts.method.to_string(),
        path: path.clone(),
        headers: parts.headers.clone(),
        authority: authority_of(&parts),
        body: body.clone(),
        body_matched: fixture.as_ref().is_some_and(|f| f.request == body),
        cancelled: cancelled.clone(),
    });

    let (tx, rx) = mpsc::channel(16);
    let mut resp = Response::new(ChannelBody(rx));
    // `x-replay-response-header: name: value` adds a response header (tests of what llmtap keeps of them).
    for v in parts.headers.get_all("x-replay-response-header") {
        if let Some((k, v)) = v.to_str().ok().and_then(|v| v.split_once(':'))
            && let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(k.trim().as_bytes()), v.trim().parse())
        {
            resp.headers_mut().append(k, v);
        }
    }
    match (scenario.as_deref(), fixture) {
        (Some("slow-stream"), _) => {
            resp.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            let delay = state.options.event_delay.max(Duration::from_millis(50));
            tokio::spawn(async move {
                for i in 0..40 {
                    let ev =
                        format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}}}}]}}\n\n");
                    if tx.send(Ok(Frame::data(Bytes::from(ev)))).await.is_err() {
                        cancelled.store(true, Ordering::SeqCst);
                        return;
                    }
                    tokio::time::sleep(delay).await;
                    if tx.is_closed() {
                        cancelled.store(true, Ordering::SeqCst);
                        return;
                    }
                }
                let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))).await;
            });
        }
        (Some("reset-midstream"), _) => {
            resp.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            tokio::spawn(async move {
                let ev = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"partial\"}}]}\n\n";
                let _ = tx.send(Ok(Frame::data(Bytes::from(ev)))).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = tx.send(Err(std::io::Error::other("upstream reset"))).await;
            });
        }
        (_, Some(f)) => {
            *resp.status_mut() = StatusCode::from_u16(f.status).unwrap();
            for (k, v) in &f.response_headers {
                if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(k.as_bytes()), v.parse()) {
                    resp.headers_mut().append(k, v);
                }
            }
            let delay = state.options.event_delay;
            tokio::spawn(async move {
                let frames = if f.kind == BodyKind::Sse {
                    split_sse(&f.body)
                } else {
                    vec![Bytes::from(f.body)]
                };
                for fr in frames {
                    if fr.is_empty() {
                        continue;
                    }
                    if tx.send(Ok(Frame::data(fr))).await.is_err() {
                        cancelled.store(true, Ordering::SeqCst);
                        return;
                    }
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                }
            });
        }
        (_, None) => {
            *resp.status_mut() = StatusCode::from_u16(599).unwrap();
            let _ = tx.try_send(Ok(Frame::data(Bytes::from(format!("no recording for {path}")))));
        }
    }
    Ok(resp)
}

fn match_by_body(state: &ReplayState, path: &str, body: &[u8]) -> Option<Fixture> {
    let want: Value = serde_json::from_slice(body).ok()?;
    let mut candidates: Vec<&Fixture> = state
        .by_name
        .values()
        .filter(|f| f.upstream_path == path && serde_json::from_slice::<Value>(&f.request).ok().as_ref() == Some(&want))
        .collect();
    candidates.sort_by(|a, b| a.name.cmp(&b.name));
    if candidates.is_empty() {
        return None;
    }
    let key = format!("{path}\u{1}{want}");
    let mut served = state.served.lock().unwrap();
    let n = served.entry(key).or_insert(0);
    let pick = candidates[*n % candidates.len()].clone();
    *n += 1;
    Some(pick)
}

// === the llmtap binary ===

pub struct Llmtap {
    child: Option<Child>,
    pub addr: SocketAddr,
    /// llmtap's gRPC API, when enabled.
    pub api_addr: Option<SocketAddr>,
    /// The web viewer, when the config names its `[viewer] listen` (and it is not "off").
    pub viewer_addr: Option<SocketAddr>,
    pub data_dir: PathBuf,
    pub config_path: PathBuf,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_llmtap")
}

/// A client of llmtap's gRPC API.
pub type ApiClient = llmtap::api::pb::llm_tap_client::LlmTapClient<tonic::transport::Channel>;

/// Connect to the instance's gRPC API (it must be enabled).
pub async fn api_client(tap: &Llmtap) -> ApiClient {
    ApiClient::connect(format!("http://{}", tap.api_addr.expect("api enabled")))
        .await
        .unwrap()
}

/// An `Export` call's chunks, read to the end of the stream.
pub async fn api_export(
    api: &mut ApiClient,
    request: impl tonic::IntoRequest<llmtap::api::pb::ExportRequest>,
) -> Vec<u8> {
    let mut stream = api.export(request).await.unwrap().into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        bytes.extend_from_slice(&chunk.data);
    }
    bytes
}

/// `command` without the developer's `OTEL_*` and `LLMTAP_*` variables: a test's llmtap is configured by the
/// test alone (an exported `OTEL_EXPORTER_OTLP_ENDPOINT` would add a sink, `LLMTAP_DATA_DIR` move the store).
pub fn clean_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("OTEL_") || text.starts_with("LLMTAP_") {
            command.env_remove(&name);
        }
    }
    command
}

/// The `llmtap` binary as a command with a clean environment (see [`clean_env`]).
pub fn llmtap_command() -> Command {
    let mut command = Command::new(bin());
    clean_env(&mut command);
    command
}

/// Config routing every fixture host to the replaying upstream.
pub fn upstream_config(up: &Upstream, extra: &str) -> String {
    let tls = up.ca_pem_path.exists();
    let base = format!("{}://127.0.0.1:{}", if tls { "https" } else { "http" }, up.addr.port());
    let ca = up.ca_pem_path.display();
    let mut s = String::new();
    for (name, prefix) in [
        ("openai", ""),
        ("anthropic", ""),
        ("gemini", ""),
        ("groq", "/openai"),
        ("openrouter", "/api"),
    ] {
        s.push_str(&format!("[upstreams.{name}]\nurl = \"{base}{prefix}\"\n"));
        if tls {
            s.push_str(&format!("ca_file = \"{ca}\"\n"));
        }
    }
    if !extra.contains("[api]") {
        s.push_str("[api]\nlisten = \"127.0.0.1:0\"\n");
    }
    if !extra.contains("[viewer]") {
        s.push_str("[viewer]\nlisten = \"127.0.0.1:0\"\n");
    }
    s.push_str(extra);
    s
}

impl Llmtap {
    /// Start `llmtap serve` on a free loopback port with `config` (TOML) and `data_dir`.
    pub fn start(config: &str, data_dir: &Path) -> Llmtap {
        Self::start_with_env(config, data_dir, &[])
    }

    pub fn start_with_env(config: &str, data_dir: &Path, env: &[(&str, &str)]) -> Llmtap {
        Self::spawn_with_stderr(config, data_dir, env, Stdio::inherit()).0
    }

    /// Start llmtap and collect its log (stderr) lines, for tests about what it logs.
    pub fn start_capturing_log(config: &str, data_dir: &Path) -> (Llmtap, Arc<Mutex<Vec<String>>>) {
        Self::start_capturing_log_with_env(config, data_dir, &[])
    }

    /// As `start_capturing_log`, with `env` added to llmtap's environment (e.g. `RUST_LOG`).
    pub fn start_capturing_log_with_env(
        config: &str,
        data_dir: &Path,
        env: &[(&str, &str)],
    ) -> (Llmtap, Arc<Mutex<Vec<String>>>) {
        let (tap, stderr) = Self::spawn_with_stderr(config, data_dir, env, Stdio::piped());
        let lines = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = stderr {
            let sink = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { return };
                    eprintln!("{line}");
                    sink.lock().unwrap().push(line);
                }
            });
        }
        (tap, lines)
    }

    /// As `start_with_env`, with llmtap's stderr (its log) sent to `stderr` (e.g. a file a test reads).
    pub fn start_with_stderr(config: &str, data_dir: &Path, env: &[(&str, &str)], stderr: Stdio) -> Llmtap {
        Self::spawn_with_stderr(config, data_dir, env, stderr).0
    }

    fn spawn_with_stderr(
        config: &str,
        data_dir: &Path,
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> (Llmtap, Option<std::process::ChildStderr>) {
        std::fs::create_dir_all(data_dir).unwrap();
        let config_path = data_dir.join("llmtap-test.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = llmtap_command()
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config_path)
            .arg("--data-dir")
            .arg(data_dir)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let _ = tx.send(line);
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).expect("llmtap did not start");
        let addr = line.trim().rsplit("http://").next().unwrap().parse().expect(&line);
        // The API's and the viewer's address lines follow, each when enabled. The viewer is waited for only when
        // the config names its address: the default port may be taken by a parallel test, and then llmtap runs
        // without a viewer (and prints no line).
        let want_api = !config.contains("[api]\nlisten = \"off\"");
        let want_viewer = config.contains("[viewer]") && !config.contains("[viewer]\nlisten = \"off\"");
        let (mut api_addr, mut viewer_addr) = (None, None);
        for _ in 0..(want_api as usize + want_viewer as usize) {
            let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) else {
                break;
            };
            let l = l.trim();
            if let Some(a) = l.strip_prefix("llmtap api on http://") {
                api_addr = a.parse().ok();
            } else if let Some(a) = l.strip_prefix("llmtap viewer on http://") {
                viewer_addr = a.trim_end_matches('/').parse().ok();
            }
        }
        let tap = Llmtap {
            child: Some(child),
            addr,
            api_addr,
            viewer_addr,
            data_dir: data_dir.to_owned(),
            config_path,
        };
        (tap, stderr)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Run a CLI subcommand against this instance's store; returns stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = llmtap_command()
            .args(args)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "llmtap {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The `steps` export grouped by trajectory id (in id order), each trajectory's steps in export order.
    pub fn steps_by_trajectory(&self) -> std::collections::BTreeMap<String, Vec<Value>> {
        let mut by_trajectory: std::collections::BTreeMap<String, Vec<Value>> = Default::default();
        for s in self.export("steps", &[]) {
            let id = s["trajectory_id"].as_str().unwrap_or_default().to_owned();
            by_trajectory.entry(id).or_default().push(s);
        }
        by_trajectory
    }

    pub fn export(&self, format: &str, extra: &[&str]) -> Vec<Value> {
        let mut args = vec!["export", "--format", format];
        args.extend_from_slice(extra);
        self.cli(&args)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Wait until the store holds at least `n` provider traces and everything derived from them (capture is
    /// asynchronous by design: a call's trace and its steps may commit in different store transactions).
    pub fn wait_for_traces(&self, n: usize) -> Vec<Value> {
        self.wait_for_trace_count(|stored| stored >= n);
        self.wait_settled();
        self.export("provider-traces", &[])
    }

    /// Provider traces once at most `n` remain (retention runs in the store's background), or after 20 s.
    pub fn wait_for_at_most_traces(&self, n: usize) -> Vec<Value> {
        self.wait_for_trace_count(|stored| stored <= n)
    }

    /// The stored provider traces once their count satisfies `done`, or after 20 s.
    fn wait_for_trace_count(&self, done: impl Fn(usize) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let traces = self.export("provider-traces", &[]);
            if done(traces.len()) || Instant::now() > deadline {
                return traces;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every exchange handed to capture so far processed and committed (an exchange is counted processed once
    /// its records are with the store writer, which counts what it has not committed yet), or 20 s.
    pub fn wait_settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let m = self.metrics();
            let get = |name: &str| {
                m.lines()
                    .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<u64>().ok()))
                    .unwrap_or(0)
            };
            // Processed may exceed captured: a restart processes what an earlier run left in the spill.
            if get("llmtap_processed_total ") >= get("llmtap_captured_total ")
                && get("llmtap_store_pending_records ") == 0
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `llmtap sessions --json`, parsed.
    /// Every trajectory of `llmtap sessions --json`, session by session.
    pub fn sessions_json(&self) -> Vec<Value> {
        self.session_groups()
            .into_iter()
            .flat_map(|s| s["trajectories"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    /// `llmtap sessions --json`: one value per session, with its trajectories.
    pub fn session_groups(&self) -> Vec<Value> {
        self.cli(&["sessions", "--json"])
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    pub fn metrics(&self) -> String {
        let out = llmtap_command()
            .args(["status", "--addr", &self.addr.to_string()])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn metric(&self, name: &str) -> u64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// How many of the process's threads have names starting with `prefix` (Linux: `/proc/<pid>/task`;
    /// a thread name is cut to 15 bytes there).
    pub fn threads_named(&self, prefix: &str) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim_end().starts_with(prefix))
            .count()
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let c = self.child.as_mut().unwrap();
        Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status()
            .unwrap();
        let status = c.wait().unwrap();
        self.child = None;
        status
    }
}

impl Drop for Llmtap {
    fn drop(&mut self) {
        self.kill9();
    }
}

// === a plain HTTP client ===

pub type Client = hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> Client {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http()
}

pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

pub async fn send(client: &Client, method: &str, url: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Reply {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply { status, headers, body }
}

/// Send `body` (instead of the recorded request) through llmtap, answered with `f`'s recorded response.
pub async fn send_body(client: &Client, tap: &Llmtap, f: &Fixture, body: Vec<u8>) -> Reply {
    send(
        client,
        "POST",
        &tap.url(&f.client_path),
        &[("x-replay-fixture", f.name.as_str())],
        body,
    )
    .await
}

/// The first `n` recorded non-streamed calls that succeeded.
pub fn json_calls(n: usize) -> Vec<Fixture> {
    let calls: Vec<Fixture> = all_fixtures()
        .into_iter()
        .filter(|f| f.status == 200 && f.kind == BodyKind::Json)
        .take(n)
        .collect();
    assert_eq!(calls.len(), n, "recorded JSON calls");
    calls
}

/// A store as an earlier run leaves it: llmtap started over `data_dir`, `calls` sent one by one, everything
/// stored and derived, llmtap stopped. Returns the stored provider traces.
pub async fn record_calls(config: &str, data_dir: &Path, calls: &[Fixture]) -> Vec<Value> {
    let client = client();
    let mut tap = Llmtap::start(config, data_dir);
    for f in calls {
        assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, 200, "{}", f.name);
    }
    let traces = tap.wait_for_traces(calls.len());
    assert_eq!(traces.len(), calls.len());
    assert!(tap.terminate().success());
    traces
}

/// Trajectories whose session column holds their own id (schema v9 leaves such a column empty).
pub fn rows_naming_their_own_session(db: &rusqlite::Connection) -> i64 {
    db.query_row(
        "SELECT COUNT(*) FROM trajectories WHERE session_id = trajectory_id",
        [],
        |r| r.get(0),
    )
    .unwrap()
}

/// The store's SQLite file, opened directly (tests that inspect or age rows).
pub fn open_store_db(data_dir: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open(data_dir.join(llmtap::store::DB_FILE)).unwrap()
}

/// Send a fixture's request through llmtap, naming the recording for the upstream.
pub async fn send_fixture(client: &Client, tap: &Llmtap, f: &Fixture, extra: &[(&str, &str)]) -> Reply {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("x-replay-fixture", f.name.as_str()),
    ];
    headers.extend_from_slice(extra);
    send(client, &f.method, &tap.url(&f.client_path), &headers, f.request.clone()).await
}

/// The stream text llmtap stored for trace `id` exactly as the upstream sent it (None for a non-streamed call).
pub fn stored_raw_response(data_dir: &Path, id: &str) -> Option<String> {
    let reader = llmtap::store::StoreReader::open(data_dir).unwrap();
    reader.trace(id).unwrap().and_then(|t| t.raw_response)
}
