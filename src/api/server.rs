//! Runs the gRPC API apart from the data path: its own OS thread at background priority, its own runtime and
//! its own small blocking pool. Store reads for the API run on that pool, so however many API clients there
//! are and however slowly they read, they cannot take the blocking threads the proxy needs (the upstream
//! connector resolves host names there) nor CPU from live traffic.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::auth::Guard;
use super::streams::StreamLimit;
use super::{ApiService, LiveTx};
use crate::config::Config;
use crate::telemetry::Metrics;

/// Blocking threads beyond one per allowed stream: unary queries still run while every stream reads.
const SPARE_BLOCKING_THREADS: usize = 2;
/// Upper bound on the API's blocking pool, whatever `[api] max_streams` says (public for tests that fill it).
pub const MAX_BLOCKING_THREADS: usize = 34;

/// Where the API runtime serves: the gRPC API, the web viewer, or both.
pub struct Listeners {
    pub grpc: Option<std::net::TcpListener>,
    pub viewer: Option<std::net::TcpListener>,
    /// Where the proxy listens: the viewer's replays go through it.
    pub proxy: std::net::SocketAddr,
}

/// Serve the API router (the gRPC API and the viewer) on its listeners until `stop` is cancelled.
pub fn spawn(
    listeners: Listeners,
    config: &Config,
    store: crate::store::Store,
    live: LiveTx,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    for l in [&listeners.grpc, &listeners.viewer].into_iter().flatten() {
        l.set_nonblocking(true)?;
    }
    let viewer = Arc::new(super::viewer::Viewer::new(
        config,
        listeners.proxy,
        store.clone(),
        live.clone(),
        metrics.clone(),
    ));
    let service = ApiService {
        store,
        live,
        limit: StreamLimit::new(config.api.max_streams, config.api.stall_timeout, metrics.clone()),
        metrics: metrics.clone(),
        errors: Arc::default(),
    };
    let router = super::router::build(service, viewer, Guard::new(config.api.token.as_ref(), metrics));
    let blocking_threads = (config.api.max_streams + SPARE_BLOCKING_THREADS).min(MAX_BLOCKING_THREADS);
    std::thread::Builder::new().name("llmtap-api".into()).spawn(move || {
        crate::background::run_in_background();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(blocking_threads)
            .thread_name("llmtap-api-blocking")
            .on_thread_start(crate::background::run_in_background)
            .on_thread_park(crate::allocator::release_when_idle)
            .build();
        let runtime = match runtime {
            Ok(rt) => rt,
            Err(error) => {
                tracing::error!(%error, "Cannot start the gRPC API runtime; the API is unavailable");
                return;
            }
        };
        runtime.block_on(async move {
            let served = [listeners.grpc, listeners.viewer]
                .into_iter()
                .flatten()
                .filter_map(|l| match tokio::net::TcpListener::from_std(l) {
                    Ok(l) => Some(tokio::spawn(super::router::serve(router.clone(), l, stop.clone()))),
                    Err(error) => {
                        tracing::error!(%error, "Cannot use an API listener; the API and viewer are unavailable there");
                        None
                    }
                });
            for task in served.collect::<Vec<_>>() {
                let _ = task.await;
            }
        });
    })
}
