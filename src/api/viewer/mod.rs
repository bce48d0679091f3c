//! The web viewer: a small HTTP server on the API's runtime (`[viewer] listen`, loopback by default) serving one
//! page of plain JS and CSS embedded in the binary, a JSON API over the store (`data`), session exports, and
//! server-sent events bridged from the pipeline's live feed so that open pages update without a reload.
//!
//! Store reads run on the API runtime's blocking pool, never on the proxy's. Captured content is sensitive:
//! every response carries a strict Content-Security-Policy (no inline script, nothing from elsewhere),
//! `Referrer-Policy: no-referrer` and `Cache-Control: no-store`; a browser request from another site's page is
//! refused on every API route (`Sec-Fetch-Site`, else `Origin`). Beyond loopback `[api] token` is required
//! (checked by `app::run`) and presented as a bearer header, or as `/?token=` on the page alone, answered with a
//! redirect that drops it from the URL and an HttpOnly same-site cookie derived from the token (not the token).
//! Without a token, only requests whose Host is a loopback name are answered (a DNS-rebinding page cannot read
//! the store).

pub mod data;
mod diff;
pub mod search;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::{LiveEvent, LiveTx};
use crate::model::format::ExportFormat;
use crate::store::{Query, SessionQuery, Store, TraceFilter};
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics};

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
const COOKIE: &str = "llmtap_viewer";
/// How long the cookie lasts; then the page is opened with `?token=` again.
const COOKIE_MAX_AGE_SECS: u64 = 30 * 24 * 3600;
/// Sessions per page of the list, steps per page of a trajectory.
const SESSION_PAGE: u32 = 50;
const STEP_PAGE: u32 = 100;
/// Live-event pages open at once; more are refused (503) rather than holding memory.
const MAX_EVENT_STREAMS: usize = 64;
/// An event stream whose page takes nothing for this long is closed.
const EVENT_STALL: Duration = Duration::from_secs(30);

type Body = BoxBody<Bytes, std::io::Error>;

pub struct Viewer {
    store: Store,
    live: LiveTx,
    ctx: Arc<data::Context>,
    token: Option<Credentials>,
    event_slots: Arc<Semaphore>,
    metrics: Arc<Metrics>,
    errors: EpisodeLog,
}

impl Viewer {
    pub fn new(config: &crate::config::Config, store: Store, live: LiveTx, metrics: Arc<Metrics>) -> Viewer {
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
            }),
            token: config.api.token.as_ref().map(|t| Credentials {
                token: t.digest(),
                cookie: super::auth::viewer_cookie(t),
            }),
            event_slots: Arc::new(Semaphore::new(MAX_EVENT_STREAMS)),
            metrics,
            errors: EpisodeLog::default(),
        }
    }

    /// Serve connections on `listener` until `stop` is cancelled.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener, stop: CancellationToken) {
        let connections = tokio_util::task::TaskTracker::new();
        loop {
            let stream = tokio::select! {
                () = stop.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok((s, _)) => s,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let viewer = self.clone();
            let stop = stop.clone();
            connections.spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let viewer = viewer.clone();
                    async move { Ok::<_, Infallible>(viewer.handle(req).await) }
                });
                let builder = auto::Builder::new(TokioExecutor::new());
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    _ = conn => {}
                    () = stop.cancelled() => {}
                }
            });
        }
        connections.close();
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let mut resp = if req.uri().path().starts_with("/api/") && is_cross_site(&req) {
            text(
                StatusCode::FORBIDDEN,
                "llmtap viewer: requests from another site's page are refused",
            )
        } else {
            match self.authorize(&req) {
                Err((status, message)) => text(status, message),
                Ok(Access::Granted) => self.route(&req).await,
                Ok(Access::TokenInUrl(cookie)) => {
                    // Back to the page without the token in its URL (history, logs); relative, so a viewer
                    // behind a path prefix stays under it. The fragment (the page's route) is kept by the browser.
                    let mut resp = text(StatusCode::SEE_OTHER, "");
                    set_header(&mut resp, header::LOCATION, "./");
                    set_header(&mut resp, header::SET_COOKIE, &cookie);
                    resp
                }
            }
        };
        let h = resp.headers_mut();
        for (k, v) in [
            ("content-security-policy", CSP),
            ("x-content-type-options", "nosniff"),
            ("referrer-policy", "no-referrer"),
            ("x-frame-options", "DENY"),
            ("cache-control", "no-store"),
        ] {
            h.insert(k, http::HeaderValue::from_static(v));
        }
        resp
    }

    /// Whether the request may be answered; Err: the refusal.
    fn authorize(&self, req: &Request<Incoming>) -> Result<Access, (StatusCode, &'static str)> {
        let Some(expected) = &self.token else {
            // No token: loopback only. Refuse other Host names (DNS rebinding).
            return if is_loopback_host(request_host(req)) {
                Ok(Access::Granted)
            } else {
                Err((
                    StatusCode::FORBIDDEN,
                    "llmtap viewer: only loopback host names are served",
                ))
            };
        };
        // `?token=` only on the page: anywhere else it would sit in URLs the page loads, Referers and logs.
        if req.uri().path() == "/"
            && let Some(t) = query_params(req.uri().query()).get("token")
        {
            if expected.token.matches(t) {
                return Ok(Access::TokenInUrl(format!(
                    "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/; Max-Age={COOKIE_MAX_AGE_SECS}",
                    expected.cookie
                )));
            }
            self.metrics.api_unauthenticated.inc();
            return Err(UNAUTHORIZED);
        }
        let bearer = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| expected.token.matches_bearer(v));
        let cookie = || {
            req.headers()
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .filter_map(|c| c.trim().split_once('='))
                .any(|(k, v)| k == COOKIE && super::auth::cookie_matches(&expected.cookie, v))
        };
        if bearer || cookie() {
            return Ok(Access::Granted);
        }
        self.metrics.api_unauthenticated.inc();
        Err(UNAUTHORIZED)
    }

    async fn route(&self, req: &Request<Incoming>) -> Response<Body> {
        if req.method() != Method::GET {
            return text(StatusCode::METHOD_NOT_ALLOWED, "GET only");
        }
        let path = req.uri().path();
        let q = query_params(req.uri().query());
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match segments.as_slice() {
            [""] => asset("text/html; charset=utf-8", INDEX_HTML),
            ["assets", "app.js"] => asset("text/javascript; charset=utf-8", APP_JS),
            ["assets", "app.css"] => asset("text/css; charset=utf-8", APP_CSS),
            ["api", "sessions"] => {
                let query = session_query(&q);
                self.read(move |r, _| data::list_sessions(r, &query).map(Some)).await
            }
            ["api", "sessions", id] => {
                let id = decode(id);
                self.read(move |r, _| data::session(r, &id)).await
            }
            ["api", "trajectories", id, "steps"] => {
                let id = decode(id);
                let after = q.get("after").and_then(|a| a.parse().ok());
                let limit = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(STEP_PAGE);
                self.read(move |r, _| data::steps(r, &id, after, limit).map(Some)).await
            }
            ["api", "calls", id] => {
                let id = decode(id);
                self.read(move |r, ctx| data::call(r, ctx, &id)).await
            }
            ["api", "calls", id, "diff"] => {
                let id = decode(id);
                let against = q.get("against").filter(|a| !a.is_empty()).cloned();
                self.read(move |r, _| data::call_diff(r, &id, against.as_deref())).await
            }
            ["api", "compare"] => {
                let (a, b) = (
                    q.get("a").cloned().unwrap_or_default(),
                    q.get("b").cloned().unwrap_or_default(),
                );
                self.read(move |r, _| data::compare(r, &a, &b)).await
            }
            ["api", "search"] => match search::query(&q) {
                Ok(query) => self.read(move |r, _| search::answer(r, &query).map(Some)).await,
                Err(e) => json_response(StatusCode::BAD_REQUEST, &json!({ "error": e.to_string() })),
            },
            ["api", "export", format] => self.export(format, q.get("session").cloned()),
            ["api", "events"] => self.events(),
            // llmtap's own metrics: the same collection of the same instruments as /metrics.
            ["api", "metrics"] => json_response(
                StatusCode::OK,
                &crate::telemetry::exposition::to_json(&self.metrics.families()),
            ),
            _ => text(StatusCode::NOT_FOUND, "not found"),
        }
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

/// The viewer's checks of a request when `[api] token` is set.
struct Credentials {
    token: crate::config::TokenDigest,
    /// The cookie's value (`auth::viewer_cookie`).
    cookie: String,
}

/// What `authorize` allows.
enum Access {
    Granted,
    /// The page was opened with the right `?token=`: redirect without it, setting this cookie.
    TokenInUrl(String),
}

const UNAUTHORIZED: (StatusCode, &str) = (
    StatusCode::UNAUTHORIZED,
    "llmtap viewer: open it once as /?token=<[api] token> (or send Authorization: Bearer <token>)",
);

/// Whether a browser sent this request from another site's page (a link, a form, a script, an image there).
/// Browsers say so in `Sec-Fetch-Site`: only `same-origin` (the viewer's own page) and `none` (typed, a
/// bookmark) are this viewer's; `same-site` is refused too, since another port of the same host is another
/// program. Browsers without it send `Origin` on cross-origin fetches: it must name the Host. A client that
/// sends neither (curl, scripts) is not a browser page and is judged by the token and Host rules alone.
fn is_cross_site(req: &Request<Incoming>) -> bool {
    let header = |name: &str| req.headers().get(name).map(|v| v.to_str().unwrap_or(""));
    if let Some(site) = header("sec-fetch-site") {
        return !(site.eq_ignore_ascii_case("same-origin") || site.eq_ignore_ascii_case("none"));
    }
    let Some(origin) = header("origin") else {
        return false;
    };
    // The viewer speaks plain HTTP; behind a TLS-terminating proxy the page's origin is https.
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    !authority.is_some_and(|a| a.eq_ignore_ascii_case(request_host(req)))
}

/// The request's Host (HTTP/1.1) or authority (HTTP/2); empty when it names none.
fn request_host(req: &Request<Incoming>) -> &str {
    req.headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
        .unwrap_or("")
}

fn session_query(q: &BTreeMap<String, String>) -> SessionQuery {
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
        before: q.get("before").and_then(|b| {
            let (t, id) = b.split_once(':')?;
            Some((t.parse().ok()?, id.to_owned()))
        }),
        limit: q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(SESSION_PAGE),
    }
}

fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn query_params(query: Option<&str>) -> BTreeMap<String, String> {
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
