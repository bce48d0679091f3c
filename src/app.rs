//! Builds the stages from a `Config` and owns their lifetimes and shutdown order:
//! stop accepting → in-flight exchanges finish (grace period) → capture queue drains through the pipeline
//! thread (which closes open trajectories) → the store writer commits what is queued → exit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::capture::CaptureTx;
use crate::config::Config;
use crate::proxy::Proxy;
use crate::store::StoreWriter;
use crate::telemetry::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Tls(#[from] crate::proxy::forward::TlsSetupError),
    #[error("cannot open the capture spill: {0}")]
    Spill(#[source] crate::capture::spill::SpillError),
    #[error("cannot start a worker thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error(
        "refusing to serve the gRPC API on {addr} without a token: it streams every captured prompt to whoever \
         can reach it. Set [api] token or token_file (or LLMTAP_API_TOKEN), or listen on a loopback address"
    )]
    ApiWithoutToken { addr: SocketAddr },
    #[error(
        "refusing to serve the viewer on {addr} without a token: it shows every captured prompt to whoever can \
         reach it. Set [api] token or token_file (or LLMTAP_API_TOKEN), or listen on a loopback address"
    )]
    ViewerWithoutToken { addr: SocketAddr },
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::sdk::TelemetryError),
}

pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), AppError> {
    run_with(config, shutdown, Announce::Stdout).await
}

/// Where the bound addresses go once listening.
pub enum Announce {
    /// One line each on stdout (`llmtap serve`; tests and scripts read them).
    Stdout,
    /// To the caller only: `llmtap run` keeps its child's stdout clean. (proxy, api, viewer)
    Caller(tokio::sync::oneshot::Sender<Bound>),
}

/// The addresses an instance listens on.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub proxy: SocketAddr,
    pub api: Option<SocketAddr>,
    pub viewer: Option<SocketAddr>,
}

pub async fn run_with(config: Config, shutdown: CancellationToken, announce_to: Announce) -> Result<(), AppError> {
    let to_stdout = matches!(announce_to, Announce::Stdout);
    let announce = |line: &str| {
        if to_stdout {
            announce(line)
        }
    };
    if let Some(addr) = config.api.listen
        && !addr.ip().is_loopback()
        && config.api.token.is_none()
    {
        return Err(AppError::ApiWithoutToken { addr });
    }
    // Before anything starts: a broken prices file is a startup error, not a capture without costs.
    let prices = config.price_table()?;
    if let Some(addr) = config.viewer.listen
        && !addr.ip().is_loopback()
        && config.api.token.is_none()
    {
        return Err(AppError::ViewerWithoutToken { addr });
    }
    let metrics = Arc::new(Metrics::default());
    metrics.capture_queue_capacity.set(config.capture.queue_bytes);
    // /metrics and, when configured, OTLP export of llmtap's own metrics: the same instruments.
    let self_telemetry = crate::telemetry::sdk::install(&metrics, &config.telemetry, &config.resource)?;
    let conn = crate::store::open_for_writing(&config.data_dir)?;
    // What the writer committed last, for the exporters' span building (`store::recent`), one read per sink.
    let recent = Arc::new(crate::store::RecentRecords::new(config.export.otlp.len()));
    // The commit feed: what the writer committed, for the API's and the viewer's live events.
    let live = crate::api::live_channel();
    let feed = crate::store::feed::CommitFeed::new(live.clone());
    let (store_tx, store_thread) = StoreWriter::spawn_with_feed(
        conn,
        config.store.clone(),
        metrics.clone(),
        recent.clone(),
        Some(feed.clone()),
    )
    .map_err(AppError::Thread)?;
    // Search indexing follows the store on its own thread (`store::search::index`): without it, capture goes on.
    let search_indexer = crate::store::search::index::Indexer::spawn(&config.data_dir, metrics.clone())
        .map_err(|error| tracing::error!(%error, "Cannot start the search indexer; search will miss new steps"))
        .ok();

    let pipeline_stop = CancellationToken::new();
    let (capture_tx, pipeline_thread, spill_thread) = if config.capture.enabled {
        let settings = crate::pipeline::Settings {
            derive: config.derive.clone(),
            body_cap: config.capture.max_body_bytes,
            prices,
            spill_limit: (config.capture.spill_bytes > 0).then_some(config.capture.spill_bytes),
        };
        if config.capture.spill_bytes > 0 {
            // The spill thread consumes the queue and feeds the pipeline through a handoff of
            // `queue_capacity` exchanges; the queue itself needs room for one of its polls (capture::spill).
            let intake = crate::config::CaptureConfig {
                queue_capacity: config
                    .capture
                    .queue_capacity
                    .max(crate::capture::spill::INTAKE_CAPACITY),
                ..config.capture.clone()
            };
            let (tx, mut rx) = CaptureTx::channel(&intake, metrics.clone());
            rx.set_mark_lifetime(config.derive.idle_timeout);
            let (spill_rx, spill_thread) = crate::capture::spill::spawn(
                rx,
                &config.data_dir.join("spill"),
                config.capture.queue_capacity,
                config.capture.spill_bytes,
                crate::capture::spill::BodyRedaction {
                    redact: crate::pipeline::secrets::redact_json,
                    cap: config.capture.max_body_bytes,
                },
                metrics.clone(),
                pipeline_stop.clone(),
            )
            .map_err(AppError::Spill)?;
            // The pipeline ends when the spill thread does (after the stop, once the queue is empty).
            let thread = crate::pipeline::spawn(
                spill_rx,
                store_tx.clone().sharing_capture_budget(tx.budget().clone()),
                settings,
                metrics.clone(),
                CancellationToken::new(),
            )
            .map_err(AppError::Thread)?;
            (Some(tx), Some(thread), Some(spill_thread))
        } else {
            let (tx, mut rx) = CaptureTx::channel(&config.capture, metrics.clone());
            rx.set_mark_lifetime(config.derive.idle_timeout);
            let thread = crate::pipeline::spawn(
                rx,
                store_tx.clone().sharing_capture_budget(tx.budget().clone()),
                settings,
                metrics.clone(),
                pipeline_stop.clone(),
            )
            .map_err(AppError::Thread)?;
            (Some(tx), Some(thread), None)
        }
    } else {
        (None, None, None)
    };
    drop(store_tx);

    let proxy = Arc::new(Proxy::new(&config, capture_tx, metrics.clone())?);
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| AppError::Listen {
            addr: config.listen,
            source,
        })?;
    let local = listener.local_addr().unwrap_or(config.listen);
    // Machine-readable first line on stdout: tests and scripts read the bound port from it.
    announce(&format!("llmtap listening on http://{local}"));
    let api_stop = CancellationToken::new();
    let mut listeners = crate::api::server::Listeners {
        grpc: None,
        viewer: None,
        proxy: local,
    };
    if let Some(addr) = config.api.listen {
        let api_listener = std::net::TcpListener::bind(addr).map_err(|source| AppError::Listen { addr, source })?;
        let api_addr = api_listener.local_addr().unwrap_or(addr);
        announce(&format!("llmtap api on http://{api_addr}"));
        listeners.grpc = Some(api_listener);
    }
    if let Some(addr) = config.viewer.listen {
        // The viewer is for people, not for the agent: a port already taken is logged and llmtap runs without it.
        match std::net::TcpListener::bind(addr) {
            Ok(l) => {
                announce(&format!("llmtap viewer on http://{}/", l.local_addr().unwrap_or(addr)));
                listeners.viewer = Some(l);
            }
            Err(error) => tracing::error!(%addr, %error, "Cannot listen for the viewer; running without it"),
        }
    }
    if let Announce::Caller(tx) = announce_to {
        let _ = tx.send(Bound {
            proxy: local,
            api: listeners.grpc.as_ref().and_then(|l| l.local_addr().ok()),
            viewer: listeners.viewer.as_ref().and_then(|l| l.local_addr().ok()),
        });
    }
    // What the viewer and the API read: the team's shared store when one is configured, else the local one.
    let reading = crate::store::Store::open(&config.data_dir, config.store.url.as_ref().map(|u| u.as_str()))?;
    if listeners.grpc.is_some() || listeners.viewer.is_some() {
        // Its own thread and runtime: no API or viewer client can take the proxy's workers or blocking pool.
        crate::api::server::spawn(
            listeners,
            &config,
            reading.clone(),
            live.clone(),
            metrics.clone(),
            api_stop.clone(),
        )
        .map_err(AppError::Thread)?;
    }
    tracing::info!(listen = %local, data_dir = %config.data_dir.display(), upstreams = config.upstreams.len(), "Started");

    let export_stop = CancellationToken::new();
    let servers = Arc::new(crate::export::otlp::servers(&config));
    let mut sinks: Vec<ExportTask> = Vec::new();
    for otlp in &config.export.otlp {
        let ctx = crate::export::otlp::SinkContext {
            config: otlp.clone(),
            data_dir: config.data_dir.clone(),
            resource: config.resource.clone(),
            servers: servers.clone(),
            metrics: metrics.clone(),
            recent: recent.clone(),
            commits: feed.commits(),
        };
        sinks.push(Box::pin(crate::export::otlp::run(ctx, export_stop.clone())));
    }
    if let Some(url) = &config.store.url {
        let replica = crate::store::postgres::replica_id(&config.data_dir, config.store.replica.as_deref())
            .map_err(AppError::Thread)?;
        let store = match reading.shared() {
            Some(store) => store,
            None => Arc::new(crate::store::postgres::PgStore::connect(url.as_str())?),
        };
        tracing::info!(store = %store.describe(), %replica, "Delivering records to the shared store");
        let ctx = crate::export::shared_store::SharedStoreContext {
            store,
            replica,
            data_dir: config.data_dir.clone(),
            retention_days: config.store.retention_days,
            metrics: metrics.clone(),
            recent: recent.clone(),
            commits: feed.commits(),
        };
        sinks.push(Box::pin(crate::export::shared_store::run(ctx, export_stop.clone())));
    }
    let mut exporters = Vec::new();
    if !sinks.is_empty() {
        match spawn_exporters(sinks) {
            Ok(handle) => exporters.push(handle),
            Err(error) => tracing::error!(%error, "Cannot start the export thread"),
        }
    }

    // The data path runs on a runtime of its own (`[server] workers` threads), apart from the API, the viewer
    // and the caller's tasks: nothing they do can hold up a byte of traffic, and with one worker (the default)
    // an exchange's tasks, its connections and its capture stay on one thread (see `proxy_runtime`). The
    // accept loop is a task on that runtime, so a connection's task starts on the worker that accepted it.
    let workers = config.server.workers;
    let proxy_rt = proxy_runtime(workers).map_err(AppError::Thread)?;
    let listener = listener.into_std().map_err(|source| AppError::Listen {
        addr: config.listen,
        source,
    })?;
    let serving = proxy_rt.spawn(async move {
        crate::allocator::spawn_idle_wakers(workers);
        match TcpListener::from_std(listener) {
            Ok(listener) => proxy.serve(listener, shutdown).await,
            Err(error) => tracing::error!(%error, "Cannot register the proxy's listener; shutting down"),
        }
    });
    if let Err(error) = serving.await {
        tracing::error!(%error, "The proxy's accept loop ended abnormally; shutting down");
    }
    // Its workers end before the pipeline is told to stop: exchanges a worker still held for the capture
    // queue (`capture::handoff`) are sent as its thread exits. What is left (idle upstream connections) closes.
    let _ = tokio::task::spawn_blocking(move || proxy_rt.shutdown_timeout(Duration::from_secs(1))).await;
    api_stop.cancel();
    pipeline_stop.cancel();
    // The proxy has closed every connection; the pipeline ends once the capture queue is empty.
    let threads = tokio::task::spawn_blocking(move || {
        if let Some(t) = spill_thread {
            let _ = t.join();
        }
        if let Some(t) = pipeline_thread {
            let _ = t.join();
        }
        let _ = store_thread.join();
        if let Some(i) = search_indexer {
            i.stop();
        }
    });
    let _ = threads.await;
    // Everything is in the store now; exporters drain it within their deadline.
    export_stop.cancel();
    // Wait for them without blocking: an exporter stuck on an unreachable destination past its deadline is
    // left behind (the process exits) rather than holding shutdown up.
    let deadline = std::time::Instant::now() + crate::export::otlp::FLUSH_DEADLINE * 2;
    while exporters.iter().any(|e| !e.is_finished()) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // A last push of llmtap's own metrics, with the final counts. Blocking (the SDK's reader thread exports).
    let _ = tokio::task::spawn_blocking(move || self_telemetry.shutdown()).await;
    tracing::info!(
        captured = metrics.captured.get(),
        dropped = metrics.capture_dropped.get(),
        dropped_trajectories = metrics.capture_dropped_trajectories.get(),
        spill_backlog_bytes = metrics.capture_spill_bytes.get(),
        stored = metrics.stored.get(),
        "Stopped"
    );
    Ok(())
}

/// An address line on stdout. A caller that read what it needed and closed the pipe is not an error (println!
/// would panic on the broken pipe and take the proxy down with it).
fn announce(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// The proxy's runtime: `workers` threads named `llmtap-proxy`.
///
/// One worker is the default because, measured in forward mode's benchmark on 2 cores shared with the load
/// generator and the upstream, a second worker cost more than it brought: with capture on, CPU per kept-alive
/// exchange 46.0 µs with two workers against 33.7 µs with one, throughput 0.76× nginx's per round against
/// 0.94× (same run). With two, an exchange's tasks (client connection, upstream connection, capture) wake each
/// other across threads, and an idle worker is woken to steal work it rarely finds. One worker carries tens of
/// thousands of kept-alive exchanges or a few thousand TLS handshakes a second; more workers are for a shared
/// gateway with more than that (docs/operations.md).
fn proxy_runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("llmtap-proxy")
        .enable_all()
        // A worker that runs out of work sends the exchanges it captured (see capture::handoff) and, now and
        // then, gives back memory other threads freed in its pages (see allocator).
        .on_thread_park(|| {
            crate::capture::handoff::send_pending();
            crate::allocator::release_on_tick();
        })
        .build()
}

/// One sink's whole life (build it, drive it until the shutdown flush ends), as a task of the export runtime.
type ExportTask = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Every export sink runs as a task on one thread with a single-threaded runtime at background priority:
/// reading the store, building spans, gzip and the gRPC/HTTP clients never run on the proxy's workers, so a
/// backlog being exported cannot delay a byte of live traffic. Sinks only wait on I/O and timers between
/// blocking-pool reads, so one thread serves them all (a thread and runtime per destination bought nothing).
fn spawn_exporters(sinks: Vec<ExportTask>) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("llmtap-export".into()).spawn(move || {
        crate::background::run_in_background();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .on_thread_park(crate::allocator::release_when_idle)
            .build();
        match runtime {
            Ok(rt) => rt.block_on(async move {
                let tasks: Vec<_> = sinks.into_iter().map(tokio::spawn).collect();
                for task in tasks {
                    let _ = task.await;
                }
            }),
            Err(error) => tracing::error!(%error, "Cannot start the export runtime"),
        }
    })
}
