//! The web viewer: one page of plain JS and CSS embedded in the binary, a JSON API over the store (`data`),
//! session exports, and server-sent events bridged from the store's commit feed so that open pages update
//! without a reload. Its routes are part of the API router (`api::router`), behind its layers (`api::auth`:
//! security headers, cross-site refusal, token or loopback Host).
//!
//! Store reads run on the API runtime's blocking pool, never on the proxy's.

mod annotations;
mod dashboard;
pub mod data;
mod diff;
mod replay;
pub mod search;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, broadcast, mpsc};

use super::{LiveEvent, LiveTx};
use crate::model::format::ExportFormat;
use crate::store::{Query, SessionQuery, Store, TraceFilter};
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics};

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// Sessions per page of the list, steps per page of a trajectory.
const SESSION_PAGE: u32 = 50;
const STEP_PAGE: u32 = 100;
/// Live-event pages open at once; more are refused (503) rather than holding memory.
const MAX_EVENT_STREAMS: usize = 64;
/// An event stream whose page takes nothing for this long is closed.
const EVENT_STALL: Duration = Duration::from_secs(30);

type Body = BoxBody<Bytes, std::io::Error>;
type Params = BTreeMap<String, String>;

pub struct Viewer {
    store: Store,
    live: LiveTx,
    ctx: Arc<data::Context>,
    event_slots: Arc<Semaphore>,
    metrics: Arc<Metrics>,
    errors: EpisodeLog,
}

impl Viewer {
    /// `proxy`: where this llmtap's proxy listens (replays go through it).
    pub fn new(
        config: &crate::config::Config,
        proxy: std::net::SocketAddr,
        store: Store,
        live: LiveTx,
        metrics: Arc<Metrics>,
    ) -> Viewer {
        Viewer {
            store,
            live,
            ctx: Arc::new(data::Context {
                upstreams: config
                    .upstreams
                    .iter()
                    .map(|(k, u)| (k.clone(), u.url.to_string()))
                    .collect::<BTreeMap<_, _>>(),
                redactor: crate::proxy::redact::Redactor::new(&config.capture.redact_headers),
                replay_proxy: config.viewer.replay.then_some(proxy),
            }),
            event_slots: Arc::new(Semaphore::new(MAX_EVENT_STREAMS)),
            metrics,
            errors: EpisodeLog::default(),
        }
    }

    /// The page, its assets and the JSON API. Other methods than the ones routed are answered 405.
    pub fn routes(self: Arc<Self>) -> Router {
        Router::new()
            .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
            .route(
                "/assets/app.js",
                get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
            )
            .route(
                "/assets/app.css",
                get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
            )
            .route("/api/sessions", get(sessions))
            .route("/api/sessions/{id}", get(session))
            .route("/api/trajectories/{id}/steps", get(steps))
            .route("/api/calls/{id}", get(call))
            .route("/api/calls/{id}/diff", get(call_diff))
            // The viewer's writes: a replay (POST, `replay::post`) and annotations (POST, DELETE).
            .route("/api/calls/{id}/replay", get(replay_info).post(replay_post))
            .route("/api/annotations", post(post_annotation))
            .route("/api/annotations/{id}", delete(delete_annotation))
            .route("/api/costs", get(costs))
            .route("/api/search", get(search_steps))
            .route("/api/compare", get(compare))
            .route("/api/export/{format}", get(export))
            .route(
                "/api/events",
                get(|State(v): State<Arc<Viewer>>| async move { v.events() }),
            )
            // llmtap's own metrics: the same collection of the same instruments as /metrics.
            .route(
                "/api/metrics",
                get(|State(v): State<Arc<Viewer>>| async move {
                    json_response(
                        StatusCode::OK,
                        &crate::telemetry::exposition::to_json(&v.metrics.families()),
                    )
                }),
            )
            .with_state(self)
    }

    /// Run a store read on the blocking pool; None → 404.
    async fn read(
        &self,
        f: impl FnOnce(&dyn Query, &data::Context) -> Result<Option<Value>, crate::store::StoreError> + Send + 'static,
    ) -> Response<Body> {
        let store = self.store.clone();
        let ctx = self.ctx.clone();
        let result = tokio::task::spawn_blocking(move || store.read(|reader| f(reader, &ctx))).await;
        match result {
            Ok(Ok(Some(v))) => {
                self.errors.success();
                json_response(StatusCode::OK, &v)
            }
            Ok(Ok(None)) => json_response(StatusCode::NOT_FOUND, &json!({"error": "not found"})),
            Ok(Err(e)) => self.failed(&e.to_string()),
            Err(e) => self.failed(&e.to_string()),
        }
    }

    fn failed(&self, error: &str) -> Response<Body> {
        self.metrics.api_errors.inc();
        match self.errors.failure() {
            EpisodeReport::First => tracing::warn!(%error, "Viewer: a store read failed"),
            EpisodeReport::Summary { count } => tracing::warn!(%error, count, "Viewer: store reads still failing"),
            EpisodeReport::Quiet => {}
        }
        json_response(StatusCode::INTERNAL_SERVER_ERROR, &json!({"error": error}))
    }

    /// `POST api/annotations`: JSON only (module docs of `annotations`), bounded, checked, then kept.
    async fn post_annotation(&self, req: axum::extract::Request) -> Response<Body> {
        let content_type = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        if !annotations::is_json(content_type) {
            return json_response(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                &json!({"error": "an annotation is sent as Content-Type: application/json"}),
            );
        }
        let body = match http_body_util::Limited::new(req.into_body(), annotations::MAX_BODY)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return json_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &json!({"error": format!("an annotation is at most {} bytes", annotations::MAX_BODY)}),
                );
            }
        };
        match annotations::parse(&body) {
            Ok(new) => self.write(move |store| annotations::add(store, &new)).await,
            Err(message) => json_response(StatusCode::BAD_REQUEST, &json!({ "error": message })),
        }
    }

    /// Run a store write on the blocking pool; None → 404.
    async fn write(
        &self,
        f: impl FnOnce(&Store) -> Result<Option<Value>, crate::store::StoreError> + Send + 'static,
    ) -> Response<Body> {
        let store = self.store.clone();
        match tokio::task::spawn_blocking(move || f(&store)).await {
            Ok(Ok(Some(v))) => json_response(StatusCode::OK, &v),
            Ok(Ok(None)) => json_response(StatusCode::NOT_FOUND, &json!({"error": "not found"})),
            Ok(Err(e)) => self.failed(&e.to_string()),
            Err(e) => self.failed(&e.to_string()),
        }
    }

    /// `llmtap export --format <format> --session <session>` as a download, streamed from a blocking thread.
    fn export(&self, format: &str, session: Option<String>) -> Response<Body> {
        let Ok(fmt) = <ExportFormat as clap::ValueEnum>::from_str(format, true) else {
            return text(StatusCode::NOT_FOUND, "unknown export format");
        };
        let Some(session) = session.filter(|s| !s.is_empty()) else {
            return text(StatusCode::BAD_REQUEST, "session is required");
        };
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
        let store = self.store.clone();
        let filter = TraceFilter {
            session: Some(session.clone()),
            ..TraceFilter::default()
        };
        tokio::task::spawn_blocking(move || {
            let mut out = ChannelWriter {
                tx: tx.clone(),
                buf: Vec::new(),
            };
            let result = crate::export::write_jsonl_from(&store, fmt, &filter, &mut out);
            let _ = std::io::Write::flush(&mut out);
            if let Err(e) = result {
                let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
            }
        });
        let name: String = session
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        let mut resp = Response::new(StreamBody::new(ChannelStream(rx)).boxed());
        set_header(&mut resp, header::CONTENT_TYPE, "application/x-ndjson");
        set_header(
            &mut resp,
            header::CONTENT_DISPOSITION,
            &format!("attachment; filename=\"{name}.{format}.jsonl\""),
        );
        resp
    }

    /// Server-sent events: `call` for each finished call, `step` for each step, from the live feed.
    fn events(&self) -> Response<Body> {
        let Ok(slot) = self.event_slots.clone().try_acquire_owned() else {
            return text(StatusCode::SERVICE_UNAVAILABLE, "too many live pages open");
        };
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(64);
        let mut live = self.live.subscribe();
        tokio::spawn(async move {
            let _slot = slot;
            let send = |text: String| {
                let tx = tx.clone();
                async move {
                    matches!(
                        tokio::time::timeout(EVENT_STALL, tx.send(Ok(Frame::data(Bytes::from(text))))).await,
                        Ok(Ok(()))
                    )
                }
            };
            if !send(": live\n\n".into()).await {
                return;
            }
            let mut keepalive = tokio::time::interval(Duration::from_secs(15));
            loop {
                let event = tokio::select! {
                    () = tx.closed() => return,
                    _ = keepalive.tick() => {
                        if !send(": keepalive\n\n".into()).await { return; }
                        continue;
                    }
                    e = live.recv() => e,
                };
                let (name, data) = match event {
                    Ok(LiveEvent::Trace(t)) => (
                        "call",
                        json!({
                            "id": t.id, "trajectory_id": t.trajectory_id, "session_id": t.session,
                            "agent": t.agent, "model": t.model,
                            "status": t.status, "outcome": t.outcome.as_str(),
                        }),
                    ),
                    Ok(LiveEvent::Step(s)) => (
                        "step",
                        json!({
                            "step_id": s.step_id, "trajectory_id": s.trajectory_id, "session_id": s.session_id,
                            "step_index": s.step_index,
                        }),
                    ),
                    Err(broadcast::error::RecvError::Lagged(n)) => ("lagged", json!({ "skipped": n })),
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if !send(format!("event: {name}\ndata: {data}\n\n")).await {
                    return;
                }
            }
        });
        let mut resp = Response::new(StreamBody::new(ChannelStream(rx)).boxed());
        set_header(&mut resp, header::CONTENT_TYPE, "text/event-stream");
        resp
    }
}

async fn sessions(State(v): State<Arc<Viewer>>, RawQuery(q): RawQuery) -> Response<Body> {
    let query = session_query(&query_params(q.as_deref()));
    v.read(move |r, _| data::list_sessions(r, &query).map(Some)).await
}

async fn session(State(v): State<Arc<Viewer>>, Path(id): Path<String>) -> Response<Body> {
    v.read(move |r, _| data::session(r, &id)).await
}

async fn steps(State(v): State<Arc<Viewer>>, Path(id): Path<String>, RawQuery(q): RawQuery) -> Response<Body> {
    let q = query_params(q.as_deref());
    let after = q.get("after").and_then(|a| a.parse().ok());
    let limit = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(STEP_PAGE);
    v.read(move |r, _| data::steps(r, &id, after, limit).map(Some)).await
}

async fn call(State(v): State<Arc<Viewer>>, Path(id): Path<String>) -> Response<Body> {
    v.read(move |r, ctx| data::call(r, ctx, &id)).await
}

async fn call_diff(State(v): State<Arc<Viewer>>, Path(id): Path<String>, RawQuery(q): RawQuery) -> Response<Body> {
    let against = query_params(q.as_deref()).remove("against").filter(|a| !a.is_empty());
    v.read(move |r, _| data::call_diff(r, &id, against.as_deref())).await
}

async fn replay_info(State(v): State<Arc<Viewer>>, Path(id): Path<String>) -> Response<Body> {
    v.read(move |r, ctx| replay::info(r, ctx, &id)).await
}

async fn replay_post(
    State(v): State<Arc<Viewer>>,
    Path(id): Path<String>,
    request: axum::extract::Request,
) -> Response<Body> {
    replay::post(v.store.clone(), v.ctx.clone(), v.live.clone(), id, request).await
}

async fn post_annotation(State(v): State<Arc<Viewer>>, request: axum::extract::Request) -> Response<Body> {
    v.post_annotation(request).await
}

async fn delete_annotation(State(v): State<Arc<Viewer>>, Path(id): Path<String>) -> Response<Body> {
    v.write(move |store| annotations::delete(store, &id)).await
}

async fn costs(State(v): State<Arc<Viewer>>, RawQuery(q): RawQuery) -> Response<Body> {
    match dashboard::cost_query(&query_params(q.as_deref()), chrono::Utc::now().timestamp_micros()) {
        Ok(range) => v.read(move |r, _| dashboard::costs(r, &range).map(Some)).await,
        Err(message) => json_response(StatusCode::BAD_REQUEST, &json!({ "error": message })),
    }
}

async fn search_steps(State(v): State<Arc<Viewer>>, RawQuery(q): RawQuery) -> Response<Body> {
    match search::query(&query_params(q.as_deref())) {
        Ok(query) => v.read(move |r, _| search::answer(r, &query).map(Some)).await,
        Err(e) => json_response(StatusCode::BAD_REQUEST, &json!({ "error": e.to_string() })),
    }
}

async fn compare(State(v): State<Arc<Viewer>>, RawQuery(q): RawQuery) -> Response<Body> {
    let mut q = query_params(q.as_deref());
    let (a, b) = (q.remove("a").unwrap_or_default(), q.remove("b").unwrap_or_default());
    v.read(move |r, _| data::compare(r, &a, &b)).await
}

async fn export(State(v): State<Arc<Viewer>>, Path(format): Path<String>, RawQuery(q): RawQuery) -> Response<Body> {
    v.export(&format, query_params(q.as_deref()).remove("session"))
}

fn session_query(q: &Params) -> SessionQuery {
    let time = |k: &str| {
        q.get(k)
            .filter(|v| !v.is_empty())
            .and_then(|v| chrono::DateTime::parse_from_rfc3339(v).ok())
            .map(|d| d.timestamp_micros())
    };
    let text = |k: &str| q.get(k).filter(|v| !v.is_empty()).cloned();
    SessionQuery {
        agent: text("agent"),
        model: text("model"),
        since_us: time("since"),
        until_us: time("until"),
        text: text("q"),
        label: text("label"),
        before: q.get("before").and_then(|b| {
            let (t, id) = b.split_once(':')?;
            Some((t.parse().ok()?, id.to_owned()))
        }),
        limit: q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(SESSION_PAGE),
    }
}

/// A query string's parameters, decoded (`+` is a space); a repeated name keeps its last value.
pub(super) fn query_params(query: Option<&str>) -> Params {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(&s.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

fn set_header(resp: &mut Response<Body>, name: header::HeaderName, value: &str) {
    if let Ok(v) = http::HeaderValue::from_str(value) {
        resp.headers_mut().insert(name, v);
    }
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

fn asset(content_type: &str, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(full(body));
    set_header(&mut resp, header::CONTENT_TYPE, content_type);
    resp
}

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut resp = asset("text/plain; charset=utf-8", body);
    *resp.status_mut() = status;
    resp
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = status;
    set_header(&mut resp, header::CONTENT_TYPE, "application/json");
    resp
}

/// A response body fed through a channel.
struct ChannelStream(mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>);

impl futures_core::Stream for ChannelStream {
    type Item = Result<Frame<Bytes>, std::io::Error>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// An `io::Write` on a blocking thread handing 64 KiB chunks to a response body; a client that left is a
/// write error, which ends the export.
struct ChannelWriter {
    tx: mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
    buf: Vec<u8>,
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= 64 * 1024 {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::take(&mut self.buf));
        self.tx
            .blocking_send(Ok(Frame::data(chunk)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "viewer client went away"))
    }
}
