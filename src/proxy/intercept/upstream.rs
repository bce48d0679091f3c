//! The upstream side of an intercepted connection, over rustls to the real host (public roots plus
//! `[forward] ca_file`, or a configured upstream's `ca_file` for its host), with `[forward] resolve` applied
//! beneath name resolution, so SNI, `Host` and certificate checks keep the host's name.
//!
//! A tunnel whose client speaks HTTP/1.1 holds one upstream connection while it is open ([`TunnelUpstream`]):
//! each open agent connection has one to the real host (the pattern the host would see without llmtap), and a
//! request skips the shared pool's lock, key and bookkeeping. An HTTP/2 tunnel
//! multiplexes, and a plain-HTTP proxy request has no tunnel: both use the pooled clients.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::{GaiResolver, Name};
use hyper_util::rt::TokioExecutor;
use rustc_hash::FxHashMap;
use tower_service::Service;

use super::super::forward::TlsSetupError;
use super::super::tap::{RequestBody, TapBody};
use crate::config::Config;

pub type InterceptClient = Client<HttpsConnector<HttpConnector<Resolver>>, TapBody<RequestBody>>;

/// System resolution, except for the hosts `[forward] resolve` names.
#[derive(Clone)]
pub struct Resolver {
    overrides: Arc<BTreeMap<String, SocketAddr>>,
    system: GaiResolver,
}

type Addrs = Box<dyn Iterator<Item = SocketAddr> + Send>;

impl Service<Name> for Resolver {
    type Response = Addrs;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Addrs, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.system.poll_ready(cx)
    }

    fn call(&mut self, name: Name) -> Self::Future {
        if let Some(addr) = self.overrides.get(name.as_str()) {
            let addr = *addr;
            return Box::pin(async move { Ok(Box::new(std::iter::once(addr)) as Addrs) });
        }
        let lookup = self.system.call(name);
        Box::pin(async move { Ok(Box::new(lookup.await?) as Addrs) })
    }
}

impl Resolver {
    pub fn new(overrides: &BTreeMap<String, SocketAddr>) -> Resolver {
        Resolver {
            overrides: Arc::new(overrides.clone()),
            system: GaiResolver::new(),
        }
    }

    /// Where a blind tunnel to `host:port` connects.
    pub fn target(&self, host: &str, port: u16) -> Option<SocketAddr> {
        self.overrides.get(host).copied().or_else(|| {
            host.parse::<std::net::IpAddr>()
                .ok()
                .map(|ip| SocketAddr::new(ip, port))
        })
    }
}

/// One client per trust configuration: the forward default, and one per configured upstream host with a
/// `ca_file` of its own.
pub struct InterceptClients {
    default: Pair,
    by_host: FxHashMap<String, Pair>,
}

/// The client for requests (HTTP/2 or HTTP/1.1 by ALPN), an HTTP/1.1-only one for WebSocket upgrades (an
/// upgrade cannot ride an HTTP/2 connection the pool might pick), and the HTTP/1.1-only connector a tunnel's
/// own connection is dialled with.
struct Pair {
    requests: InterceptClient,
    upgrades: InterceptClient,
    http1: Connector,
    /// Connections closed tunnels left, for the next tunnels dialled with `http1`.
    lent: Arc<Lent<TunnelBody>>,
}

type Connector = HttpsConnector<HttpConnector<Resolver>>;

fn pair(ca_file: Option<&Path>, resolver: &Resolver) -> Result<Pair, TlsSetupError> {
    let http1 = connector(ca_file, resolver, false)?;
    Ok(Pair {
        requests: pooled(connector(ca_file, resolver, true)?),
        upgrades: pooled(http1.clone()),
        http1,
        lent: Arc::new(Lent::default()),
    })
}

impl InterceptClients {
    pub fn build(config: &Config, resolver: &Resolver) -> Result<InterceptClients, TlsSetupError> {
        let default = pair(config.forward.ca_file.as_deref(), resolver)?;
        let mut by_host = FxHashMap::default();
        for u in config.upstreams.values() {
            if let (Some(ca), Some(host)) = (&u.ca_file, u.url.host()) {
                by_host.insert(host.to_ascii_lowercase(), pair(Some(ca), resolver)?);
            }
        }
        Ok(InterceptClients { default, by_host })
    }

    pub fn for_host(&self, host: &str) -> &InterceptClient {
        &self.by_host.get(host).unwrap_or(&self.default).requests
    }

    pub fn websocket_for(&self, host: &str) -> &InterceptClient {
        &self.by_host.get(host).unwrap_or(&self.default).upgrades
    }

    /// A connection of its own for an HTTP/1.1 tunnel to `host`, dialled at `authority` on its first request.
    pub fn tunnel_upstream(&self, host: &str, authority: &Authority) -> TunnelUpstream {
        let pair = self.by_host.get(host).unwrap_or(&self.default);
        TunnelUpstream {
            connector: pair.http1.clone(),
            lent: pair.lent.clone(),
            authority: authority.clone(),
            host: HeaderValue::from_str(authority.as_str()).ok(),
            sender: Mutex::new(None),
        }
    }
}

fn connector(ca_file: Option<&Path>, resolver: &Resolver, http2: bool) -> Result<Connector, TlsSetupError> {
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(TlsSetupError::Protocols)?
        .with_root_certificates(super::super::forward::root_store(ca_file)?)
        .with_no_client_auth();
    let mut http = HttpConnector::new_with_resolver(resolver.clone());
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1();
    Ok(if http2 {
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.wrap_connector(http)
    })
}

fn pooled(connector: Connector) -> InterceptClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(connector)
}

/// Why a tunnel's own connection could not carry a request.
#[derive(Debug, thiserror::Error)]
pub enum TunnelUpstreamError {
    #[error("cannot connect to {authority}")]
    Connect {
        authority: Authority,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("HTTP/1.1 handshake with {authority} failed")]
    Handshake {
        authority: Authority,
        #[source]
        source: hyper::Error,
    },
    #[error("request to {authority} failed")]
    Send {
        authority: Authority,
        #[source]
        source: hyper::Error,
    },
}

type TunnelBody = TapBody<RequestBody>;

/// The upstream connection of one HTTP/1.1 tunnel: dialled on the tunnel's first request, used for each of its
/// requests in turn (an HTTP/1.1 client sends the next one only after the last response), dialled again when
/// the upstream has closed it. When the tunnel ends, the connection, if idle and open, is lent to the next tunnel
/// to the host (see [`Lent`]); otherwise it closes (hyper ends a connection nobody can send on).
pub struct TunnelUpstream {
    connector: Connector,
    lent: Arc<Lent<TunnelBody>>,
    /// Where the connection goes: the CONNECT target (`host`, or `host:port` off 443).
    authority: Authority,
    /// `authority` as the requests' `Host`, made once per tunnel.
    host: Option<HeaderValue>,
    /// The idle connection's sender; taken by a request while it is sent. A lock per request, never contended
    /// (one request at a time), and never held across an await.
    sender: Mutex<Option<http1::SendRequest<TunnelBody>>>,
}

impl TunnelUpstream {
    /// Sends `req` (its URI absolute, as for the pooled client) and waits for the response head. On a connection
    /// of its own the request line is the origin form, and `Host` the tunnel's authority, as the client sent
    /// them. A request the connection closed under before it was written (the upstream ended an idle keep-alive
    /// connection at that moment) is sent once more on a new connection, as hyper's pooled client does; one
    /// that went out is not repeated.
    pub async fn send(&self, mut req: Request<TunnelBody>) -> Result<Response<Incoming>, TunnelUpstreamError> {
        let path = req.uri().path_and_query().cloned();
        *req.uri_mut() = path.map_or_else(|| Uri::from_static("/"), Uri::from);
        if let Some(host) = &self.host {
            req.headers_mut().insert(http::header::HOST, host.clone());
        }
        let mut retried = false;
        loop {
            let idle = self
                .sender
                .lock()
                .ok()
                .and_then(|mut s| s.take())
                .or_else(|| self.lent.take(&self.authority));
            let mut sender = match idle {
                Some(mut s) => match s.ready().await {
                    Ok(()) => s,
                    Err(_) => self.connect().await?,
                },
                None => self.connect().await?,
            };
            let response = sender.try_send_request(req);
            if let Ok(mut slot) = self.sender.lock() {
                *slot = Some(sender);
            }
            match response.await {
                Ok(resp) => return Ok(resp),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if !retried => {
                        retried = true;
                        req = unsent;
                    }
                    _ => {
                        return Err(TunnelUpstreamError::Send {
                            authority: self.authority.clone(),
                            source: e.into_error(),
                        });
                    }
                },
            }
        }
    }

    async fn connect(&self) -> Result<http1::SendRequest<TunnelBody>, TunnelUpstreamError> {
        let authority = &self.authority;
        let uri = Uri::builder()
            .scheme(Scheme::HTTPS)
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| TunnelUpstreamError::Connect {
                authority: authority.clone(),
                source: Box::new(e),
            })?;
        let mut connector = self.connector.clone();
        let connected = async {
            std::future::poll_fn(|cx| connector.poll_ready(cx)).await?;
            connector.call(uri).await
        };
        let io = connected.await.map_err(|source| TunnelUpstreamError::Connect {
            authority: authority.clone(),
            source,
        })?;
        let (mut sender, conn) =
            http1::Builder::new()
                .handshake(io)
                .await
                .map_err(|source| TunnelUpstreamError::Handshake {
                    authority: authority.clone(),
                    source,
                })?;
        // A task of its own, though each exchange crosses between it and the tunnel's task a few times: polling
        // the connection from the tunnel's task instead (one waker for both sides, as nginx's one loop) was
        // measured to cost more CPU per exchange in the forward benchmark (+9% to +25% against this).
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%error, "Upstream connection of a tunnel ended with an error");
            }
        });
        // A new connection is ready once its handshake is done; this only notices one closed at once.
        sender.ready().await.map_err(|source| TunnelUpstreamError::Send {
            authority: authority.clone(),
            source,
        })?;
        Ok(sender)
    }
}

impl Drop for TunnelUpstream {
    /// The tunnel is over: its connection, idle and open, waits for the next tunnel to the host.
    fn drop(&mut self) {
        if let Some(sender) = self.sender.get_mut().ok().and_then(Option::take) {
            self.lent.give(self.authority.clone(), sender);
        }
    }
}

/// How long a lent connection may wait for a tunnel, and how many wait per host (as the pooled clients).
const LENT_IDLE: Duration = Duration::from_secs(90);
const LENT_PER_HOST: usize = 256;
/// How often the reaper closes lent connections that have waited [`LENT_IDLE`]: one waits at most this much
/// longer.
const REAP_EVERY: Duration = Duration::from_secs(30);

/// Idle upstream connections that closed tunnels left, by authority: a new tunnel takes one instead of dialling
/// (a TLS handshake to the host per client connection would make new connections cost twice what they cost
/// nginx, whose upstream keep-alive pool they share). Each connection's task keeps running while it waits, so
/// one the host closes is seen as closed and skipped. One that has waited [`LENT_IDLE`] is never lent; the
/// reaper (a task started with the first connection lent) closes it within [`REAP_EVERY`], so that connections
/// to a host no tunnel goes to any more do not stay open (a host that keeps idle connections open would keep
/// up to [`LENT_PER_HOST`] sockets and their TLS state for the life of the process).
pub struct Lent<B> {
    idle: Mutex<FxHashMap<Authority, Vec<Waiting<B>>>>,
    reaper: std::sync::Once,
    /// [`LENT_IDLE`] and [`REAP_EVERY`] (shorter in tests).
    max_wait: Duration,
    reap_every: Duration,
}

/// A lent connection's sender, and since when it waits.
type Waiting<B> = (http1::SendRequest<B>, Instant);

impl<B> Default for Lent<B> {
    fn default() -> Self {
        Lent::with_times(LENT_IDLE, REAP_EVERY)
    }
}

impl<B> Lent<B> {
    fn with_times(max_wait: Duration, reap_every: Duration) -> Lent<B> {
        Lent {
            idle: Mutex::new(FxHashMap::default()),
            reaper: std::sync::Once::new(),
            max_wait,
            reap_every,
        }
    }

    fn expired(&self, (sender, since): &Waiting<B>, now: Instant) -> bool {
        sender.is_closed() || now.saturating_duration_since(*since) >= self.max_wait
    }
}

impl<B: Send + 'static> Lent<B> {
    fn take(&self, authority: &Authority) -> Option<http1::SendRequest<B>> {
        let mut idle = self.idle.lock().ok()?;
        let waiting = idle.get_mut(authority)?;
        let now = Instant::now();
        while let Some(entry) = waiting.pop() {
            if !self.expired(&entry, now) {
                return Some(entry.0);
            }
        }
        None
    }

    /// Keeps `sender` if its connection is open and idle (a tunnel whose client left in the middle of a response
    /// leaves a connection hyper will close).
    fn give(self: &Arc<Self>, authority: Authority, mut sender: http1::SendRequest<B>) {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if !matches!(sender.poll_ready(&mut cx), Poll::Ready(Ok(()))) {
            return;
        }
        self.start_reaper();
        let Ok(mut idle) = self.idle.lock() else { return };
        let now = Instant::now();
        let waiting = idle.entry(authority).or_default();
        waiting.retain(|entry| !self.expired(entry, now));
        if waiting.len() < LENT_PER_HOST {
            waiting.push((sender, now));
        }
    }

    /// Drops every lent connection that is closed or has waited [`LENT_IDLE`] by `now` (hyper then closes a
    /// connection nobody can send on), and the hosts left with none.
    fn reap(&self, now: Instant) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.retain(|_, waiting| {
                waiting.retain(|entry| !self.expired(entry, now));
                !waiting.is_empty()
            });
        }
    }

    /// The reaper runs while the clients that own this `Lent` do (it holds it weakly), on the runtime of the
    /// first tunnel that lent a connection. Outside a runtime (never the case for a tunnel) nothing is reaped
    /// but expired connections are still never lent.
    fn start_reaper(self: &Arc<Self>) {
        self.reaper.call_once(|| {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            let (lent, every) = (Arc::downgrade(self), self.reap_every);
            runtime.spawn(async move {
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    match lent.upgrade() {
                        Some(lent) => lent.reap(Instant::now()),
                        None => return,
                    }
                }
            });
        });
    }

    #[cfg(test)]
    fn waiting(&self, authority: &Authority) -> usize {
        self.idle
            .lock()
            .map(|i| i.get(authority).map_or(0, Vec::len))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;

    type TestBody = Full<Bytes>;

    /// A client connection to an in-memory HTTP/1.1 server answering `ok` (and closing the connection after
    /// answering a request that says `x-close`), its connection task running.
    async fn connection() -> http1::SendRequest<TestBody> {
        connection_and_server().await.0
    }

    /// [`connection`], and the server's task: it ends when the connection is closed.
    async fn connection_and_server() -> (http1::SendRequest<TestBody>, tokio::task::JoinHandle<()>) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(async move {
            let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                // `x-endless`: a body that never ends (the connection stays busy).
                let body = if req.headers().contains_key("x-endless") {
                    let endless = futures_util::stream::pending::<Result<hyper::body::Frame<Bytes>, Infallible>>();
                    http_body_util::StreamBody::new(endless).boxed()
                } else {
                    Full::new(Bytes::from_static(b"ok")).boxed()
                };
                let mut resp = Response::new(body);
                if req.headers().contains_key("x-close") {
                    resp.headers_mut()
                        .insert("connection", http::HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(resp)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(server), service)
                .await;
        });
        let (sender, conn) = http1::Builder::new().handshake(TokioIo::new(client)).await.unwrap();
        tokio::spawn(conn);
        (sender, served)
    }

    fn request(header: Option<&'static str>) -> Request<TestBody> {
        let mut req = Request::get("/").header("host", "api.example.com");
        if let Some(name) = header {
            req = req.header(name, "1");
        }
        req.body(Full::new(Bytes::new())).unwrap()
    }

    #[tokio::test]
    async fn an_idle_open_connection_is_lent_to_the_next_tunnel_and_a_closed_or_busy_one_is_not() {
        let lent = Arc::new(Lent::default());
        let host = Authority::from_static("api.example.com");
        let other = Authority::from_static("other.example.com");

        let mut sender = connection().await;
        sender.ready().await.unwrap();
        lent.give(host.clone(), sender);
        assert_eq!(lent.waiting(&host), 1);
        assert!(lent.take(&other).is_none(), "lent by host");
        let mut again = lent.take(&host).expect("the idle connection is lent");
        assert!(lent.take(&host).is_none());

        // It still carries requests; once the server has closed it, it is not kept.
        let resp = again.send_request(request(None)).await.unwrap();
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes().as_ref(), b"ok");
        again.ready().await.unwrap();
        let resp = again.send_request(request(Some("x-close"))).await.unwrap();
        resp.into_body().collect().await.unwrap();
        assert!(again.ready().await.is_err(), "the server closed it");
        lent.give(host.clone(), again);
        assert_eq!(lent.waiting(&host), 0, "a closed connection is not kept");

        // A connection whose response is still being read is busy: not kept.
        let mut busy = connection().await;
        busy.ready().await.unwrap();
        let resp = busy.send_request(request(Some("x-endless"))).await.unwrap();
        lent.give(host.clone(), busy);
        assert_eq!(lent.waiting(&host), 0, "a busy connection is not kept");
        drop(resp);
    }

    /// A lent connection no tunnel takes is closed by the reaper once it has waited its time, and its host is
    /// forgotten; one that has not waited that long is kept.
    #[tokio::test]
    async fn the_reaper_closes_a_lent_connection_that_waited_too_long() {
        let lent = Arc::new(Lent::with_times(Duration::from_millis(100), Duration::from_millis(20)));
        let host = Authority::from_static("api.example.com");
        let (mut sender, server) = connection_and_server().await;
        sender.ready().await.unwrap();
        lent.give(host.clone(), sender);
        assert_eq!(lent.waiting(&host), 1);
        // The server's side ends: the reaper let go of the sender and hyper closed the connection.
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the reaper closed the connection")
            .expect("server task");
        assert!(
            lent.idle.lock().unwrap().is_empty(),
            "a host with nothing lent is forgotten"
        );

        let lent = Arc::new(Lent::with_times(Duration::from_secs(90), Duration::from_secs(30)));
        let mut young = connection().await;
        young.ready().await.unwrap();
        lent.give(host.clone(), young);
        lent.reap(Instant::now() + Duration::from_secs(89));
        assert_eq!(lent.waiting(&host), 1, "not waited long enough");
        lent.reap(Instant::now() + Duration::from_secs(90));
        assert_eq!(lent.waiting(&host), 0);
    }
}
