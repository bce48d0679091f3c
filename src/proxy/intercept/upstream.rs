//! The upstream side of an intercepted connection: a pooled client over rustls to the real host (public roots
//! plus `[forward] ca_file`, or a configured upstream's `ca_file` for its host), with `[forward] resolve`
//! applied beneath name resolution, so SNI, `Host` and certificate checks keep the host's name.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

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

/// The client for requests (HTTP/2 or HTTP/1.1 by ALPN), and an HTTP/1.1-only one for WebSocket upgrades
/// (an upgrade cannot ride an HTTP/2 connection the pool might pick).
struct Pair {
    requests: InterceptClient,
    upgrades: InterceptClient,
}

fn pair(ca_file: Option<&Path>, resolver: &Resolver) -> Result<Pair, TlsSetupError> {
    Ok(Pair {
        requests: client(ca_file, resolver, true)?,
        upgrades: client(ca_file, resolver, false)?,
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
}

fn client(ca_file: Option<&Path>, resolver: &Resolver, http2: bool) -> Result<InterceptClient, TlsSetupError> {
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
    let https = if http2 {
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.wrap_connector(http)
    };
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(https))
}
