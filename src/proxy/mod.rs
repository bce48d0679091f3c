//! The data path: accept loop, per-connection hyper server (HTTP/1.1 and h2c), and the per-request handler.
//!
//! The handler does routing, header rewriting and wiring of the taps; it never parses a body. The only contact
//! with the pipeline is the `CaptureTx::send_when_idle` made when the response tap finishes (or here, when the
//! upstream could not be reached at all).

pub mod forward;
pub mod redact;
pub mod route;
pub mod tap;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::capture::{CaptureTx, Captured, ExchangeMeta, Outcome, RawExchange, Timings, exchange_id, now_micros};
use crate::config::Config;
use crate::telemetry::Metrics;
use forward::{Clients, strip_hop_by_hop, upstream_request_headers, upstream_uri};
use route::{Router, detect_api};
use tap::{PendingExchange, RequestSlot, Tap, TapBody};

pub type ProxyBody = Either<TapBody<Incoming>, Full<Bytes>>;

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
    metrics: Arc<Metrics>,
    /// What the captured copy hides (built-in rule plus `capture.redact_headers`).
    redactor: redact::Redactor,
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
            metrics,
            redactor: redact::Redactor::new(&config.capture.redact_headers),
        })
    }

    /// Serve connections until `shutdown` fires, then let in-flight exchanges finish for up to `grace`.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: CancellationToken, grace: Duration) {
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let builder = auto::Builder::new(TokioExecutor::new());
        loop {
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => break,
                a = listener.accept() => a,
            };
            let (stream, _) = match accepted {
                Ok(s) => s,
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%error, "Accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let proxy = self.clone();
            let service = hyper::service::service_fn(move |req| proxy.clone().handle(req));
            let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
            let conn = graceful.watch(conn);
            tokio::spawn(async move {
                if let Err(error) = conn.await {
                    tracing::debug!(%error, "Connection ended with an error");
                }
            });
        }
        drop(listener);
        if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
            tracing::warn!(
                grace_secs = grace.as_secs(),
                "In-flight exchanges did not finish within the grace period"
            );
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
        let path = req.uri().path();
        if let Some(resp) = self.builtin_endpoint(path) {
            return Ok(resp);
        }
        Ok(match self.forward(req).await {
            Ok(resp) => resp,
            Err(e) => e.into_response(),
        })
    }

    /// llmtap's own endpoints on the proxy port. These names are reserved for upstreams.
    fn builtin_endpoint(&self, path: &str) -> Option<Response<ProxyBody>> {
        let (body, content_type) = match path {
            "/metrics" => (self.metrics.render_prometheus(), "text/plain; version=0.0.4"),
            "/healthz" => ("ok\n".to_owned(), "text/plain"),
            _ => return None,
        };
        let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        Some(resp)
    }

    async fn forward(&self, req: Request<Incoming>) -> Result<Response<ProxyBody>, ProxyError> {
        let start = now_micros();
        let (mut parts, body) = req.into_parts();
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

        let (body, pending) = match &self.capture {
            None => (TapBody::new(body, None), None),
            Some(capture_tx) => {
                let meta = exchange_meta(&parts.headers, route.session, route.agent);
                let slot = Arc::new(RequestSlot::default());
                let tap = Tap::request(
                    self.redactor.redact_headers(&parts.headers),
                    self.max_body_bytes,
                    slot.clone(),
                );
                let exchange = RawExchange {
                    id: exchange_id(start),
                    upstream: upstream.name.clone(),
                    api: detect_api(upstream.api, route.rest),
                    method: parts.method.clone(),
                    path: self.redactor.redact_path_and_query(uri.path(), uri.query()),
                    status: None,
                    request: Captured::default(),
                    response: None,
                    timings: Timings {
                        start,
                        ..Timings::default()
                    },
                    outcome: Outcome::Complete,
                    error: None,
                    meta,
                };
                let pending = PendingExchange {
                    exchange,
                    request: slot,
                    capture: capture_tx.clone(),
                };
                (TapBody::new(body, Some(tap)), Some(pending))
            }
        };

        parts.uri = uri;
        upstream_request_headers(&mut parts.headers);
        let upstream_req = Request::from_parts(parts, body);

        let resp = match self.clients.for_upstream(&upstream.name).request(upstream_req).await {
            Ok(resp) => resp,
            Err(error) => {
                self.metrics.upstream_errors.inc();
                let error = ProxyError::Upstream(error_chain(&error));
                if let Some(mut p) = pending {
                    p.exchange.request = p.request.take();
                    p.exchange.timings.end = now_micros();
                    p.exchange.outcome = Outcome::UpstreamError;
                    p.exchange.error = Some(error.to_string());
                    p.capture.send_when_idle(p.exchange);
                }
                return Err(error);
            }
        };

        let (mut parts, body) = resp.into_parts();
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

/// Session metadata: `x-llmtap-*` headers win over the path form. One pass over the headers rather than a map
/// lookup per name (each hashed a non-standard name); the first non-empty value of a name counts.
fn exchange_meta(headers: &http::HeaderMap, path_session: Option<String>, path_agent: Option<String>) -> ExchangeMeta {
    let (mut session, mut agent, mut tags, mut traceparent) = (None, None, None, None);
    for (name, value) in headers {
        let slot = match name.as_str() {
            "x-llmtap-session" => &mut session,
            "x-llmtap-agent" => &mut agent,
            "x-llmtap-tags" => &mut tags,
            "traceparent" => &mut traceparent,
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
    }
}

/// "connect error: Connection refused (os error 111)" rather than hyper's terse top-level message.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
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
        let meta = exchange_meta(&h, Some("from-path".into()), Some("path-agent".into()));
        assert_eq!(meta.session.as_deref(), Some("s-42"));
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
