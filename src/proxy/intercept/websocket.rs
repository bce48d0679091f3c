//! WebSocket upgrades on intercepted hosts (Codex's Responses WebSocket, realtime APIs): relayed, not
//! captured. The handshake goes to the real host over HTTP/1.1 with its upgrade headers; once both sides
//! switched protocols, the two upgraded connections are joined by [`join`], which is where a capture of the
//! frames would tap in.

use http::{Request, Response, StatusCode, Uri, header};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::super::tap::TapBody;
use super::super::{ProxyBody, ProxyError, error_chain};
use super::body::UpstreamBody;
use super::upstream::InterceptClient;

/// An HTTP/1.1 `Upgrade` request (RFC 9110 §7.8). HTTP/2's extended CONNECT is not offered to clients.
pub fn is_upgrade(req: &Request<Incoming>) -> bool {
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

/// Sends the upgrade request on, and answers the client with the upstream's answer. A `101` joins the two
/// connections once hyper has handed both over; anything else is an ordinary (uncaptured) response.
pub async fn relay(
    client: &InterceptClient,
    mut req: Request<Incoming>,
    uri: Uri,
) -> Result<Response<ProxyBody>, ProxyError> {
    let from_client = hyper::upgrade::on(&mut req);
    let (mut parts, body) = req.into_parts();
    parts.uri = uri;
    // The upgrade headers stay: they are the request. Only what was meant for llmtap goes.
    parts.headers.remove(header::HOST);
    parts.headers.remove(header::PROXY_AUTHORIZATION);
    let upstream_req = Request::from_parts(parts, UpstreamBody::plain(TapBody::new(body, None)));
    let mut resp = client
        .request(upstream_req)
        .await
        .map_err(|e| ProxyError::Upstream(error_chain(&e)))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let from_upstream = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            match tokio::try_join!(from_client, from_upstream) {
                Ok((client, upstream)) => join(TokioIo::new(client), TokioIo::new(upstream)).await,
                Err(error) => tracing::debug!(%error, "WebSocket upgrade did not complete"),
            }
        });
    }
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Either::Left(TapBody::new(body, None))))
}

/// Both directions of an upgraded connection, byte for byte, until either side closes.
async fn join<C, U>(mut client: C, mut upstream: U)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if let Err(error) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        tracing::debug!(%error, "WebSocket relay ended with an error");
    }
}
