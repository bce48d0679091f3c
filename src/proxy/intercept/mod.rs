//! The forward-proxy mode: `CONNECT host:port` on the proxy port (`HTTPS_PROXY=http://127.0.0.1:8787`).
//!
//! For a host on the intercept list ([`hosts`]) llmtap answers `200`, terminates the client's TLS with a
//! certificate for that host minted from its own CA ([`ca`]), and serves the decrypted HTTP/1.1 or HTTP/2
//! requests like base-URL mode does: each is forwarded to the real host over rustls ([`upstream`]), unchanged
//! (its `Host`, path and bytes), and captured with the same taps and adapters ([`relay`]). Any other target is
//! a blind byte tunnel: connected, relayed, counted, never decrypted or stored.
//!
//! Plain HTTP through the proxy (`HTTP_PROXY`: `GET http://host/path HTTP/1.1`, the absolute form) is served
//! by [`plain`]: forwarded to the named host, captured when the host is on the intercept list.
//!
//! The same port serves both modes: a CONNECT request or an absolute-form URI is what base-URL mode never
//! receives, so one address covers `ANTHROPIC_BASE_URL`, `HTTPS_PROXY` and `HTTP_PROXY` alike, and the
//! listening limits apply to all.

pub mod ca;
pub mod hosts;
mod plain;
mod relay;
pub mod upstream;
mod websocket;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use subtle::ConstantTimeEq;

use super::forward::TlsSetupError;
use super::{ConnScope, Proxy, ProxyBody};
use crate::config::{ApiToken, Config};
use crate::telemetry::{EpisodeLog, EpisodeReport};
use hosts::{InterceptList, Intercepted};
pub(super) use plain::{is_absolute_form, plain_request};
use upstream::{InterceptClients, Resolver};

/// The proxy-credential user name that carries no session (`http://llmtap:<token>@host:port`).
pub const PLAIN_USER: &str = "llmtap";

/// Who may open a tunnel.
enum Access {
    /// Loopback listener: anyone who can reach it (the same trust as base-URL mode).
    Open,
    /// Beyond loopback: `Proxy-Authorization` must carry the `[api] token`.
    Token(ApiToken),
    /// Beyond loopback without a token: CONNECT is refused (never an open proxy).
    Closed,
}

pub struct Interceptor {
    list: InterceptList,
    /// Configured upstreams by (host, port): an exchange on such a host is named for its upstream.
    labels: rustc_hash::FxHashMap<(String, u16), Arc<str>>,
    data_dir: PathBuf,
    /// Made (or loaded) on the first intercepted CONNECT; None if that failed (logged; tunnels go blind).
    ca: OnceLock<Option<Arc<ca::Ca>>>,
    clients: InterceptClients,
    resolver: Resolver,
    access: Access,
    header_read_timeout: Duration,
    handshake_log: EpisodeLog,
    connect_log: EpisodeLog,
    uncovered_log: EpisodeLog,
}

impl Interceptor {
    pub fn new(config: &Config) -> Result<Interceptor, TlsSetupError> {
        let resolver = Resolver::new(&config.forward.resolve);
        let access = if config.listen.ip().is_loopback() {
            Access::Open
        } else {
            match &config.api.token {
                Some(token) => Access::Token(token.clone()),
                None => Access::Closed,
            }
        };
        let labels = config
            .upstreams
            .values()
            .filter_map(|u| {
                let default = if u.url.scheme_str() == Some("http") { 80 } else { 443 };
                let host = u.url.host()?.trim_matches(['[', ']']).to_ascii_lowercase();
                Some(((host, u.url.port_u16().unwrap_or(default)), u.name.clone()))
            })
            .collect();
        Ok(Interceptor {
            list: InterceptList::new(config),
            labels,
            data_dir: config.data_dir.clone(),
            ca: OnceLock::new(),
            clients: InterceptClients::build(config, &resolver)?,
            resolver,
            access,
            header_read_timeout: config.server.header_read_timeout,
            handshake_log: EpisodeLog::default(),
            connect_log: EpisodeLog::default(),
            uncovered_log: EpisodeLog::default(),
        })
    }

    fn label_for(&self, host: &str, port: u16) -> Option<Arc<str>> {
        self.labels.get(&(host.to_owned(), port)).cloned()
    }

    fn ca(&self) -> Option<Arc<ca::Ca>> {
        self.ca
            .get_or_init(|| match ca::load_or_create(&self.data_dir, &self.list.ca_names(), false) {
                Ok(ca) => {
                    if ca.info.created {
                        tracing::info!(path = %ca.info.cert_path.display(), "Created llmtap's local CA (`llmtap ca` shows how to trust it)");
                    }
                    Some(Arc::new(ca))
                }
                Err(error) => {
                    tracing::error!(%error, "Cannot load or create llmtap's CA; CONNECT tunnels are relayed without capture");
                    None
                }
            })
            .clone()
    }
}

/// A CONNECT target and the client's proxy credentials, read from the request head.
struct Target {
    host: String,
    port: u16,
    /// The user name of `Proxy-Authorization: Basic` (unless `llmtap`): a session id for every exchange in the
    /// tunnel (`llmtap run` sets it).
    session: Option<String>,
}

#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("CONNECT needs a host:port target, got {0:?}")]
    BadTarget(String),
    #[error("a plain-HTTP proxy request needs an http://host[:port] URI, got {0:?}")]
    BadUri(String),
    #[error("proxying beyond loopback needs the [api] token as the proxy password")]
    NoCredentials,
    #[error("the proxy credentials are not valid")]
    BadCredentials,
    #[error("proxying is refused: llmtap listens beyond loopback without an [api] token (it would be an open proxy)")]
    Closed,
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Refusal::BadTarget(_) | Refusal::BadUri(_) => StatusCode::BAD_REQUEST,
            Refusal::NoCredentials | Refusal::BadCredentials => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            Refusal::Closed => StatusCode::FORBIDDEN,
        }
    }
}

/// A refused proxy request's answer (407 carries the challenge), counted.
fn refused(proxy: &Proxy, refusal: &Refusal) -> Response<ProxyBody> {
    proxy.metrics.forward_refused.inc();
    let mut resp = answer(refusal.status(), "llmtap_proxy_refused", &refusal.to_string());
    if refusal.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        resp.headers_mut().insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"llmtap\""),
        );
    }
    resp
}

fn answer(status: StatusCode, kind: &str, message: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({"error": {"type": kind, "message": message}});
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

impl Interceptor {
    fn target(&self, uri: &http::Uri, headers: &http::HeaderMap) -> Result<Target, Refusal> {
        let session = self.authorize(headers)?;
        let authority = uri.authority();
        let (host, port) = match authority.map(|a| (a.host(), a.port_u16())) {
            Some((host, Some(port))) if !host.is_empty() && uri.path_and_query().is_none() => (host, port),
            _ => return Err(Refusal::BadTarget(uri.to_string())),
        };
        Ok(Target {
            host: host.trim_matches(['[', ']']).to_ascii_lowercase(),
            port,
            session,
        })
    }

    /// The access rule for every proxy request (CONNECT or plain HTTP), and the session its credentials name.
    fn authorize(&self, headers: &http::HeaderMap) -> Result<Option<String>, Refusal> {
        let (user, password) = proxy_credentials(headers);
        match &self.access {
            Access::Open => {}
            Access::Closed => return Err(Refusal::Closed),
            Access::Token(token) => match &password {
                None => return Err(Refusal::NoCredentials),
                Some(p) if !bool::from(p.as_bytes().ct_eq(token.expose().as_bytes())) => {
                    return Err(Refusal::BadCredentials);
                }
                Some(_) => {}
            },
        }
        Ok(user.filter(|u| !u.is_empty() && u != PLAIN_USER))
    }
}

/// (user, password) of `Proxy-Authorization: Basic`, or (None, token) of `Bearer`.
fn proxy_credentials(headers: &http::HeaderMap) -> (Option<String>, Option<String>) {
    let Some(value) = headers.get(header::PROXY_AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return (None, None);
    };
    let value = value.trim();
    if let Some(token) = value.strip_prefix("Bearer ") {
        return (None, Some(token.trim().to_owned()));
    }
    let Some(encoded) = value.strip_prefix("Basic ") else {
        return (None, None);
    };
    let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
        return (None, None);
    };
    let text = String::from_utf8_lossy(&decoded);
    match text.split_once(':') {
        Some((user, password)) => (
            Some(percent_decode(user)),
            Some(password.to_owned()).filter(|p| !p.is_empty()),
        ),
        None => (Some(percent_decode(&text)), None),
    }
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// Answers a CONNECT: refused, 502 (a blind target that cannot be reached), or 200 with the tunnel spawned
/// to run once hyper hands the connection over. The tunnel takes over the connection's `scope`: it keeps its
/// slot under `max_connections` and is drained at shutdown like any client connection.
pub(super) async fn connect<B>(proxy: &Arc<Proxy>, mut req: Request<B>, scope: ConnScope) -> Response<ProxyBody> {
    let interceptor = &proxy.intercept;
    let target = match interceptor.target(req.uri(), req.headers()) {
        Ok(t) => t,
        Err(refusal) => return refused(proxy, &refusal),
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let intercepted = interceptor
        .list
        .lookup(&target.host, target.port)
        .and_then(|i| interceptor.ca().map(|ca| (i, ca)))
        .filter(|(_, ca)| {
            let covered = ca.covers(&target.host);
            if !covered && let EpisodeReport::First = interceptor.uncovered_log.failure() {
                tracing::warn!(
                    host = %target.host,
                    "An intercept-list host is outside llmtap's CA name constraints; tunnelling it blind (run `llmtap ca --rotate` and trust the new CA to capture it)"
                );
            }
            covered
        });
    match intercepted {
        Some((intercepted, ca)) => {
            proxy.metrics.forward_intercepted.inc();
            let proxy = proxy.clone();
            scope.tasks.clone().spawn(async move {
                match on_upgrade.await {
                    Ok(upgraded) => {
                        serve_intercepted(proxy, TokioIo::new(upgraded), target, intercepted, ca, scope).await
                    }
                    Err(error) => tracing::debug!(%error, "CONNECT upgrade failed"),
                }
            });
            Response::new(Either::Right(Full::new(Bytes::new())))
        }
        None => {
            let upstream = match blind_connect(interceptor, &target).await {
                Ok(s) => s,
                Err(error) => {
                    proxy.metrics.forward_connect_errors.inc();
                    let message = format!("cannot connect to {}:{}: {error}", target.host, target.port);
                    if let EpisodeReport::First = interceptor.connect_log.failure() {
                        tracing::warn!(%message, "CONNECT target unreachable");
                    }
                    return answer(StatusCode::BAD_GATEWAY, "llmtap_upstream_unreachable", &message);
                }
            };
            interceptor.connect_log.success_if_settled();
            proxy.metrics.forward_blind.inc();
            let metrics = proxy.metrics.clone();
            // A blind tunnel keeps the connection's slot, but shutdown does not wait for it: nothing in its
            // bytes says when a request is over, so it stays open while the captured exchanges drain and
            // closes with the last connections (at the latest when the grace is over).
            tokio::spawn(async move {
                let _slot = scope.slot;
                let Ok(upgraded) = on_upgrade.await else { return };
                let mut client = TokioIo::new(upgraded);
                let mut upstream = upstream;
                tokio::select! {
                    copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
                        if let Ok((up, down)) = copied {
                            metrics.forward_blind_bytes.add(up + down);
                        }
                    }
                    _ = scope.force.cancelled() => {}
                }
            });
            Response::new(Either::Right(Full::new(Bytes::new())))
        }
    }
}

async fn blind_connect(interceptor: &Interceptor, target: &Target) -> std::io::Result<tokio::net::TcpStream> {
    let connecting = async {
        match interceptor.resolver.target(&target.host, target.port) {
            Some(addr) => tokio::net::TcpStream::connect(addr).await,
            None => tokio::net::TcpStream::connect((target.host.as_str(), target.port)).await,
        }
    };
    let stream = tokio::time::timeout(Duration::from_secs(10), connecting)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out after 10 s"))??;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// The client's TLS, terminated with a leaf for the target host, then HTTP/1.1 or HTTP/2 as ALPN chose.
async fn serve_intercepted(
    proxy: Arc<Proxy>,
    io: TokioIo<hyper::upgrade::Upgraded>,
    target: Target,
    intercepted: Intercepted,
    ca: Arc<ca::Ca>,
    scope: ConnScope,
) {
    let interceptor = &proxy.intercept;
    let config = match ca.server_config(&target.host) {
        Ok(c) => c,
        Err(error) => {
            tracing::error!(%error, host = %target.host, "Cannot mint a certificate; closing the tunnel");
            return;
        }
    };
    let tls = match tokio_rustls::TlsAcceptor::from(config).accept(io).await {
        Ok(tls) => {
            interceptor.handshake_log.success_if_settled();
            tls
        }
        Err(error) => {
            proxy.metrics.forward_handshake_failures.inc();
            match interceptor.handshake_log.failure() {
                EpisodeReport::First => tracing::warn!(
                    %error,
                    host = %target.host,
                    "A client refused llmtap's certificate (or broke the handshake): does it trust llmtap's CA? See `llmtap ca`. Further failures are counted in llmtap_forward_handshake_failures_total"
                ),
                EpisodeReport::Summary { count } => {
                    tracing::warn!(%error, failures = count, "TLS handshakes with clients still failing")
                }
                EpisodeReport::Quiet => {}
            }
            return;
        }
    };
    let tunnel = relay::Tunnel::new(proxy.clone(), target, Some(intercepted), http::uri::Scheme::HTTPS);
    // ALPN decides the client's protocol; without it (or with `http/1.1`) the client speaks HTTP/1.1.
    let http2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let tunnel = Arc::new(if http2 { tunnel } else { tunnel.with_own_connection() });
    // The decrypted connection is watched as a base-URL connection is (idle, stalled bodies, shutdown).
    let activity = super::limits::ConnActivity::new();
    let service_activity = activity.clone();
    let slot = scope.slot.clone();
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let tunnel = tunnel.clone();
        let active = service_activity.begin();
        // As on the proxy port: a socket keeps the tunnel's slot (see `proxy::sockets`).
        if req.method() == http::Method::GET && req.headers().contains_key(header::UPGRADE) {
            req.extensions_mut().insert(super::sockets::ConnSlot(slot.clone()));
        }
        let req = req.map(|body| super::limits::ClientBody::new(body, service_activity.clone()));
        async move {
            let resp = tunnel.handle(req).await;
            Ok::<_, std::convert::Infallible>(resp.map(|body| super::limits::GuardedBody::new(body, active)))
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(interceptor.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    // Draining: HTTP/1.1 finishes the exchange in flight (a stream included) and closes, HTTP/2 sends GOAWAY.
    proxy
        .supervise(conn, activity, &scope, |conn: std::pin::Pin<&mut _>| {
            conn.graceful_shutdown()
        })
        .await;
}

/// Where `llmtap run` and docs point clients: the proxy URL with optional session and token.
pub fn proxy_url(addr: SocketAddr, session: Option<&str>, token: Option<&str>) -> String {
    // RFC 3986 userinfo keeps unreserved characters as they are.
    const USERINFO: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    let enc = |s: &str| percent_encoding::utf8_percent_encode(s, USERINFO).to_string();
    match (session, token) {
        (None, None) => format!("http://{addr}"),
        // Always with a password: Bun's fetch (Claude Code) fails a proxy URL whose user has none, without
        // connecting. Without a token the password is a placeholder llmtap ignores.
        (user, token) => format!(
            "http://{}:{}@{addr}",
            enc(user.unwrap_or(PLAIN_USER)),
            enc(token.unwrap_or(PLAIN_USER))
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_carry_a_session_and_a_token() {
        let mut h = http::HeaderMap::new();
        let basic = base64::engine::general_purpose::STANDARD.encode("run%2D1:s3cret");
        h.insert(header::PROXY_AUTHORIZATION, format!("Basic {basic}").parse().unwrap());
        assert_eq!(proxy_credentials(&h), (Some("run-1".into()), Some("s3cret".into())));
        h.insert(header::PROXY_AUTHORIZATION, "Bearer tok".parse().unwrap());
        assert_eq!(proxy_credentials(&h), (None, Some("tok".into())));
        let addr: SocketAddr = "127.0.0.1:8787".parse().unwrap();
        assert_eq!(proxy_url(addr, None, None), "http://127.0.0.1:8787");
        assert_eq!(
            proxy_url(addr, Some("run-1"), None),
            "http://run-1:llmtap@127.0.0.1:8787"
        );
        assert_eq!(proxy_url(addr, None, Some("t")), "http://llmtap:t@127.0.0.1:8787");
    }

    fn interceptor(toml: &str) -> Interceptor {
        let config = crate::config::Config::from_toml(toml).unwrap().validate().unwrap();
        Interceptor::new(&config).unwrap()
    }

    fn basic(userpass: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        let value = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(userpass));
        h.insert(header::PROXY_AUTHORIZATION, value.parse().unwrap());
        h
    }

    #[test]
    fn beyond_loopback_connect_needs_the_token_and_without_one_is_refused() {
        let uri: http::Uri = "api.openai.com:443".parse().unwrap();
        let none = http::HeaderMap::new();
        let open = interceptor("listen = \"127.0.0.1:8787\"\n");
        let t = open.target(&uri, &basic("run-7:llmtap")).unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.session.as_deref()),
            ("api.openai.com", 443, Some("run-7"))
        );
        assert!(open.target(&uri, &none).is_ok(), "loopback: no credentials needed");

        let closed = interceptor("listen = \"0.0.0.0:8787\"\n");
        assert!(matches!(closed.target(&uri, &basic("x:y")), Err(Refusal::Closed)));

        let guarded = interceptor("listen = \"0.0.0.0:8787\"\n[api]\ntoken = \"s3cret\"\n");
        assert!(matches!(guarded.target(&uri, &none), Err(Refusal::NoCredentials)));
        assert!(matches!(
            guarded.target(&uri, &basic("llmtap:wrong")),
            Err(Refusal::BadCredentials)
        ));
        let t = guarded.target(&uri, &basic("llmtap:s3cret")).unwrap();
        assert_eq!(t.session, None, "the placeholder user names no session");
        let mut bearer = http::HeaderMap::new();
        bearer.insert(header::PROXY_AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(guarded.target(&uri, &bearer).is_ok());

        // The plain-HTTP forward proxy (absolute form) goes by the same rule.
        assert!(matches!(closed.authorize(&none), Err(Refusal::Closed)));
        assert!(matches!(guarded.authorize(&none), Err(Refusal::NoCredentials)));
        assert_eq!(
            guarded.authorize(&basic("run-3:s3cret")).unwrap().as_deref(),
            Some("run-3")
        );

        for bad in ["api.openai.com", "/v1/chat"] {
            let uri: http::Uri = bad.parse().unwrap();
            assert!(matches!(open.target(&uri, &none), Err(Refusal::BadTarget(_))), "{bad}");
        }
    }
}
