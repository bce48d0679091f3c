//! One decrypted request inside an intercepted tunnel (or one plain-HTTP request sent to llmtap as a forward
//! proxy): forwarded to the real host with its `Host`, path and bytes unchanged, and captured with the same taps,
//! redaction and hand-off as base-URL mode (`Proxy::forward`); only the routing differs (the target is the
//! CONNECT host or the request's absolute URI, not a path prefix).

use std::sync::Arc;

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use hyper::body::Incoming;

use super::super::limits::ClientBody;

use super::super::forward::upstream_request_headers;
use super::super::tap::{RequestBody, TapBody};
use super::super::{ExchangeHead, Proxy, ProxyBody, ProxyError, exchange_meta};
use super::Target;
use super::hosts::Intercepted;
use super::upstream::TunnelUpstream;
use super::websocket;
use crate::capture::now_micros;

pub struct Tunnel {
    proxy: Arc<Proxy>,
    host: String,
    /// `host` or `host:port` (port left out when 443, so the upstream `Host` is what the client sent).
    authority: Authority,
    /// The exchange's `upstream`: the configured upstream serving this host (as base-URL mode names it), else
    /// the host itself.
    label: Arc<str>,
    session: Option<String>,
    /// None: a host off the intercept list (plain HTTP only; a CONNECT to one is a blind byte tunnel).
    intercepted: Option<Intercepted>,
    /// `https` inside a CONNECT tunnel, `http` for a plain-HTTP proxy request.
    scheme: Scheme,
    /// An HTTP/1.1 tunnel's own upstream connection (see [`TunnelUpstream`]); None: the pooled client.
    own: Option<TunnelUpstream>,
}

impl Tunnel {
    pub fn new(proxy: Arc<Proxy>, target: Target, intercepted: Option<Intercepted>, scheme: Scheme) -> Tunnel {
        let default_port = if scheme == Scheme::HTTP { 80 } else { 443 };
        let text = if target.port == default_port {
            target.host.clone()
        } else if target.host.contains(':') {
            format!("[{}]:{}", target.host, target.port)
        } else {
            format!("{}:{}", target.host, target.port)
        };
        let authority = text
            .parse()
            .unwrap_or_else(|_| Authority::from_static("invalid.invalid"));
        let label = proxy
            .intercept
            .label_for(&target.host, target.port)
            .unwrap_or_else(|| Arc::from(text.as_str()));
        Tunnel {
            proxy,
            host: target.host,
            authority,
            label,
            session: target.session,
            intercepted,
            scheme,
            own: None,
        }
    }

    /// Requests go over one upstream connection of the tunnel's own: its client speaks HTTP/1.1, one request
    /// at a time.
    pub fn with_own_connection(mut self) -> Tunnel {
        self.own = Some(
            self.proxy
                .intercept
                .clients
                .tunnel_upstream(&self.host, &self.authority),
        );
        self
    }

    pub async fn handle(&self, req: Request<ClientBody<Incoming>>) -> Response<ProxyBody> {
        match self.forward(req).await {
            Ok(resp) => resp,
            Err(e) => e.into_response(),
        }
    }

    fn api_for(&self, path: &str) -> Option<crate::capture::Api> {
        self.intercepted.as_ref().and_then(|i| i.api_for(path))
    }

    fn upstream_uri(&self, req: &Request<ClientBody<Incoming>>) -> Result<Uri, ProxyError> {
        let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .map_err(|e| ProxyError::BadRequest(e.to_string()))
    }

    async fn forward(&self, req: Request<ClientBody<Incoming>>) -> Result<Response<ProxyBody>, ProxyError> {
        let proxy = &self.proxy;
        let uri = self.upstream_uri(&req)?;
        let clients = &proxy.intercept.clients;
        if websocket::is_upgrade(&req) {
            let origin = websocket::SocketOrigin {
                upstream: self.label.clone(),
                session: self.session.clone(),
                captured: self.api_for(req.uri().path()).is_some(),
            };
            return websocket::relay(proxy, clients.websocket_for(&self.host), req, uri, origin).await;
        }
        let api = self.api_for(req.uri().path());
        let capture = proxy.capture.as_ref().filter(|_| api.is_some());
        let start = capture.is_some().then(now_micros).unwrap_or_default();
        let (mut parts, body) = req.into_parts();
        proxy.metrics.requests.inc();
        let head_request = parts.method == http::Method::HEAD;

        let (body, pending) = match (capture, api) {
            (Some(capture_tx), Some(api)) => {
                let meta = exchange_meta(&parts.headers, self.session.clone(), None);
                // An HTTP/2 client names the host in `:authority`, not a header: the stored request says which
                // host it went to either way.
                let headers = if parts.headers.contains_key(header::HOST) {
                    proxy.redactor.redact_headers(&parts.headers)
                } else {
                    let mut with_host = parts.headers.clone();
                    if let Ok(v) = HeaderValue::from_str(self.authority.as_str()) {
                        with_host.insert(header::HOST, v);
                    }
                    proxy.redactor.redact_headers(&with_host)
                };
                let head = ExchangeHead {
                    upstream: self.label.clone(),
                    api,
                    method: parts.method.clone(),
                    path: proxy.redactor.redact_path_and_query(uri.path(), uri.query()),
                    start,
                    meta,
                };
                let (body, pending) = proxy.tap_request(capture_tx, body, headers, head);
                (body, Some(pending))
            }
            _ => (TapBody::new(RequestBody::new(body, None), None), None),
        };

        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        // `host` goes too, and is set again from the authority the client connected to (and named in its own
        // `Host`): by hyper's pooled client from the URI, by the tunnel's own connection from its authority.
        upstream_request_headers(&mut parts.headers);
        let upstream_req = Request::from_parts(parts, body);
        match &self.own {
            Some(own) => {
                proxy
                    .await_upstream(pending, head_request, own.send(upstream_req))
                    .await
            }
            None => {
                let sent = clients.for_host(&self.host).request(upstream_req);
                proxy.await_upstream(pending, head_request, sent).await
            }
        }
    }
}
