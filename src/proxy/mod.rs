//! The data path: accept loop, per-connection hyper server (HTTP/1.1 and h2c), and the per-request handler.
//!
//! The handler does routing, header rewriting and wiring of the taps; it never parses a body. The only contact
//! with the pipeline is the `CaptureTx::send_when_idle` made when the response tap finishes (or here, when the
//! upstream could not be reached at all).

pub mod conn;
pub mod forward;
pub mod intercept;
pub mod limits;
pub mod redact;
pub mod route;
pub mod sockets;
pub mod tap;
pub mod websocket;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::capture::{CaptureTx, Captured, ExchangeMeta, Outcome, RawExchange, Timings, exchange_id, now_micros};
use crate::config::{Config, ServerConfig};
use crate::provider::detect_api;
use crate::telemetry::{EpisodeLog, EpisodeReport, Metrics, error_chain};
use conn::{Stop, Supervised};
use forward::{Clients, strip_hop_by_hop, upstream_request_headers, upstream_uri};
use limits::{ClientBody, ConnActivity, GuardedBody, Stall};
use route::Router;
use tap::{PendingExchange, RequestBody, RequestSlot, Tap, TapBody};

pub type ProxyBody = Either<TapBody<Incoming>, Full<Bytes>>;
/// What a connection sends back: the body holds its request's place in the connection's in-flight count.
pub type ResponseBody = GuardedBody<ProxyBody>;

/// Why llmtap itself answered instead of the upstream. Decides the status code.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no upstream is configured for path {0:?}; llmtap forwards only /<upstream>/... routes")]
    NoRoute(String),
    #[error("cannot build upstream request: {0}")]
    BadRequest(String),
    #[error("upstream unreachable: {0}")]
    Upstream(String),
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute(_) => StatusCode::NOT_FOUND,
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::Upstream(_) => StatusCode::BAD_GATEWAY,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::NoRoute(_) => "llmtap_no_route",
            ProxyError::BadRequest(_) => "llmtap_bad_request",
            ProxyError::Upstream(_) => "llmtap_upstream_unreachable",
        }
    }

    fn into_response(self) -> Response<ProxyBody> {
        let body = serde_json::json!({"error": {"type": self.kind(), "message": self.to_string()}});
        let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
        *resp.status_mut() = self.status();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        resp
    }
}

pub struct Proxy {
    router: Router,
    clients: Clients,
    /// None when capture is disabled: bodies pass through with no tap at all.
    capture: Option<Arc<CaptureTx>>,
    max_body_bytes: usize,
    server: ServerConfig,
    metrics: Arc<Metrics>,
    accept_errors: EpisodeLog,
    limit_log: EpisodeLog,
    /// What the captured copy hides (built-in rule plus `capture.redact_headers`).
    redactor: redact::Redactor,
    /// Who may read `/metrics`.
    metrics_access: MetricsAccess,
    /// The forward-proxy mode: CONNECT on this port.
    intercept: intercept::Interceptor,
    /// Upgraded (WebSocket) connections to upstreams, and their capture thread once one is captured.
    ws_connector: websocket::Connector,
    ws_capture: std::sync::OnceLock<Option<crate::capture::websocket::WsCapture>>,
    /// The relays of upgraded sockets, which go on after their HTTP connection (see [`sockets`]).
    sockets: sockets::Sockets,
}

/// Who may read `/metrics`: model names and sink error strings are not for everyone who can reach the port.
/// Decided by the address the proxy listens on, as for the API and the viewer (a peer's address says nothing
/// about who is behind a NAT or a port forward): on loopback, anyone who can reach it; beyond, only callers
/// sending `Authorization: Bearer <[api] token>`, and nobody when no token is configured.
enum MetricsAccess {
    Open,
    Token(crate::config::TokenDigest),
    Closed,
}

impl MetricsAccess {
    fn new(config: &Config) -> MetricsAccess {
        match &config.api.token {
            _ if config.listen.ip().is_loopback() => MetricsAccess::Open,
            Some(token) => MetricsAccess::Token(token.digest()),
            None => {
                tracing::info!(
                    listen = %config.listen,
                    "The proxy listens beyond loopback without [api] token: /metrics is not served (403)"
                );
                MetricsAccess::Closed
            }
        }
    }

    /// None: allowed; else the refusal.
    fn refusal(&self, headers: &http::HeaderMap) -> Option<(StatusCode, &'static str)> {
        match self {
            MetricsAccess::Open => None,
            MetricsAccess::Token(digest) => {
                let presented = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
                (!presented.is_some_and(|v| digest.matches_bearer(v))).then_some((
                    StatusCode::UNAUTHORIZED,
                    "llmtap: /metrics beyond loopback needs Authorization: Bearer <[api] token>\n",
                ))
            }
            MetricsAccess::Closed => Some((
                StatusCode::FORBIDDEN,
                "llmtap: /metrics is not served beyond loopback without [api] token\n",
            )),
        }
    }
}

impl Proxy {
    pub fn new(
        config: &Config,
        capture: Option<CaptureTx>,
        metrics: Arc<Metrics>,
    ) -> Result<Proxy, forward::TlsSetupError> {
        Ok(Proxy {
            router: Router::new(config.upstreams.values().cloned()),
            clients: Clients::build(config.upstreams.values())?,
            capture: capture.map(Arc::new),
            max_body_bytes: config.capture.max_body_bytes,
            server: config.server.clone(),
            metrics: metrics.clone(),
            accept_errors: EpisodeLog::default(),
            limit_log: EpisodeLog::default(),
            redactor: redact::Redactor::new(&config.capture.redact_headers),
            metrics_access: MetricsAccess::new(config),
            intercept: intercept::Interceptor::new(config)?,
            ws_connector: websocket::Connector::build(config.upstreams.values())?,
            ws_capture: std::sync::OnceLock::new(),
            sockets: sockets::Sockets::new(metrics),
        })
    }

    /// Serve connections until `shutdown` fires, then let in-flight exchanges finish for up to the configured
    /// grace; connections still open after it are closed (their exchanges are captured as cut short).
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken) {
        // The pipeline's deferral watches this runtime's workers (see `background::cpu::workers`).
        let _ = crate::background::cpu::workers::watch(&tokio::runtime::Handle::current());
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // hyper applies the header timeout only with a timer. For HTTP/1.1 it also runs while a kept-alive
        // connection waits for its next request, so it bounds idle HTTP/1.1 connections too.
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.server.header_read_timeout);
        // HTTP/2: pings find peers that vanished with streams open.
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(30)))
            .keep_alive_timeout(Duration::from_secs(20));
        let slots = Arc::new(tokio::sync::Semaphore::new(self.server.max_connections));
        let connections = tokio_util::task::TaskTracker::new();
        let force_close = CancellationToken::new();
        loop {
            let slot = match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    self.limit_log.success_if_settled();
                    slot
                }
                Err(_) => {
                    self.metrics.connections_at_limit.inc();
                    match self.limit_log.failure() {
                        EpisodeReport::First => tracing::warn!(
                            max_connections = self.server.max_connections,
                            "Connection limit reached; new connections wait in the listen backlog"
                        ),
                        EpisodeReport::Summary { count } => tracing::warn!(
                            max_connections = self.server.max_connections,
                            times = count,
                            "Connection limit still being reached"
                        ),
                        EpisodeReport::Quiet => {}
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        slot = slots.clone().acquire_owned() => match slot {
                            Ok(slot) => slot,
                            Err(_) => break,
                        },
                    }
                }
            };
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => break,
                a = listener.accept() => a,
            };
            let (stream, _) = match accepted {
                Ok(s) => {
                    if let Some(missed) = self.accept_errors.success_if_settled()
                        && missed > 0
                    {
                        tracing::info!(failures = missed + 1, "Accepting connections again");
                    }
                    s
                }
                Err(error) => {
                    self.metrics.accept_errors.inc();
                    match self.accept_errors.failure() {
                        EpisodeReport::First => tracing::warn!(%error, "Accept failed; retrying"),
                        EpisodeReport::Summary { count } => {
                            tracing::warn!(%error, failures = count, "Accept still failing")
                        }
                        // Every failure at debug level: what a test (or an operator) watching one episode
                        // sees while the listener cannot serve /metrics.
                        EpisodeReport::Quiet => tracing::debug!(%error, "Accept retry failed"),
                    }
                    // EMFILE and friends: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let scope = ConnScope {
                slot: Arc::new(slot),
                tasks: connections.clone(),
                drain: shutdown.clone(),
                force: force_close.clone(),
            };
            let activity = ConnActivity::new();
            let proxy = self.clone();
            let service_activity = activity.clone();
            let service_scope = scope.clone();
            let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                let active = service_activity.begin();
                // Only a CONNECT takes the connection's scope (its tunnel goes on in the connection's place); an
                // upgrade request carries the connection's slot, which its socket keeps (see `sockets`).
                let scope = (req.method() == http::Method::CONNECT).then(|| service_scope.clone());
                // An LLM call is a POST: only a GET can be a WebSocket upgrade, so most requests skip the lookup.
                if req.method() == http::Method::GET && req.headers().contains_key(header::UPGRADE) {
                    req.extensions_mut()
                        .insert(sockets::ConnSlot(service_scope.slot.clone()));
                }
                let req = req.map(|body| ClientBody::new(body, service_activity.clone()));
                let proxy = proxy.clone();
                async move {
                    let resp = proxy.handle(req, scope).await?;
                    Ok::<_, Infallible>(resp.map(|body| GuardedBody::new(body, active)))
                }
            });
            // With upgrades: a CONNECT's connection is handed to its tunnel (`intercept`).
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            // Draining: HTTP/1.1 finishes the request in flight and closes, HTTP/2 sends GOAWAY.
            let supervised = self.supervise(conn, activity, &scope, |conn: Pin<&mut _>| conn.graceful_shutdown());
            connections.spawn(async move {
                let _slot = scope.slot;
                supervised.await;
            });
        }
        drop(listener);
        // Every connection saw `shutdown` and is draining; they are all done when their tasks are.
        connections.close();
        let grace = self.server.shutdown_grace;
        let drained = tokio::time::timeout(grace, connections.wait()).await.is_ok();
        // WebSocket relays are not waited for (see `sockets`): they close once the HTTP exchanges are done.
        self.sockets.close().await;
        if !drained {
            tracing::warn!(
                grace_secs = grace.as_secs(),
                "In-flight exchanges did not finish within the grace period; closing their connections"
            );
        }
        // Dropping a connection drops its requests' handlers and bodies: their taps finish (captured as cut
        // short) and release the capture queue.
        force_close.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), connections.wait()).await;
        // The closed sockets' capture goes down the capture queue before the pipeline is told to stop.
        let proxy = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(Some(ws)) = proxy.ws_capture.get() {
                ws.close();
            }
        })
        .await;
    }

    /// A client connection under its watchers: closed when idle or stalled, drained (`drain` called on it) when
    /// shutdown begins, closed when the grace is over. One place for base-URL connections and the forward mode's
    /// intercepted ones.
    fn supervise<C, F>(&self, conn: C, activity: Arc<ConnActivity>, scope: &ConnScope, drain: F) -> Supervised<C, F>
    where
        F: FnMut(Pin<&mut C>),
    {
        let idle = self.server.idle_timeout;
        let (read, send) = (self.server.body_read_timeout, self.server.send_timeout);
        let (draining, force) = (scope.drain.clone(), scope.force.clone());
        let watcher = {
            let (activity, force, metrics) = (activity.clone(), force.clone(), self.metrics.clone());
            Box::pin(async move {
                tokio::select! {
                    _ = activity.idle_for(idle) => Stop::Idle,
                    stall = activity.stalled(read, send) => stalled(&metrics, stall),
                    _ = draining.cancelled() => Stop::Drain,
                    _ = force.cancelled() => Stop::Close,
                }
            })
        };
        let metrics = self.metrics.clone();
        let after_drain = Box::pin(async move {
            tokio::select! {
                _ = activity.idle_for(idle) => Stop::Idle,
                stall = activity.stalled(read, send) => stalled(&metrics, stall),
                _ = force.cancelled() => Stop::Close,
            }
        });
        Supervised::new(conn, watcher, after_drain, drain)
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<ClientBody<Incoming>>,
        scope: Option<ConnScope>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        if let Some(scope) = scope {
            return Ok(intercept::connect(&self, req, scope).await);
        }
        if intercept::is_absolute_form(&req) {
            return Ok(intercept::plain_request(&self, req).await);
        }
        if let Some(resp) = self.builtin_endpoint(&req) {
            return Ok(resp);
        }
        Ok(match self.forward(req).await {
            Ok(resp) => resp,
            Err(e) => e.into_response(),
        })
    }

    /// llmtap's own endpoints on the proxy port. These names are reserved for upstreams.
    fn builtin_endpoint<B>(&self, req: &Request<B>) -> Option<Response<ProxyBody>> {
        let (body, content_type) = match req.uri().path() {
            "/metrics" => match self.metrics_access.refusal(req.headers()) {
                None => (
                    self.metrics.render_prometheus(),
                    crate::telemetry::exposition::CONTENT_TYPE,
                ),
                Some((status, message)) => {
                    let mut resp = Response::new(Either::Right(Full::new(Bytes::from_static(message.as_bytes()))));
                    *resp.status_mut() = status;
                    resp.headers_mut()
                        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
                    return Some(resp);
                }
            },
            "/healthz" => ("ok\n".to_owned(), "text/plain"),
            _ => return None,
        };
        let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        Some(resp)
    }

    async fn forward(&self, req: Request<ClientBody<Incoming>>) -> Result<Response<ProxyBody>, ProxyError> {
        // Read only for a captured exchange: with capture off the clock is not read at all.
        let start = self.capture.is_some().then(now_micros).unwrap_or_default();
        let (mut parts, body) = req.into_parts();
        if route::has_dot_segment(parts.uri.path()) {
            self.metrics.requests_unrouted.inc();
            return Err(ProxyError::BadRequest(format!(
                "path {:?} has a '.' or '..' segment; llmtap does not forward such paths",
                parts.uri.path()
            )));
        }
        let Some(route) = self.router.route(parts.uri.path()) else {
            self.metrics.requests_unrouted.inc();
            return Err(ProxyError::NoRoute(parts.uri.path().to_owned()));
        };
        self.metrics.requests.inc();
        let upstream = route.upstream.clone();
        let head_request = parts.method == http::Method::HEAD;
        let query = parts.uri.query().map(str::to_owned);
        let uri =
            upstream_uri(&upstream, route.rest, query.as_deref()).map_err(|e| ProxyError::BadRequest(e.to_string()))?;
        if websocket::is_upgrade(&parts) {
            let meta = self
                .capture
                .is_some()
                .then(|| exchange_meta(&parts.headers, route.session, route.agent));
            return self.websocket(parts, upstream, uri, meta, start).await;
        }

        let (body, pending) = match &self.capture {
            None => (TapBody::new(RequestBody::new(body, None), None), None),
            Some(capture_tx) => {
                let head = ExchangeHead {
                    upstream: upstream.name.clone(),
                    api: detect_api(upstream.api(), route.rest),
                    method: parts.method.clone(),
                    path: self.redactor.redact_path_and_query(uri.path(), uri.query()),
                    start,
                    meta: exchange_meta(&parts.headers, route.session, route.agent),
                };
                let headers = self.redactor.redact_headers(&parts.headers);
                let (body, pending) = self.tap_request(capture_tx, body, headers, head);
                (body, Some(pending))
            }
        };

        parts.uri = uri;
        // The upstream connection's version is its own (ALPN, or HTTP/1.1 for plain http://): an HTTP/2
        // client's request goes to an HTTP/1.1-only upstream as HTTP/1.1, and the other way round.
        parts.version = http::Version::HTTP_11;
        upstream_request_headers(&mut parts.headers);
        let upstream_req = Request::from_parts(parts, body);

        let sent = self.clients.for_upstream(&upstream.name).request(upstream_req);
        self.await_upstream(pending, head_request, sent).await
    }

    /// The request body teed into a new exchange's capture, and the exchange that waits for the upstream's
    /// answer; one place for base-URL mode and the forward-proxy tunnel. The body keeps what hyper may leave
    /// unread (see [`AwaitingUpstream::capture_rest`]).
    fn tap_request(
        &self,
        capture: &Arc<CaptureTx>,
        body: ClientBody<Incoming>,
        headers: crate::capture::HeaderList,
        head: ExchangeHead,
    ) -> (TapBody<RequestBody>, PendingExchange) {
        let slot = Arc::new(RequestSlot::default());
        let tap = Tap::request(headers, self.max_body_bytes, capture.budget().clone(), slot.clone());
        let exchange = RawExchange {
            id: exchange_id(head.start),
            upstream: head.upstream,
            api: head.api,
            method: head.method,
            path: head.path,
            status: None,
            request: Captured::default(),
            response: None,
            timings: Timings {
                start: head.start,
                ..Timings::default()
            },
            outcome: Outcome::Complete,
            error: None,
            meta: head.meta,
            charge: Default::default(),
        };
        let body = TapBody::new(RequestBody::new(body, Some(slot.clone())), Some(tap));
        let pending = PendingExchange {
            exchange,
            request: slot,
            capture: capture.clone(),
        };
        (body, pending)
    }

    /// The upstream's answer to a request sent (`sent`), captured and handed to the client as it streams; one
    /// place for base-URL mode and the forward-proxy tunnel. Until the upstream answers, the exchange is
    /// captured even if this future is dropped (the client went away, or shutdown closed the connection).
    async fn await_upstream(
        &self,
        pending: Option<PendingExchange>,
        head_request: bool,
        sent: impl Future<Output = Result<Response<Incoming>, impl std::error::Error>>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let mut waiting = AwaitingUpstream(pending);
        let resp = match sent.await {
            Ok(resp) => resp,
            Err(error) => {
                self.metrics.upstream_errors.inc();
                let error = ProxyError::Upstream(error_chain(&error));
                // The request never went out: what the client sent is still worth keeping (it is the call to debug).
                waiting.capture_rest(self.max_body_bytes).await;
                waiting.send(Outcome::UpstreamError, error.to_string());
                return Err(error);
            }
        };
        let pending = waiting.0.take();

        let (mut parts, body) = resp.into_parts();
        // The client's connection has its own version; hyper's server writes its own.
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        let tap = pending.map(|mut p| {
            p.exchange.status = Some(parts.status.as_u16());
            Tap::response(self.redactor.redact_headers(&parts.headers), self.max_body_bytes, p)
        });
        let mut body = TapBody::new(body, tap);
        let s = parts.status;
        if head_request || s.is_informational() || s == StatusCode::NO_CONTENT || s == StatusCode::NOT_MODIFIED {
            body.finish_bodiless();
        }
        Ok(Response::from_parts(parts, Either::Left(body)))
    }
}

/// What a client connection's task holds from the accept loop: its slot under `server.max_connections`, the
/// task tracker shutdown waits on, and shutdown's drain and force-close signals. A CONNECT's tunnel takes them
/// over when hyper hands it the connection, so a tunnel counts as the connection it is and drains with the rest.
#[derive(Clone)]
struct ConnScope {
    slot: Arc<tokio::sync::OwnedSemaphorePermit>,
    tasks: tokio_util::task::TaskTracker,
    drain: CancellationToken,
    force: CancellationToken,
}

/// A stalled client's connection is closed: counted, and logged at debug level (a client's doing, not llmtap's).
fn stalled(metrics: &Metrics, stall: Stall) -> Stop {
    match stall {
        Stall::Reading => metrics.body_read_timeouts.inc(),
        Stall::Sending => metrics.send_timeouts.inc(),
    }
    tracing::debug!(?stall, "Closing a connection whose client stalled");
    Stop::Stalled
}

/// What a captured exchange is known by before its request body is read.
struct ExchangeHead {
    upstream: Arc<str>,
    api: crate::capture::Api,
    method: http::Method,
    /// Path and query as sent upstream, secrets redacted.
    path: String,
    start: crate::capture::UnixMicros,
    meta: ExchangeMeta,
}

/// An exchange sent to the upstream whose response head has not arrived. Dropped while still holding it (the
/// handler was dropped: the client left, or shutdown closed its connection), it is captured as `client_gone`
/// with what the request tap kept, instead of vanishing.
struct AwaitingUpstream(Option<PendingExchange>);

/// How long the error path waits for the rest of a request body hyper never read (see
/// [`AwaitingUpstream::capture_rest`]): a body the client has sent is in the socket already; one it is still
/// producing is not waited for longer than this before the client gets its 502.
const REST_OF_REQUEST_WAIT: Duration = Duration::from_secs(2);

impl AwaitingUpstream {
    /// The upstream could not be reached and hyper dropped the request unread: read the rest of the body from the
    /// client through a tap that goes on from what was captured, so that the trace keeps the request.
    async fn capture_rest(&mut self, cap: usize) {
        use http_body_util::BodyExt;
        let Some(p) = self.0.as_mut() else { return };
        let Some(rest) = p.request.take_rest() else { return };
        let captured = p.request.take();
        let tap = Tap::resume_request(captured, cap, p.capture.budget().clone(), p.request.clone());
        let mut body = TapBody::new(rest, Some(tap));
        let read_all = async { while let Some(Ok(_)) = body.frame().await {} };
        let _ = tokio::time::timeout(REST_OF_REQUEST_WAIT, read_all).await;
        // Dropping the body finishes the tap: ended if the end came, cut (and so truncated) if not.
        drop(body);
    }

    /// `error` becomes a `String` only when there is an exchange to send: every answered call drops an empty
    /// one, and a message made for it would be an allocation per call.
    fn send(&mut self, outcome: Outcome, error: impl Into<String>) {
        if let Some(mut p) = self.0.take() {
            if outcome == Outcome::ClientGone {
                p.capture.metrics().client_gone.inc();
            }
            p.exchange.request = p.request.take();
            p.exchange.timings.end = now_micros();
            p.exchange.outcome = outcome;
            p.exchange.error = Some(error.into());
            p.capture.send_when_idle(p.exchange);
        }
    }
}

impl Drop for AwaitingUpstream {
    fn drop(&mut self) {
        self.send(
            Outcome::ClientGone,
            "the client went away (or llmtap shut down) before the upstream answered",
        );
    }
}

/// Session metadata: `x-llmtap-*` headers win over the path form. One pass over the headers rather than a map
/// lookup per name (each hashed a non-standard name); the first non-empty value of a name counts.
fn exchange_meta(headers: &http::HeaderMap, path_session: Option<String>, path_agent: Option<String>) -> ExchangeMeta {
    let (mut session, mut agent, mut tags, mut traceparent) = (None, None, None, None);
    let (mut claude, mut codex) = (None, None);
    for (name, value) in headers {
        let slot = match name.as_str() {
            "x-llmtap-session" => &mut session,
            "x-llmtap-agent" => &mut agent,
            "x-llmtap-tags" => &mut tags,
            "traceparent" => &mut traceparent,
            // Clients' own session ids (docs/architecture.md, "Sessions"): Claude Code 2.1.86+, and Codex CLI
            // (`session-id` in current releases, `session_id` / `conversation_id` in earlier ones).
            "x-claude-code-session-id" => &mut claude,
            "session-id" | "session_id" | "conversation_id" => &mut codex,
            _ => continue,
        };
        if slot.is_none() {
            *slot = value
                .to_str()
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned);
        }
    }
    ExchangeMeta {
        session: session.or(path_session),
        client_session: claude.or(codex),
        agent: agent.or(path_agent),
        tags: tags
            .map(|t: String| {
                t.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default(),
        traceparent,
        replay_of: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_headers_win_over_the_path_and_empty_values_do_not_count() {
        let mut h = http::HeaderMap::new();
        h.insert("x-llmtap-session", " s-42 ".parse().unwrap());
        h.insert("x-llmtap-agent", "".parse().unwrap());
        h.insert("x-llmtap-tags", "a, b,,c".parse().unwrap());
        h.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("session_id", "codex-1".parse().unwrap());
        h.insert("x-claude-code-session-id", "cc-1".parse().unwrap());
        let meta = exchange_meta(&h, Some("from-path".into()), Some("path-agent".into()));
        assert_eq!(meta.session.as_deref(), Some("s-42"));
        assert_eq!(
            meta.client_session.as_deref(),
            Some("cc-1"),
            "Claude Code's header wins"
        );
        assert_eq!(
            meta.agent.as_deref(),
            Some("path-agent"),
            "an empty header leaves the path's value"
        );
        assert_eq!(meta.tags, ["a", "b", "c"]);
        assert_eq!(
            meta.traceparent.as_deref(),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        let none = exchange_meta(&http::HeaderMap::new(), None, None);
        assert_eq!(none, ExchangeMeta::default());
    }
}
