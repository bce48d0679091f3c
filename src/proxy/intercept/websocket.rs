//! WebSocket upgrades on intercepted hosts (Codex's Responses WebSocket, realtime APIs). The handshake goes to
//! the real host over HTTP/1.1 with its upgrade headers; once both sides switched protocols, the two upgraded
//! connections are joined by base-URL mode's relay (`proxy::websocket::relay`), with the same capture tee
//! (Responses WebSocket turns, Realtime responses, other sockets raw) when the path is one llmtap reads.

use http::{Request, Response, StatusCode, Uri, header};
use http_body_util::Either;
use hyper::body::Incoming;

use super::super::limits::ClientBody;
use super::super::sockets::ConnSlot;
use hyper_util::rt::TokioIo;

use crate::capture::websocket::{Protocol, SocketInfo};

use super::super::tap::{RequestBody, TapBody};
use super::super::{Proxy, ProxyBody, ProxyError, error_chain, exchange_meta};
use super::upstream::InterceptClient;

/// An HTTP/1.1 `Upgrade` request (RFC 9110 §7.8). HTTP/2's extended CONNECT is not offered to clients.
pub fn is_upgrade(req: &Request<ClientBody<Incoming>>) -> bool {
    req.version() == http::Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Who the socket is, for its capture: the tunnel's upstream label and session.
pub struct SocketOrigin {
    pub upstream: std::sync::Arc<str>,
    pub session: Option<String>,
    /// Whether the host's capture covers the path (on chatgpt.com only `/backend-api/codex/`); a socket on an
    /// unknown path of an intercepted host is kept raw, as an unknown path's exchange is.
    pub captured: bool,
}

/// Sends the upgrade request on, and answers the client with the upstream's answer. A `101` joins the two
/// connections once hyper has handed both over, with a capture tee when `origin.captured`; anything else is an
/// ordinary (uncaptured) response.
pub async fn relay(
    proxy: &Proxy,
    client: &InterceptClient,
    mut req: Request<ClientBody<Incoming>>,
    uri: Uri,
    origin: SocketOrigin,
) -> Result<Response<ProxyBody>, ProxyError> {
    let start = crate::capture::now_micros();
    let from_client = hyper::upgrade::on(&mut req);
    let slot = req.extensions_mut().remove::<ConnSlot>();
    let capture = origin.captured.then(|| {
        let meta = exchange_meta(req.headers(), origin.session.clone(), None);
        let mut headers = req.headers().clone();
        if !headers.contains_key(header::HOST)
            && let Some(authority) = uri.authority()
            && let Ok(host) = http::HeaderValue::from_str(authority.as_str())
        {
            headers.insert(header::HOST, host);
        }
        (meta, proxy.redactor.redact_headers(&headers))
    });
    let path = proxy.redactor.redact_path_and_query(uri.path(), uri.query());
    let (mut parts, body) = req.into_parts();
    parts.uri = uri;
    // The upgrade headers stay: they are the request. Only what was meant for llmtap goes.
    parts.headers.remove(header::HOST);
    parts.headers.remove(header::PROXY_AUTHORIZATION);
    let upstream_req = Request::from_parts(parts, TapBody::new(RequestBody::new(body, None), None));
    let mut resp = client
        .request(upstream_req)
        .await
        .map_err(|e| ProxyError::Upstream(error_chain(&e)))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let from_upstream = hyper::upgrade::on(&mut resp);
        let taps = match (capture, proxy.ws_capture()) {
            (Some((meta, request_headers)), Some(ws)) => Some(ws.open(SocketInfo {
                upstream: origin.upstream,
                protocol: Protocol::of_path(&path),
                path,
                request_headers,
                response_headers: proxy.redactor.redact_headers(resp.headers()),
                meta,
                start,
            })),
            _ => None,
        };
        proxy.sockets.spawn(slot, async move {
            match tokio::try_join!(from_client, from_upstream) {
                Ok((client, upstream)) => {
                    super::super::websocket::relay(TokioIo::new(client), TokioIo::new(upstream), taps).await
                }
                Err(error) => tracing::debug!(%error, "WebSocket upgrade did not complete"),
            }
        });
    }
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Either::Left(TapBody::new(body, None))))
}
