//! The one router behind both API listeners: the gRPC API (tonic's service, mounted under its package path)
//! and the web viewer's page and JSON API, behind the same layers (`auth`: security headers, cross-site
//! refusal, credentials). `[api] listen` and `[viewer] listen` are two doors to it, so either port answers
//! both; a deployment that exposes one port (behind a reverse proxy) gets everything there.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::middleware::{from_fn, from_fn_with_state};
use http::StatusCode;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio_util::sync::CancellationToken;

use super::ApiService;
use super::auth::{self, Guard};
use super::viewer::Viewer;

/// The gRPC API and the viewer on one router; the last layer added is the outermost.
pub fn build(service: ApiService, viewer: Arc<Viewer>, guard: Guard) -> Router {
    let grpc = tonic::service::Routes::new(super::pb::llm_tap_server::LlmTapServer::new(service)).into_axum_router();
    viewer
        .routes()
        .merge(grpc)
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found") })
        .layer(from_fn_with_state(guard, auth::authorize))
        .layer(from_fn(auth::refuse_cross_site))
        .layer(from_fn(auth::security_headers))
}

/// Serve `router` on `listener` until `stop` is cancelled (then open connections are closed). HTTP/1.1 for
/// browsers and HTTP/2 (prior knowledge, as gRPC clients speak it) on the same port.
pub async fn serve(router: Router, listener: tokio::net::TcpListener, stop: CancellationToken) {
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(_) => {
                    // Out of file descriptors and the like: wait a moment rather than spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let stop = stop.clone();
        connections.spawn(async move {
            let builder = auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                () = stop.cancelled() => {}
            }
        });
    }
    connections.close();
}
