//! Proxy benchmark: the same load against a direct connection, a bare hyper passthrough, llmtap with capture
//! off, and llmtap with capture + SQLite store on. The load generator is a Rust hyper client in this process
//! (HTTP/1.1 keep-alive connections); upstream, passthrough and llmtap are separate processes on loopback.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::capture::ThreadCpu;
use super::servers::chat_request_body;
use super::stats::{Summary, fmt_delta_us, fmt_rate};

pub struct Scale {
    /// Every measurement runs in this many rounds, each round visiting every target in turn, so a slow
    /// moment of a shared machine lands on all targets alike instead of on whichever ran then.
    pub rounds: usize,
    pub latency_requests: usize,
    /// The latency phase's own rounds: shorter and more of them (0.5 s per target at the full scale), because a
    /// few microseconds of difference are what it measures and the VM's slow phases last seconds.
    pub latency_rounds: usize,
    pub latency_rate: u64,
    pub saturation_secs: u64,
    pub saturation_conns: usize,
    pub streams: usize,
    /// The second, larger steady stream load (0: skipped).
    pub many_streams: usize,
    pub stream_events: usize,
    pub long_streams: usize,
    /// How many times the long-stream load runs (growth from one run to the next would be a leak).
    pub memory_runs: usize,
    /// One-call conversations sent before the long-stream runs (`llmtap-bench memory`).
    pub flood_calls: usize,
}

pub const FULL: Scale = Scale {
    rounds: 5,
    latency_requests: 5_000,
    latency_rounds: 20,
    latency_rate: 500,
    saturation_secs: 2,
    saturation_conns: 32,
    streams: 100,
    many_streams: 1_000,
    stream_events: 200,
    long_streams: 1_000,
    memory_runs: 3,
    flood_calls: 20_000,
};

pub const SMOKE: Scale = Scale {
    rounds: 2,
    latency_requests: 200,
    latency_rounds: 2,
    latency_rate: 200,
    saturation_secs: 1,
    saturation_conns: 4,
    streams: 5,
    many_streams: 20,
    stream_events: 20,
    long_streams: 50,
    memory_runs: 1,
    flood_calls: 500,
};

pub(super) struct Proc {
    pub(super) child: Child,
    pub(super) addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) fn spawn(mut cmd: Command) -> Proc {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| {
            eprintln!("cannot start {cmd:?}: {e}");
            std::process::abort()
        });
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .map(|a| a.trim_start_matches("http://"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| {
            eprintln!("unexpected first line from {cmd:?}: {line:?}");
            std::process::abort()
        });
    Proc { child, addr }
}

/// The Prometheus text of a running llmtap's `/metrics`.
/// A counter or gauge (`name` with its trailing space) read from a metrics page; 0 if absent.
pub fn metric_in(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Waits (at most 300 s) until an llmtap has caught up with what it captured: nothing waits in memory or on
/// disk for the pipeline, and the pipeline processed nothing more during one `poll`. `metric` reads one of its
/// metrics. Returns how long the wait took.
pub fn wait_caught_up(metric: impl Fn(&str) -> u64, poll: Duration) -> Duration {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(300);
    let mut processed = u64::MAX;
    while Instant::now() < deadline {
        let now = metric("llmtap_processed_total ");
        if now == processed && metric("llmtap_capture_queue_bytes ") == 0 && metric("llmtap_capture_spill_bytes ") == 0
        {
            break;
        }
        processed = now;
        std::thread::sleep(poll);
    }
    start.elapsed()
}

pub(super) fn metrics_text(addr: SocketAddr) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

pub(super) fn exe_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|p| p.to_owned()))
        .unwrap_or_default()
}

/// Wait until the process `pid` is idle: at most 10 ms of CPU in a 200 ms window, twice in a row (at most
/// 60 s). After [`wait_caught_up`] an llmtap still commits, exports and checkpoints what it
/// processed; this keeps that work out of the next target's round.
pub fn wait_idle(pid: u32) -> Duration {
    let start = Instant::now();
    let mut quiet = 0;
    let cpu_us = || ThreadCpu::of(&pid.to_string()).total();
    let mut last = cpu_us();
    while quiet < 2 && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(200));
        let now = cpu_us();
        quiet = if now.saturating_sub(last) <= 10_000 {
            quiet + 1
        } else {
            0
        };
        last = now;
    }
    start.elapsed()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// llmtap with capture on or off; with capture on, spans and metrics go to the OTLP receiver at `otlp`. `extra`
/// is appended to the generated config (TOML).
pub(super) fn start_llmtap(
    upstream: SocketAddr,
    capture: bool,
    otlp: Option<SocketAddr>,
    data_dir: &std::path::Path,
    extra: &str,
) -> Proc {
    start_llmtap_from(&exe_dir().join("llmtap"), upstream, capture, otlp, data_dir, extra)
}

/// [`start_llmtap`] with the `llmtap` binary at `bin` (another build, for `LLMTAP_BENCH_BASELINE`).
pub fn start_llmtap_from(
    bin: &std::path::Path,
    upstream: SocketAddr,
    capture: bool,
    otlp: Option<SocketAddr>,
    data_dir: &std::path::Path,
    extra: &str,
) -> Proc {
    let config = data_dir.join("bench.toml");
    let _ = std::fs::create_dir_all(data_dir);
    let export = otlp
        .map(|a| format!("[[export.otlp]]\nname = \"bench\"\nendpoint = \"http://{a}\"\nprotocol = \"grpc\"\n"))
        .unwrap_or_default();
    // `LLMTAP_BENCH_CAPTURE`: more `[capture]` keys for the capture-on llmtaps (e.g. `queue_capacity = 100000`).
    let capture_extra = match capture {
        true => std::env::var("LLMTAP_BENCH_CAPTURE").unwrap_or_default(),
        false => String::new(),
    };
    let _ = std::fs::write(
        &config,
        format!(
            "[capture]\nenabled = {capture}\n{capture_extra}\n[api]\nlisten = \"off\"\n[viewer]\nlisten = \"off\"\n[upstreams.bench]\nurl = \"http://{upstream}\"\napi = \"openai\"\n{export}{extra}"
        ),
    );
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(data_dir);
    cmd.env("RUST_LOG", "error");
    spawn(cmd)
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client(conns: usize) -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(conns)
        .build(http)
}

/// One request: (time to first data frame, time to the end, largest gap between two data frames).
async fn one_gaps(
    client: &HttpClient,
    url: &str,
    body: &Bytes,
    stream: Option<&str>,
) -> Option<(Duration, Duration, Duration)> {
    let mut req = Request::post(url).header("content-type", "application/json");
    if let Some(s) = stream {
        req = req.header("x-bench-stream", s);
    }
    let req = req.body(Full::new(body.clone())).ok()?;
    let start = Instant::now();
    let resp = client.request(req).await.ok()?;
    let mut body = resp.into_body();
    let mut first = None;
    let mut last = None;
    let mut gap = Duration::ZERO;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        if frame.is_data() {
            let now = start.elapsed();
            if first.is_none() {
                first = Some(now);
            }
            if let Some(prev) = last {
                gap = gap.max(now - prev);
            }
            last = Some(now);
        }
    }
    Some((first.unwrap_or_default(), start.elapsed(), gap))
}

async fn one(client: &HttpClient, url: &str, body: &Bytes, stream: Option<&str>) -> Option<(Duration, Duration)> {
    let mut req = Request::post(url).header("content-type", "application/json");
    if let Some(s) = stream {
        req = req.header("x-bench-stream", s);
    }
    let req = req.body(Full::new(body.clone())).ok()?;
    let start = Instant::now();
    let resp = client.request(req).await.ok()?;
    let mut body = resp.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        if frame.is_data() && first.is_none() {
            first = Some(start.elapsed());
        }
    }
    Some((first.unwrap_or_default(), start.elapsed()))
}

/// Open-loop at a fixed rate over a few connections: latency without queueing.
async fn latency(url: &str, n: usize, rate: u64) -> Vec<Duration> {
    let client = client(8);
    let body = chat_request_body();
    for _ in 0..50 {
        let _ = one(&client, url, &body, None).await; // warm the pools
    }
    let interval = Duration::from_micros(1_000_000 / rate.max(1));
    let mut ticker = tokio::time::interval(interval);
    let mut handles = Vec::with_capacity(n);
    for _ in 0..n {
        ticker.tick().await;
        let (client, body, url) = (client.clone(), body.clone(), url.to_owned());
        handles.push(tokio::spawn(async move {
            one(&client, &url, &body, None).await.map(|t| t.1)
        }));
    }
    let mut out = Vec::with_capacity(n);
    for h in handles {
        if let Ok(Some(d)) = h.await {
            out.push(d);
        }
    }
    out
}

/// Connections the open-loop load spreads its schedule over.
const OPEN_LOOP_CONNS: usize = 64;

/// `n` requests open loop at `rate`, cycling through `bodies`: how many were answered.
///
/// Request `i` is due at `i / rate` after the start and goes out on connection `i % OPEN_LOOP_CONNS`, whose task
/// sends it when due (at once when it is late). Every task runs on the bench runtime's one worker. A schedule
/// driven from the `block_on` thread with a spawn per request costs a cross-thread wake per request: on 2 cores
/// it cannot offer more than ~9k req/s, even to the upstream directly.
pub async fn open_loop(url: &str, bodies: &[Bytes], n: usize, rate: u64) -> usize {
    let client = client(OPEN_LOOP_CONNS);
    let start = tokio::time::Instant::now();
    let per_request = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let bodies: Arc<[Bytes]> = bodies.into();
    let url: Arc<str> = url.into();
    let mut handles = Vec::with_capacity(OPEN_LOOP_CONNS);
    for lane in 0..OPEN_LOOP_CONNS.min(n) {
        let (client, bodies, url) = (client.clone(), bodies.clone(), url.clone());
        handles.push(tokio::spawn(async move {
            let mut ok = 0;
            for i in (lane..n).step_by(OPEN_LOOP_CONNS) {
                tokio::time::sleep_until(start + per_request * i as u32).await;
                let body = &bodies[i % bodies.len().max(1)];
                ok += usize::from(one(&client, &url, body, None).await.is_some());
            }
            ok
        }));
    }
    let mut ok = 0;
    for h in handles {
        ok += h.await.unwrap_or(0);
    }
    ok
}

/// The throughput phase's load against `url` alone, for profiling by hand: prints the rate reached.
pub fn saturate(url: &str, secs: u64, conns: usize) {
    match super::servers::runtime() {
        Ok(rt) => println!(
            "{url}: {}/s",
            super::stats::fmt_rate(rt.block_on(saturation(url, conns, secs)))
        ),
        Err(e) => eprintln!("llmtap-bench: {e}"),
    }
}

/// The lossless phase's open-loop load against `url` alone (`rate` requests per second for `secs`), for
/// profiling by hand: prints how many were answered and the rate achieved.
pub fn pace(url: &str, rate: u64, secs: f64) {
    let Ok(rt) = super::servers::runtime() else {
        return;
    };
    let n = (rate as f64 * secs) as usize;
    let start = Instant::now();
    let ok = rt.block_on(open_loop(url, &[chat_request_body()], n, rate));
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "{url}: {ok} of {n} answered in {elapsed:.2} s = {}/s",
        super::stats::fmt_rate(ok as f64 / elapsed)
    );
}

/// Closed loop with `conns` workers for `secs`: requests per second at saturation.
async fn saturation(url: &str, conns: usize, secs: u64) -> f64 {
    let client = client(conns);
    let body = chat_request_body();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut handles = Vec::new();
    for _ in 0..conns {
        let (client, body, url, count) = (client.clone(), body.clone(), url.to_owned(), count.clone());
        handles.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                if one(&client, &url, &body, None).await.is_some() {
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }));
    }
    for h in handles {
        let _ = h.await;
    }
    count.load(std::sync::atomic::Ordering::Relaxed) as f64 / secs as f64
}

/// `n` concurrent SSE streams on a new client (new connections), all started at once.
async fn streams(url: &str, n: usize, events: usize, delay_ms: u64) -> Vec<(Duration, Duration, Duration)> {
    streams_on(&client(n), url, n, events, delay_ms, Duration::ZERO).await
}

/// `n` SSE streams over `client` (whose pool may already hold connections), the i-th started at
/// `i * stagger`: (time to first byte, time to last byte) each.
async fn streams_on(
    client: &HttpClient,
    url: &str,
    n: usize,
    events: usize,
    delay_ms: u64,
    stagger: Duration,
) -> Vec<(Duration, Duration, Duration)> {
    let body = chat_request_body();
    let spec = format!("{events},{delay_ms}");
    let mut handles = Vec::new();
    let start = tokio::time::Instant::now();
    for i in 0..n {
        if !stagger.is_zero() {
            tokio::time::sleep_until(start + stagger * i as u32).await;
        }
        let (client, body, url, spec) = (client.clone(), body.clone(), url.to_owned(), spec.clone());
        handles.push(tokio::spawn(async move {
            one_gaps(&client, &url, &body, Some(&spec)).await
        }));
    }
    let mut out = Vec::new();
    for h in handles {
        if let Ok(Some(t)) = h.await {
            out.push(t);
        }
    }
    out
}

/// The fast upstream, as a child process.
fn start_upstream() -> Proc {
    spawn({
        let mut c = Command::new(exe_dir().join("llmtap-bench"));
        c.arg("upstream");
        c
    })
}

/// Which of the proxy benchmark's phases run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Phases {
    All,
    /// The added-latency phase (`llmtap-bench latency`).
    Latency,
    /// The throughput phase (`llmtap-bench throughput`).
    Throughput,
}

pub fn run(scale: &Scale, phases: Phases) {
    let Ok(rt) = super::servers::runtime() else {
        return;
    };
    let me = exe_dir().join("llmtap-bench");
    let upstream = start_upstream();
    let passthrough = spawn({
        let mut c = Command::new(&me);
        c.args(["passthrough", &upstream.addr.port().to_string()]);
        c
    });
    let dir = std::env::temp_dir().join(format!("llmtap-bench-proxy-{}", std::process::id()));
    let (otlp_addr, spans_received) = match super::servers::otlp_receiver() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the OTLP receiver: {e}");
            return;
        }
    };
    let tap_off = start_llmtap(upstream.addr, false, None, &dir.join("off"), "");
    let tap_on = start_llmtap(upstream.addr, true, Some(otlp_addr), &dir.join("on"), "");
    // Another build, capture on, as one more target: the same rounds compare it with this one side by side.
    let baseline = std::env::var_os("LLMTAP_BENCH_BASELINE").map(|bin| {
        let bin = PathBuf::from(bin);
        start_llmtap_from(&bin, upstream.addr, true, Some(otlp_addr), &dir.join("baseline"), "")
    });
    std::thread::sleep(Duration::from_millis(300));
    let idle_rss = rss_kib(tap_on.child.id());
    let tap_on_addr = tap_on.addr;
    let tap_on_pid = tap_on.child.id();
    let metric = move |name: &str| -> u64 { metric_in(&metrics_text(tap_on_addr), name) };
    // Captured and dropped by the capture+store+OTLP llmtap since the last call.
    let mut seen = (0u64, 0u64);
    let mut capture_since = move || {
        let now = (
            metric("llmtap_captured_total "),
            metric("llmtap_capture_dropped_total "),
        );
        let d = (now.0 - seen.0, now.1 - seen.1);
        seen = now;
        format!("capture kept {} exchanges, dropped {} (queue full)", d.0, d.1)
    };

    let nginx = Nginx::start(upstream.addr, &dir.join("nginx"));
    let mut targets: Vec<(&str, String)> = vec![
        ("direct", format!("http://{}/v1/chat/completions", upstream.addr)),
        (
            "bare hyper passthrough",
            format!("http://{}/v1/chat/completions", passthrough.addr),
        ),
        (
            "llmtap, capture off",
            format!("http://{}/bench/v1/chat/completions", tap_off.addr),
        ),
        (
            "llmtap, capture+store+OTLP on",
            format!("http://{}/bench/v1/chat/completions", tap_on.addr),
        ),
    ];
    if let Some(b) = &baseline {
        targets.push((
            "llmtap baseline (LLMTAP_BENCH_BASELINE), capture+store+OTLP on",
            format!("http://{}/bench/v1/chat/completions", b.addr),
        ));
    }
    match &nginx {
        Some(n) => targets.insert(
            2,
            ("nginx reverse proxy", format!("http://{}/v1/chat/completions", n.addr)),
        ),
        None => println!("  (nginx not found: no nginx reference hop in this run)"),
    }
    println!("proxy: non-streamed ~2 KB chat completion; upstream, passthrough and llmtap are separate processes;");
    println!("  load generator: Rust hyper client in the bench process (HTTP/1.1 keep-alive). All on loopback.");

    if phases != Phases::Throughput {
        latency_phase(&rt, &targets, scale);
        println!("  (capture+store+OTLP on during this phase: {})", capture_since());
    }
    if phases == Phases::Latency {
        drop((tap_on, tap_off));
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }

    println!(
        "throughput at saturation ({} connections, {} rounds of {} s per target, median round):",
        scale.saturation_conns, scale.rounds, scale.saturation_secs
    );
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    // After each of its rounds, the capture-on llmtap catches up (its pipeline waits while the proxy saturates
    // the machine; what waited is processed now) before the next target runs, so that no target's round
    // carries another's background work.
    let mut catch_up = Vec::new();
    let baseline_addr = baseline.as_ref().map(|b| b.addr);
    // Each round starts at a different target (as in the latency phase), so that no target always runs in the
    // same place, right after the same neighbour.
    for round in 0..scale.rounds {
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            let (name, url) = &targets[i];
            rounds[i].push(rt.block_on(saturation(url, scale.saturation_conns, scale.saturation_secs)));
            if name.starts_with("llmtap, capture+store") {
                let caught_up = wait_caught_up(metric, Duration::from_millis(100)) + wait_idle(tap_on_pid);
                catch_up.push(caught_up.as_secs_f64());
            } else if let (true, Some(addr)) = (name.starts_with("llmtap baseline"), baseline_addr) {
                wait_caught_up(|n| metric_in(&metrics_text(addr), n), Duration::from_millis(100));
                if let Some(b) = &baseline {
                    wait_idle(b.child.id());
                }
            }
        }
    }
    let median = |v: &mut Vec<f64>| -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let rates: Vec<f64> = rounds.iter_mut().map(median).collect();
    let bare = targets
        .iter()
        .position(|(name, _)| name.starts_with("bare"))
        .map_or(0.0, |i| rates[i]);
    let nginx_rate = targets
        .iter()
        .position(|(name, _)| name.starts_with("nginx"))
        .map_or(0.0, |i| rates[i]);
    for (i, (name, _)) in targets.iter().enumerate() {
        let mut vs = if bare > 0.0 && name.starts_with("llmtap") {
            format!("  ({:.0}% of bare passthrough", 100.0 * rates[i] / bare)
        } else {
            String::new()
        };
        if !vs.is_empty() {
            if nginx_rate > 0.0 {
                vs.push_str(&format!(", {:.2}x nginx", rates[i] / nginx_rate));
            }
            vs.push(')');
        }
        let spread = rounds[i].iter().map(|r| fmt_rate(*r)).collect::<Vec<_>>().join(" ");
        println!("  {name:<26} {:>8} req/s{vs}  [rounds: {spread}]", fmt_rate(rates[i]));
    }
    let catch_up = catch_up.iter().map(|s| format!("{s:.1}")).collect::<Vec<_>>().join(" ");
    println!(
        "  (capture+store+OTLP on during this phase: {}; it caught up and went idle {catch_up} s after its rounds, \
         before the next target ran)",
        capture_since()
    );
    if phases == Phases::Throughput {
        drop((tap_on, tap_off));
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }

    // Stream i starts at i * (stream duration / n): n streams in flight at once, arriving the way an agent
    // fleet's calls do, over kept-alive connections (SDKs pool them). "burst" starts all n at the same instant
    // on new connections: a queue of n connection setups that the first byte of the last stream waits behind.
    let stream_len = Duration::from_millis(5 * scale.stream_events as u64);
    let stagger = stream_len / scale.streams.max(1) as u32;
    println!(
        "streams: {} concurrent SSE streams, {} events 5 ms apart, {} interleaved rounds; steady = one new stream \
         every {:.1} ms over kept-alive connections, burst = all at once on new connections:",
        scale.streams,
        scale.stream_events,
        scale.rounds,
        stagger.as_secs_f64() * 1e3
    );
    let mut warm: Vec<Vec<(Duration, Duration, Duration)>> = vec![Vec::new(); targets.len()];
    let mut cold: Vec<Vec<(Duration, Duration, Duration)>> = vec![Vec::new(); targets.len()];
    for _ in 0..scale.rounds {
        for (i, (_, url)) in targets.iter().enumerate() {
            let c = client(scale.streams);
            // The burst opens every connection (client side and, through a proxy, upstream side).
            let burst = streams_on(&c, url, scale.streams, scale.stream_events, 5, Duration::ZERO);
            cold[i].extend(rt.block_on(burst));
            let steady = streams_on(&c, url, scale.streams, scale.stream_events, 5, stagger);
            warm[i].extend(rt.block_on(steady));
        }
    }
    for (label, runs) in [("steady", &warm), ("burst ", &cold)] {
        print_streams(label, &targets, runs);
    }
    // Many streams at once, steady arrivals: what the hop adds to the first token and to the largest gap
    // between two chunks, against the bare hop. Events 50 ms apart (a model streaming ~20 chunks a second):
    // at the 5 ms of the 100-stream phase, 1,000 streams are 200,000 events a second, which saturates this
    // machine's two cores with the upstream and the client alone (the direct path's own p99 went past 100 ms)
    // and measures the machine rather than the hop.
    if scale.many_streams > 0 {
        const EVENT_MS: u64 = 50;
        let events = scale.stream_events / 5;
        let stagger = Duration::from_millis(EVENT_MS * events as u64) / scale.many_streams as u32;
        let rounds = scale.rounds.min(3);
        println!(
            "streams: {} concurrent SSE streams, {events} events {EVENT_MS} ms apart, steady (one new every {:.2} ms, \
             kept-alive connections), {rounds} interleaved rounds:",
            scale.many_streams,
            stagger.as_secs_f64() * 1e3
        );
        let mut many: Vec<Vec<(Duration, Duration, Duration)>> = vec![Vec::new(); targets.len()];
        let clients: Vec<HttpClient> = targets.iter().map(|_| client(scale.many_streams)).collect();
        for (c, (_, url)) in clients.iter().zip(&targets) {
            // Open the connections first (a burst), then measure the steady load over them.
            let _ = rt.block_on(streams_on(c, url, scale.many_streams, 2, 5, Duration::ZERO));
        }
        for _ in 0..rounds {
            for (i, (c, (_, url))) in clients.iter().zip(&targets).enumerate() {
                let run = streams_on(c, url, scale.many_streams, events, EVENT_MS, stagger);
                many[i].extend(rt.block_on(run));
            }
        }
        print_streams("steady", &targets, &many);
    }

    // Memory of llmtap with capture on: the same load of long streams three times. A leak grows RSS from one
    // run to the next; allocator caches and the capture queue's backlog do not.
    let pid = tap_on.child.id();
    let url = targets[targets.len() - 1].1.clone();
    println!("memory (llmtap, capture+store+OTLP on):");
    println!("  idle RSS {:.1} MiB", idle_rss as f64 / 1024.0);
    long_stream_runs(&rt, pid, &url, scale);
    // What capture kept and exported: nothing is hidden behind a drop counter.
    let drain_start = std::time::Instant::now();
    let mut last = u64::MAX;
    while drain_start.elapsed() < Duration::from_secs(30) {
        let now = spans_received.load(std::sync::atomic::Ordering::Relaxed);
        if now == last && metric("llmtap_export_lag ") == 0 {
            break;
        }
        last = now;
        std::thread::sleep(Duration::from_millis(500));
    }
    println!(
        "export (llmtap, capture+store+OTLP on, whole run): {} records stored; {} spans received by the OTLP receiver; export lag {}",
        metric("llmtap_stored_total "),
        spans_received.load(std::sync::atomic::Ordering::Relaxed),
        metric("llmtap_export_lag ")
    );
    println!(
        "  RSS once the capture backlog is stored and exported: {:.1} MiB",
        rss_kib(pid) as f64 / 1024.0
    );
    drop(targets);
    drop((tap_on, tap_off, passthrough, nginx, upstream));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Per target: TTFB and last byte (against the first target, direct), and what it adds to the first token and
/// to the largest gap between chunks against the bare hop, p50 / p99 over the streams.
fn print_streams(label: &str, targets: &[(&str, String)], runs: &[Vec<(Duration, Duration, Duration)>]) {
    let summaries: Vec<(Summary, Summary, Summary)> = runs
        .iter()
        .map(|t| {
            let mut ttfb: Vec<Duration> = t.iter().map(|x| x.0).collect();
            let mut last: Vec<Duration> = t.iter().map(|x| x.1).collect();
            let mut gap: Vec<Duration> = t.iter().map(|x| x.2).collect();
            (Summary::of(&mut ttfb), Summary::of(&mut last), Summary::of(&mut gap))
        })
        .collect();
    let bare = targets.iter().position(|(n, _)| n.starts_with("bare"));
    for (i, ((name, _), (a, b, g))) in targets.iter().zip(&summaries).enumerate() {
        let figures = if i == 0 {
            format!(
                "TTFB p50 {} p99 {}; last byte p50 {} p99 {}; largest gap p50 {} p99 {} ({} streams)",
                a.p50_us(),
                a.p99_us(),
                b.p50_us(),
                b.p99_us(),
                g.p50_us(),
                g.p99_us(),
                runs[i].len()
            )
        } else {
            let (da, db, _) = &summaries[0];
            let mut f = format!(
                "added TTFB p50 {} p99 {}; last byte p50 {} p99 {}",
                fmt_delta_us(a.pct(0.5), da.pct(0.5)),
                fmt_delta_us(a.pct(0.99), da.pct(0.99)),
                fmt_delta_us(b.pct(0.5), db.pct(0.5)),
                fmt_delta_us(b.pct(0.99), db.pct(0.99))
            );
            if let Some(bi) = bare.filter(|bi| *bi != i) {
                let (ba, _, bg) = &summaries[bi];
                f.push_str(&format!(
                    "; vs bare: TTFB p50 {} p99 {}, largest gap p50 {} p99 {}",
                    fmt_delta_us(a.pct(0.5), ba.pct(0.5)),
                    fmt_delta_us(a.pct(0.99), ba.pct(0.99)),
                    fmt_delta_us(g.pct(0.5), bg.pct(0.5)),
                    fmt_delta_us(g.pct(0.99), bg.pct(0.99))
                ));
            }
            f
        };
        println!("  {label} {name:<30} {figures}");
    }
}

/// nginx (Debian's package) as a plain reverse proxy to the upstream: the reference hop. Two worker processes
/// (the machine's cores, as llmtap's runtime has), keep-alive to the upstream, no buffering (SSE passes through
/// as it arrives), no access log. None if nginx is not installed or does not start.
pub(super) struct Nginx {
    child: Child,
    pub(super) addr: SocketAddr,
}

impl Nginx {
    fn start(upstream: SocketAddr, dir: &std::path::Path) -> Option<Nginx> {
        Nginx::start_with(upstream, dir, "", "", "proxy_pass http://up;")
    }

    /// [`Nginx::start`] with `listen` (parameters after the address: `ssl`), `server` (directives of the server
    /// block: its certificate) and `proxy` (the location's `proxy_pass` and its TLS settings) as given.
    pub(super) fn start_with(
        upstream: SocketAddr,
        dir: &std::path::Path,
        listen: &str,
        server: &str,
        proxy: &str,
    ) -> Option<Nginx> {
        let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())?;
        std::fs::create_dir_all(dir.join("tmp")).ok()?;
        // A free port: bound, then released for nginx (nothing else on loopback races for it here).
        let addr = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?;
        let d = dir.display();
        let conf = format!(
            "worker_processes 2;\nerror_log {d}/error.log error;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 8192; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n\
               fastcgi_temp_path {d}/tmp;\n  uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n\
               upstream up {{ server {upstream}; keepalive 256; }}\n\
               server {{\n    listen {addr} {listen} backlog=4096;\n    {server}\n    client_max_body_size 64m;\n\
                 location / {{ {proxy} proxy_http_version 1.1; proxy_set_header Connection \"\"; \
                 proxy_buffering off; proxy_request_buffering off; }}\n  }}\n}}\n"
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).ok()?;
        let child = Command::new(bin)
            .arg("-c")
            .arg(&path)
            .arg("-p")
            .arg(dir)
            .args(["-g", "daemon off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .ok()?;
        let mut nginx = Nginx { child, addr };
        for _ in 0..100 {
            if std::net::TcpStream::connect(addr).is_ok() {
                return Some(nginx);
            }
            if let Ok(Some(_)) = nginx.child.try_wait() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = nginx.child.kill();
        None
    }

    /// The master's pid and its workers'.
    pub(super) fn pids(&self) -> Vec<u32> {
        let master = self.child.id();
        let mut pids = vec![master];
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let parent = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| super::capture::stat_fields(&stat).nth(1)?.parse::<u32>().ok());
            if parent == Some(master) {
                pids.push(pid);
            }
        }
        pids
    }
}

impl Drop for Nginx {
    /// SIGTERM to the master, which stops its workers (SIGKILL would leave them running).
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let _ = self.child.wait();
    }
}

/// Added latency: `scale.latency_requests` per target at `scale.latency_rate` open loop, in interleaved rounds;
/// the first target is the reference the others are compared with.
fn latency_phase(rt: &tokio::runtime::Runtime, targets: &[(&str, String)], scale: &Scale) {
    println!(
        "latency at {} req/s open loop ({} requests per target, in {} interleaved rounds):",
        scale.latency_rate, scale.latency_requests, scale.latency_rounds
    );
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); targets.len()];
    // Each round starts at a different target, so none always runs right after the same neighbour (whose
    // background work, e.g. an llmtap storing and exporting what it just captured, may still be running).
    for round in 0..scale.latency_rounds {
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            let n = scale.latency_requests / scale.latency_rounds;
            samples[i].extend(rt.block_on(latency(&targets[i].1, n, scale.latency_rate)));
        }
    }
    let mut direct_lat: Option<Summary> = None;
    let mut p50s = Vec::new();
    for ((name, _), lat) in targets.iter().zip(samples.iter_mut()) {
        let s = Summary::of(lat);
        let added = match &direct_lat {
            Some(d) => format!(
                "  added p50 {} p90 {} p99 {}",
                fmt_delta_us(s.pct(0.5), d.pct(0.5)),
                fmt_delta_us(s.pct(0.9), d.pct(0.9)),
                fmt_delta_us(s.pct(0.99), d.pct(0.99))
            ),
            None => String::new(),
        };
        println!(
            "  {name:<26} p50 {:>10} p90 {:>10} p99 {:>10}{added}",
            s.p50_us(),
            s.p90_us(),
            s.p99_us()
        );
        p50s.push((*name, s.pct(0.5)));
        if direct_lat.is_none() {
            direct_lat = Some(s);
        }
    }
    let p50 = |prefix: &str| p50s.iter().find(|(n, _)| n.starts_with(prefix)).map(|(_, d)| *d);
    if let (Some(nginx), Some(on)) = (p50("nginx"), p50("llmtap, capture+store")) {
        println!(
            "  llmtap capture+store+OTLP on vs nginx, added p50: {} (target: no more than +50 us)",
            fmt_delta_us(on, nginx)
        );
    }
}

/// The long-stream load `scale.memory_runs` times against llmtap `pid` at `url`: RSS before, peak, after.
fn long_stream_runs(rt: &tokio::runtime::Runtime, pid: u32, url: &str, scale: &Scale) {
    for run in 1..=scale.memory_runs {
        let before_long = rss_kib(pid);
        let sampler = std::thread::spawn(move || {
            let mut peak = 0;
            // The streams last 5 s (100 events 50 ms apart).
            for _ in 0..120 {
                peak = peak.max(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        });
        let long = rt.block_on(streams(url, scale.long_streams, 100, 50));
        let peak = sampler.join().unwrap_or(0);
        std::thread::sleep(Duration::from_secs(2));
        println!(
            "  run {run}: {} concurrent long streams ({} completed, 100 events 50 ms apart): RSS before {:.1} MiB, \
             peak {:.1} MiB, 2 s after {:.1} MiB",
            scale.long_streams,
            long.len(),
            before_long as f64 / 1024.0,
            peak as f64 / 1024.0,
            rss_kib(pid) as f64 / 1024.0
        );
    }
}

/// How long a trajectory stays open without calls in `llmtap-bench memory` (30 minutes by default): short
/// enough that the run sees the trajectories it opened close, and RSS after they did.
const MEMORY_IDLE_TIMEOUT_SECS: u64 = 60;

/// Memory alone (`llmtap-bench memory`): idle RSS; a flood of `FLOOD_CALLS` one-call conversations (what open
/// trajectories hold); the long-stream runs; RSS after a minute and after the upstream pool's 90 s idle timeout
/// (by then every trajectory has closed: the run's idle timeout is `MEMORY_IDLE_TIMEOUT_SECS`), to tell
/// retained buffers from a leak.
pub fn memory(scale: &Scale) {
    let extra = format!("[derive]\nidle_timeout_secs = {MEMORY_IDLE_TIMEOUT_SECS}\n");
    let Some(stack) = CaptureStack::start_with("memory", &extra) else {
        return;
    };
    std::thread::sleep(Duration::from_millis(300));
    let pid = stack.tap.child.id();
    let idle = rss_kib(pid);
    println!(
        "memory (llmtap, capture+store+OTLP on; trajectories close after {MEMORY_IDLE_TIMEOUT_SECS} s idle): idle RSS {:.1} MiB",
        idle as f64 / 1024.0
    );
    flood(&stack, scale.flood_calls, idle);
    long_stream_runs(&stack.rt, pid, &stack.url, scale);
    let open = |stack: &CaptureStack| stack.metric("llmtap_derive_open_trajectories ");
    for wait in [60u64, 35] {
        std::thread::sleep(Duration::from_secs(wait));
        println!(
            "  {wait} s later: RSS {:.1} MiB, {} open trajectories",
            rss_kib(pid) as f64 / 1024.0,
            open(&stack)
        );
    }
    // Freed memory that only the allocating thread can reclaim stays until that thread allocates again.
    let _ = stack.rt.block_on(latency(&stack.url, 500, 50));
    println!(
        "  after 10 s of light traffic (50 req/s): RSS {:.1} MiB, {} open trajectories",
        rss_kib(pid) as f64 / 1024.0,
        open(&stack)
    );
}

/// `n` one-call conversations (the ~2 KB chat completion, identical, so each is its own one-call trajectory) at
/// 2,000 req/s open loop; once the pipeline has taken up everything captured, RSS against `idle_kib` per open
/// trajectory (everything else the flood left behind, such as SQLite's page cache, is counted in too).
fn flood(stack: &CaptureStack, n: usize, idle_kib: u64) {
    let pid = stack.tap.child.id();
    let t0 = Instant::now();
    let answered = stack
        .rt
        .block_on(open_loop(&stack.url, &[chat_request_body()], n, 2_000));
    let sent = t0.elapsed();
    wait_caught_up(|name| stack.metric(name), Duration::from_millis(500));
    let caught_up = t0.elapsed();
    // The pipeline closes trajectories over the open limit once a second and gives back freed pages after a
    // second without work.
    std::thread::sleep(Duration::from_secs(3));
    let rss = rss_kib(pid);
    let open = stack.metric("llmtap_derive_open_trajectories ");
    let per = match open {
        0 => "n/a (no llmtap_derive_open_trajectories)".to_owned(),
        open => format!("{:.1} KiB", rss.saturating_sub(idle_kib) as f64 / open as f64),
    };
    println!(
        "  flood: {n} one-call conversations at 2,000 req/s ({answered} answered in {:.1} s, pipeline caught up \
         after {:.1} s, {} processed): RSS {:.1} MiB, {open} open trajectories, RSS over idle per open \
         trajectory {per}",
        sent.as_secs_f64(),
        caught_up.as_secs_f64(),
        stack.metric("llmtap_processed_total "),
        rss as f64 / 1024.0,
    );
}

/// An upstream, an OTLP receiver and llmtap with capture + store + OTLP export on, for the single-target modes.
pub struct CaptureStack {
    rt: tokio::runtime::Runtime,
    /// Spans the receiver has accepted.
    spans: Arc<std::sync::atomic::AtomicU64>,
    pub url: String,
    dir: PathBuf,
    tap: Proc,
    _upstream: Proc,
}

impl CaptureStack {
    /// The llmtap's whole metrics page.
    pub fn metrics(&self) -> String {
        metrics_text(self.tap.addr)
    }

    /// A counter or gauge of the llmtap (`name` with its trailing space).
    pub fn metric(&self, name: &str) -> u64 {
        metric_in(&self.metrics(), name)
    }

    pub fn start(mode: &str) -> Option<CaptureStack> {
        CaptureStack::start_with(mode, "")
    }

    /// The llmtap process's id.
    pub fn pid(&self) -> u32 {
        self.tap.child.id()
    }

    /// [`CaptureStack::start`] with `extra` appended to llmtap's config (TOML).
    pub fn start_with(mode: &str, extra: &str) -> Option<CaptureStack> {
        let rt = super::servers::runtime().ok()?;
        let upstream = start_upstream();
        let (otlp_addr, spans) = super::servers::otlp_receiver().ok()?;
        let dir = std::env::temp_dir().join(format!("llmtap-bench-{mode}-{}", std::process::id()));
        let tap = start_llmtap(upstream.addr, true, Some(otlp_addr), &dir, extra);
        let url = format!("http://{}/bench/v1/chat/completions", tap.addr);
        Some(CaptureStack {
            rt,
            spans,
            url,
            dir,
            tap,
            _upstream: upstream,
        })
    }
}

impl Drop for CaptureStack {
    fn drop(&mut self) {
        // llmtap must be gone before its data directory is.
        let _ = self.tap.child.kill();
        let _ = self.tap.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Export throughput: `n` calls through llmtap (capture, store, OTLP/gRPC to a local receiver) at a rate the
/// pipeline keeps up with, then the time until the receiver holds every chat span. Prints spans/s from the
/// first call to the last span received, and the receiver-side rate once traffic stopped.
pub fn export(n: usize) {
    let Some(stack) = CaptureStack::start("export") else {
        return;
    };
    let spans = &stack.spans;
    let cpu_before = super::capture::ThreadCpu::of(&stack.pid().to_string());
    let t0 = std::time::Instant::now();
    let _ = stack.rt.block_on(latency(&stack.url, n, 2000));
    let sent = t0.elapsed();
    let received = || spans.load(std::sync::atomic::Ordering::Relaxed) as usize;
    let at_end_of_traffic = received();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    // Each call is a chat span; sessions of one call also close into an invoke_agent span.
    while received() < n && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let total = t0.elapsed();
    let after = total.saturating_sub(sent).as_secs_f64();
    println!(
        "export: {n} calls at 2000 req/s in {:.1} s; {} spans at the receiver when traffic stopped, {} after {:.1} s more; {:.0} spans/s overall, {:.0} spans/s after traffic stopped",
        sent.as_secs_f64(),
        at_end_of_traffic,
        received(),
        after,
        received() as f64 / total.as_secs_f64(),
        (received() - at_end_of_traffic) as f64 / after.max(0.001)
    );
    println!(
        "  llmtap CPU per call by thread (tokio-rt-worker (background) is the exporter's store reads): {}",
        super::capture::ThreadCpu::of(&stack.pid().to_string()).per_exchange_since(&cpu_before, n as f64)
    );
}
