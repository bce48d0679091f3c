//! `llmtap` binary: parse the CLI, load config, run a command. The only place that uses `anyhow` and exit codes.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use tokio_util::sync::CancellationToken;

use llmtap::cli::{Cli, Command, Selection, StoreArgs};
use llmtap::config::Config;
use llmtap::store::{Store, TraceFilter};

/// mimalloc: the proxy and the pipeline allocate many short-lived buffers; glibc malloc spent ~35% of the
/// derivation benchmark in malloc/free, mimalloc cuts that substantially (see README, Benchmarks).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` starts its log once its config (`log_format`) is read; the other commands log as text.
    if !matches!(cli.command, Command::Serve { .. }) {
        llmtap::telemetry::init_logging(llmtap::config::LogFormat::Text);
    }
    let outcome = match cli.command {
        // The command's own status is llmtap's.
        Command::Run {
            store,
            session,
            command,
        } => run_command(store, session, command),
        command => run(Cli { command }).map(|()| ExitCode::SUCCESS),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            if llmtap::telemetry::logs_as_json() {
                tracing::error!(error = format!("{e:#}"), "llmtap stopped");
            } else {
                eprintln!("llmtap: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

fn load_config(path: Option<&PathBuf>) -> Result<Config> {
    Ok(match path {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    })
}

fn resolve_config(args: &StoreArgs, listen: Option<String>) -> Result<Config> {
    let mut config = load_config(args.config.as_ref())?;
    if let Some(l) = listen {
        config.listen = l.parse().with_context(|| format!("--listen {l:?} is not HOST:PORT"))?;
    }
    if let Some(d) = &args.data_dir {
        config.data_dir = d.clone();
    }
    Ok(config.validate()?)
}

/// The store a CLI command reads: `--store URL` (checked now, so that a wrong URL is one clear error), else the
/// local store of the config's data dir.
fn open_store(args: &StoreArgs) -> Result<Store> {
    let config = resolve_config(args, None)?;
    let store = Store::open(&config.data_dir, args.store.as_deref())?;
    if let Some(pg) = store.shared() {
        pg.check()?;
    }
    Ok(store)
}

fn filter(select: &Selection, limit: Option<u64>) -> Result<TraceFilter> {
    let parse = |s: &Option<String>, what: &str| -> Result<Option<i64>> {
        s.as_deref()
            .map(|t| {
                chrono::DateTime::parse_from_rfc3339(t)
                    .map(|d| d.timestamp_micros())
                    .with_context(|| format!("--{what} {t:?} is not an RFC 3339 time (e.g. 2026-11-21T10:00:00Z)"))
            })
            .transpose()
    };
    Ok(TraceFilter {
        session: select.session.clone(),
        since_us: parse(&select.since, "since")?,
        until_us: parse(&select.until, "until")?,
        limit,
    })
}

/// Run the proxy until SIGTERM/SIGINT.
fn serve(store: StoreArgs, listen: Option<String>) -> Result<()> {
    let config = resolve_config(&store, listen)?;
    llmtap::telemetry::init_logging(config.log_format);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // The API's and viewer's runtime (the data path has its own, `app::proxy_runtime`, which also sends
        // what its workers captured when they park): a worker gives back, now and then, memory other threads
        // freed in its pages (see allocator).
        .on_thread_park(llmtap::allocator::release_on_tick)
        .build()?;
    let workers = rt.metrics().num_workers();
    let served = rt.block_on(async move {
        llmtap::allocator::spawn_idle_wakers(workers);
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("Shutdown signal received; finishing in-flight exchanges");
            signal.cancel();
        });
        llmtap::app::run(config, shutdown).await
    });
    // Blocking tasks still running (an API reader on a stalled client) must not hold the exit up:
    // everything that matters has been stored by now.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(served?)
}

/// `llmtap traces`: one line (or JSON object, bodies left out) per captured call.
fn list_traces(store: StoreArgs, select: Selection, limit: Option<u64>, json: bool) -> Result<()> {
    let store = open_store(&store)?;
    let mut out = std::io::stdout().lock();
    if !json {
        writeln!(
            out,
            "{:<36} {:<10} {:<24} {:>6} {:<14} {:>9} {:<28} {:>10} {:<20}",
            "ID", "UPSTREAM", "API", "STATUS", "OUTCOME", "MS", "MODEL", "COST", "TRAJECTORY"
        )?;
    }
    let filter = filter(&select, limit)?;
    store.read(|reader| {
        reader.for_each_trace(&filter, &mut |t| {
            let line = if json {
                let mut v = t.to_export_json();
                if let Some(o) = v.as_object_mut() {
                    o.remove("request");
                    o.remove("response");
                }
                v.to_string()
            } else {
                format!(
                    "{:<36} {:<10} {:<24} {:>6} {:<14} {:>9.1} {:<28} {:>10} {:<20}",
                    t.id,
                    t.upstream,
                    t.api.as_str(),
                    t.status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                    t.outcome.as_str(),
                    (t.timings.end - t.timings.start) as f64 / 1000.0,
                    t.model.as_deref().unwrap_or("-"),
                    match (&t.cost, &t.model) {
                        (Some(c), _) => c.display_total(),
                        (None, Some(_)) => "unknown".into(),
                        (None, None) => "-".into(),
                    },
                    t.trajectory_id.as_deref().unwrap_or("-")
                )
            };
            let _ = writeln!(out, "{line}");
            Ok(())
        })
    })?;
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve { store, listen } => serve(store, listen)?,
        Command::CheckConfig { config } => {
            let c = load_config(config.as_ref())?.validate()?;
            c.price_table()?;
            println!("ok: listen {} data_dir {}", c.listen, c.data_dir.display());
            for u in c.upstreams.values() {
                println!("  /{}/ -> {} ({})", u.name, u.url, u.api().as_str());
            }
        }
        Command::Sessions {
            store,
            select,
            json,
            all,
        } => {
            let store = open_store(&store)?;
            let filter = filter(&select, None)?;
            let rows = store.read(|reader| reader.sessions(&filter))?;
            let sessions = llmtap::cli::sessions::group(rows.into_iter().map(|r| r.summary).collect());
            let mut out = std::io::stdout().lock();
            if json {
                for s in sessions {
                    writeln!(out, "{}", serde_json::to_string(&s)?)?;
                }
            } else {
                llmtap::cli::sessions::write_table(&mut out, &sessions, all)?;
            }
        }
        Command::Traces {
            store,
            select,
            limit,
            json,
        } => list_traces(store, select, limit, json)?,
        Command::Search {
            store,
            query,
            model,
            agent,
            errors,
            since,
            until,
            min_cost,
            max_cost,
            limit,
            json,
        } => {
            let select = Selection {
                since,
                until,
                ..Selection::default()
            };
            let time = filter(&select, None)?;
            let mut q = llmtap::store::search::SearchQuery::new(llmtap::store::search::Terms::parse(&query.join(" "))?);
            q.model = model;
            q.agent = agent;
            q.errors_only = errors;
            q.min_cost = min_cost;
            q.max_cost = max_cost;
            q.since_us = time.since_us;
            q.until_us = time.until_us;
            q.limit = limit.clamp(1, llmtap::store::search::SearchQuery::MAX_LIMIT);
            let store = open_store(&store)?;
            let hits = store.read(|reader| reader.search(&q))?;
            llmtap::cli::search::write_hits(&mut std::io::stdout().lock(), &hits, json)?;
        }
        Command::Export {
            store,
            select,
            format,
            out,
        } => {
            let store = open_store(&store)?;
            let f = filter(&select, None)?;
            let n = match out {
                Some(path) => {
                    let file =
                        std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
                    let mut w = std::io::BufWriter::new(file);
                    llmtap::export::write_jsonl_from(&store, format, &f, &mut w)?
                }
                None => {
                    let mut w = std::io::BufWriter::new(std::io::stdout().lock());
                    llmtap::export::write_jsonl_from(&store, format, &f, &mut w)?
                }
            };
            tracing::debug!(records = n, "Export written");
        }
        Command::Tail {
            config,
            api,
            session,
            agent,
        } => {
            let config = load_config(config.as_ref())?.validate()?;
            let addr = match api {
                Some(a) => a,
                None => config
                    .api
                    .listen
                    .map(|a| a.to_string())
                    .context("the config turns the API off ([api] listen = \"off\"); `llmtap tail` reads it")?,
            };
            let options = llmtap::cli::tail::TailOptions {
                endpoint: format!("http://{addr}"),
                token: config.api.token.as_ref().map(|t| t.expose().to_owned()),
                session,
                agent,
                color: llmtap::cli::tail::want_color(),
            };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                let mut out = std::io::stdout().lock();
                tokio::select! {
                    r = llmtap::cli::tail::run(&options, &mut out) => r,
                    () = wait_for_signal() => Ok(()),
                }
            })?;
        }
        Command::Ca { store, rotate } => {
            let config = resolve_config(&store, None)?;
            let ca = load_ca(&config, rotate)?;
            print!("{}", llmtap::cli::run::describe(&ca.info));
        }
        Command::Run { .. } => anyhow::bail!("`run` is handled by main"),
        Command::Replay { store, args } => replay(store, args)?,
        Command::Status { addr, config } => {
            let config = load_config(config.as_ref())?.validate()?;
            let token = config.api.token.as_ref().map(|t| t.expose());
            let text = fetch_metrics(&addr, token).with_context(|| format!("cannot reach llmtap at {addr}"))?;
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                println!("{line}");
            }
        }
    }
    Ok(())
}

/// `llmtap replay`: the call re-sent through the running proxy (the config's `listen`, or `--proxy`).
fn replay(store: StoreArgs, args: llmtap::cli::replay::ReplayArgs) -> Result<()> {
    use llmtap::cli::replay::{Setup, run};
    let config = resolve_config(&store, None)?;
    let proxy = match &args.proxy {
        Some(p) => p.parse().with_context(|| format!("--proxy {p:?} is not HOST:PORT"))?,
        None => config.listen,
    };
    let setup = Setup {
        store: open_store(&store)?,
        upstreams: config
            .upstreams
            .iter()
            .map(|(k, u)| (k.clone(), u.url.to_string()))
            .collect(),
        redactor: llmtap::proxy::redact::Redactor::new(&config.capture.redact_headers),
        proxy,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut out = std::io::stdout();
        let mut err = std::io::stderr();
        run(&args, &setup, |name| std::env::var(name).ok(), &mut out, &mut err).await
    })?;
    Ok(())
}

fn load_ca(config: &Config, rotate: bool) -> Result<llmtap::proxy::intercept::ca::Ca> {
    let names = llmtap::proxy::intercept::hosts::InterceptList::new(config).ca_names();
    llmtap::proxy::intercept::ca::load_or_create(&config.data_dir, &names, rotate)
        .context("cannot load or create llmtap's CA")
}

/// `llmtap run -- <command...>`: the command runs with its HTTPS through llmtap (the one listening at the
/// config's address, else one started here for the run), as one session. Exits with the command's status.
fn run_command(store: StoreArgs, session: Option<String>, command: Vec<String>) -> Result<ExitCode> {
    use llmtap::cli::run;
    let config = resolve_config(&store, None)?;
    let ca = load_ca(&config, false)?;
    let system = run::system_roots(std::env::var_os("SSL_CERT_FILE").as_deref().map(std::path::Path::new));
    let (bundle, with_system) = run::write_bundle(&ca.info, system.as_deref())?;
    if !with_system {
        eprintln!("llmtap run: no system CA bundle found; SSL_CERT_FILE holds llmtap's CA alone");
    }
    let session = session.unwrap_or_else(run::new_session_id);
    let listen = run::reachable(config.listen);
    let token = config.api.token.as_ref().map(|t| t.expose().to_owned());
    let running = fetch_metrics(&listen.to_string(), token.as_deref()).is_ok();
    // In-process: the proxy on its own runtime and thread, stopped (and drained into the store) after the child.
    let mut local = None;
    let (proxy, viewer) = if running {
        // A configured port 0 says nothing about where the running viewer is.
        (
            listen,
            config.viewer.listen.filter(|v| v.port() != 0).map(run::reachable),
        )
    } else {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .on_thread_park(llmtap::allocator::release_on_tick)
            .build()?;
        let shutdown = CancellationToken::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let stop = shutdown.clone();
        let app_config = config.clone();
        let thread = std::thread::Builder::new().name("llmtap-run".into()).spawn(move || {
            let served = rt.block_on(async move {
                // Ctrl-C reaches the child too; llmtap stops once the child has exited, not before.
                tokio::spawn(async {
                    loop {
                        if tokio::signal::ctrl_c().await.is_err() {
                            return;
                        }
                    }
                });
                llmtap::app::run_with(app_config, stop, llmtap::app::Announce::Caller(tx)).await
            });
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
            served
        })?;
        let bound = match rx.blocking_recv() {
            Ok(bound) => bound,
            Err(_) => {
                let outcome = thread.join();
                return match outcome {
                    Ok(Err(e)) => Err(e).context("cannot start llmtap for the run"),
                    _ => Err(anyhow::anyhow!("llmtap did not start")),
                };
            }
        };
        local = Some((shutdown, thread));
        (bound.proxy, bound.viewer)
    };
    let no_proxy = std::env::var("NO_PROXY").or_else(|_| std::env::var("no_proxy")).ok();
    let env = run::child_env(
        proxy,
        &session,
        token.as_deref(),
        &ca.info.cert_path,
        &bundle,
        no_proxy.as_deref(),
    );
    eprintln!(
        "llmtap run: session {session} through {} ({}){}; follow it with `llmtap tail --session {session}`",
        run::reachable(proxy),
        if running {
            "the running llmtap"
        } else {
            "started for this run"
        },
        viewer
            .map(|v| format!(", viewer http://{}/", run::reachable(v)))
            .unwrap_or_default(),
    );
    let (program, args) = command.split_first().context("no command to run")?;
    let status = std::process::Command::new(program)
        .args(args)
        .envs(env)
        .status()
        .with_context(|| format!("cannot run {program:?}"));
    if let Some((shutdown, thread)) = local {
        shutdown.cancel();
        match thread.join() {
            Ok(Err(e)) => eprintln!("llmtap: {e}"),
            Err(_) => eprintln!("llmtap: the in-process proxy failed"),
            Ok(Ok(())) => {}
        }
    }
    let status = status?;
    Ok(match status.code() {
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // Killed by a signal: the shell's convention, 128 + its number.
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                ExitCode::from(128u8.saturating_add(status.signal().unwrap_or(1) as u8))
            }
            #[cfg(not(unix))]
            ExitCode::FAILURE
        }
    })
}

/// GET /metrics from a running llmtap (hyper's client on a one-off runtime; 5 s to answer), with the API token
/// as a bearer token when one is configured.
fn fetch_metrics(addr: &str, token: Option<&str>) -> Result<String> {
    use http_body_util::BodyExt;
    let uri: http::Uri = format!("http://{addr}/metrics")
        .parse()
        .with_context(|| format!("{addr} is not a host:port"))?;
    let mut request = http::Request::get(uri);
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .context("the [api] token cannot be sent in a header")?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<http_body_util::Empty<bytes::Bytes>>();
        let fetch = async {
            let response = client.request(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            anyhow::ensure!(status.is_success(), "/metrics answered {status}");
            Ok(String::from_utf8_lossy(&body).into_owned())
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), fetch)
            .await
            .context("no answer within 5 s")?
    })
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
