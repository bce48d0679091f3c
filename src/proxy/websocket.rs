//! WebSocket upgrades (HTTP/1.1 `Upgrade: websocket`): the upgrade is forwarded to the upstream on a connection
//! of its own (TLS with ALPN `http/1.1` for https upstreams), the upstream's 101 goes back to the client with its
//! headers (extensions and subprotocol are agreed end to end), and then [`relay`] copies bytes both ways as they
//! arrive: no re-framing, no buffering beyond one read. Capture is a tee (`capture::websocket`).
//!
//! HTTP/2 clients (RFC 8441 extended CONNECT) are not upgraded: they get the upstream's answer to a plain GET.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body_util::{Either, Empty};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use rustc_hash::FxHashMap;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::sockets::ConnSlot;
use super::tap::TapBody;
use super::{Proxy, ProxyBody, ProxyError, error_chain};
use crate::capture::websocket::{DirectionTap, Protocol, SocketInfo, WsCapture};
use crate::capture::{ExchangeMeta, UnixMicros};
use crate::config::UpstreamConfig;

/// One read's worth: what the relay holds per direction.
const READ_BUF: usize = 16 * 1024;

/// Whether the request asks to become a WebSocket (RFC 6455 §4.1: `Upgrade: websocket`, `Connection: upgrade`).
pub fn is_upgrade(parts: &http::request::Parts) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        parts.headers.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    parts.method == http::Method::GET
        && parts.version == http::Version::HTTP_11
        && has(header::UPGRADE, "websocket")
        && has(header::CONNECTION, "upgrade")
}

#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("the upstream URL has no host")]
    NoHost,
    #[error("connect to {addr} timed out")]
    Timeout { addr: String },
    #[error("connect to {addr}: {source}")]
    Tcp {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid TLS server name {0:?}")]
    ServerName(String),
    #[error("TLS handshake with {addr}: {source}")]
    Tls {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// TLS settings for upgraded connections, per trust configuration (as `forward::Clients`), ALPN `http/1.1`
/// only: an upgrade is an HTTP/1.1 mechanism.
pub struct Connector {
    default: Arc<rustls::ClientConfig>,
    by_upstream: FxHashMap<String, Arc<rustls::ClientConfig>>,
}

impl Connector {
    pub fn build<'a>(
        upstreams: impl IntoIterator<Item = &'a UpstreamConfig>,
    ) -> Result<Connector, super::forward::TlsSetupError> {
        let default = tls_config(super::forward::root_store(None)?)?;
        let mut by_upstream = FxHashMap::default();
        for u in upstreams {
            if let Some(ca) = &u.ca_file {
                by_upstream.insert(u.name.to_string(), tls_config(super::forward::root_store(Some(ca))?)?);
            }
        }
        Ok(Connector { default, by_upstream })
    }

    async fn connect(&self, upstream: &UpstreamConfig, uri: &Uri) -> Result<Box<dyn Io>, ConnectError> {
        let host = uri.host().ok_or(ConnectError::NoHost)?;
        let tls = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let addr = format!("{host}:{port}");
        let tcp = match tokio::time::timeout(Duration::from_secs(10), TcpStream::connect((host, port))).await {
            Err(_) => return Err(ConnectError::Timeout { addr }),
            Ok(Err(source)) => return Err(ConnectError::Tcp { addr, source }),
            Ok(Ok(tcp)) => tcp,
        };
        let _ = tcp.set_nodelay(true);
        if !tls {
            return Ok(Box::new(tcp));
        }
        let config = self.by_upstream.get(upstream.name.as_ref()).unwrap_or(&self.default);
        let name =
            rustls_pki_types::ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']').to_owned())
                .map_err(|_| ConnectError::ServerName(host.to_owned()))?;
        let stream = TlsConnector::from(config.clone())
            .connect(name, tcp)
            .await
            .map_err(|source| ConnectError::Tls { addr, source })?;
        Ok(Box::new(stream))
    }
}

fn tls_config(roots: rustls::RootCertStore) -> Result<Arc<rustls::ClientConfig>, super::forward::TlsSetupError> {
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(super::forward::TlsSetupError::Protocols)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A byte stream to the upstream (plain TCP or TLS).
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Copy bytes between an upgraded client connection and an upgraded upstream connection until both directions
/// have ended, each chunk written on as soon as it is read (back-pressure is the peers' own: a client that
/// does not read stops the upstream's direction, as it would without llmtap). `taps`: (client → upstream,
/// upstream → client), each told what was relayed after it was written. Shared with the forward-proxy tunnel.
pub async fn relay<C, U>(client: C, upstream: U, taps: Option<(DirectionTap, DirectionTap)>)
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let (client_read, client_write) = tokio::io::split(client);
    let (upstream_read, upstream_write) = tokio::io::split(upstream);
    let (from_client, from_upstream) = match taps {
        Some((c, u)) => (Some(c), Some(u)),
        None => (None, None),
    };
    tokio::join!(
        pipe(client_read, upstream_write, from_client),
        pipe(upstream_read, client_write, from_upstream)
    );
}

async fn pipe<R, W>(mut from: R, mut to: W, mut tap: Option<DirectionTap>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; READ_BUF];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).await.is_err() || to.flush().await.is_err() {
            break;
        }
        if let Some(tap) = tap.as_mut() {
            tap.record(&buf[..n]);
        }
    }
    // The peer sees this direction end (a close frame was relayed already, or the connection broke).
    let _ = to.shutdown().await;
    drop(tap);
}

impl Proxy {
    /// Forward an upgrade request; on the upstream's 101, answer the client with it and relay the socket.
    pub(super) async fn websocket(
        &self,
        mut parts: http::request::Parts,
        upstream: Arc<UpstreamConfig>,
        uri: Uri,
        meta: Option<ExchangeMeta>,
        start: UnixMicros,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let Some(client_upgrade) = parts.extensions.remove::<OnUpgrade>() else {
            return Err(ProxyError::BadRequest("the connection cannot be upgraded".into()));
        };
        let slot = parts.extensions.remove::<ConnSlot>();
        let request_headers = meta.as_ref().map(|_| self.redactor.redact_headers(&parts.headers));
        let path = self.redactor.redact_path_and_query(uri.path(), uri.query());
        let io = self
            .ws_connector
            .connect(&upstream, &uri)
            .await
            .map_err(|e| self.upstream_failed(error_chain(&e)))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| self.upstream_failed(error_chain(&e)))?;
        tokio::spawn(conn.with_upgrades());

        // Hop-by-hop headers stay: `Connection: upgrade` and `Upgrade: websocket` are the request. Only llmtap's
        // own and proxy credentials go, and `host` is set to the upstream's.
        let mut headers = std::mem::take(&mut parts.headers);
        headers.remove(header::HOST);
        headers.remove(header::PROXY_AUTHORIZATION);
        let own: Vec<_> = headers
            .keys()
            .filter(|k| k.as_str().starts_with("x-llmtap-"))
            .cloned()
            .collect();
        for k in own {
            headers.remove(k);
        }
        if let Some(authority) = uri.authority()
            && let Ok(host) = HeaderValue::from_str(authority.as_str())
        {
            headers.insert(header::HOST, host);
        }
        let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut request = Request::new(Empty::<Bytes>::new());
        *request.method_mut() = http::Method::GET;
        *request.uri_mut() = path_and_query
            .parse()
            .map_err(|e: http::uri::InvalidUri| ProxyError::BadRequest(e.to_string()))?;
        *request.headers_mut() = headers;
        let mut resp = sender
            .send_request(request)
            .await
            .map_err(|e| self.upstream_failed(error_chain(&e)))?;

        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            // Refused (401, 426, ...): the answer goes back as it came.
            let (mut head, body) = resp.into_parts();
            head.version = http::Version::HTTP_11;
            super::forward::strip_hop_by_hop(&mut head.headers);
            return Ok(Response::from_parts(head, Either::Left(TapBody::new(body, None))));
        }
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let taps = match (meta, request_headers, self.ws_capture()) {
            (Some(meta), Some(request_headers), Some(capture)) => Some(capture.open(SocketInfo {
                upstream: upstream.name.clone(),
                protocol: Protocol::of_path(&path),
                path,
                request_headers,
                response_headers: self.redactor.redact_headers(resp.headers()),
                meta,
                start,
            })),
            _ => None,
        };
        let metrics = self.metrics.clone();
        self.sockets.spawn(slot, async move {
            match tokio::try_join!(client_upgrade, upstream_upgrade) {
                Ok((client, upstream)) => relay(TokioIo::new(client), TokioIo::new(upstream), taps).await,
                Err(error) => {
                    metrics.upstream_errors.inc();
                    tracing::debug!(%error, "A WebSocket upgrade did not complete");
                }
            }
        });
        let (mut head, _) = resp.into_parts();
        head.version = http::Version::HTTP_11;
        Ok(Response::from_parts(
            head,
            Either::Right(http_body_util::Full::new(Bytes::new())),
        ))
    }

    fn upstream_failed(&self, error: String) -> ProxyError {
        self.metrics.upstream_errors.inc();
        ProxyError::Upstream(error)
    }

    /// The capture thread, started with the first captured socket (base-URL mode's and the tunnels' sockets).
    pub(super) fn ws_capture(&self) -> Option<&WsCapture> {
        let capture = self.capture.as_ref()?;
        self.ws_capture
            .get_or_init(|| match WsCapture::start((**capture).clone(), self.max_body_bytes) {
                Ok(c) => Some(c),
                Err(error) => {
                    tracing::error!(%error, "Cannot start the WebSocket capture thread; sockets are relayed uncaptured");
                    None
                }
            })
            .as_ref()
    }
}
