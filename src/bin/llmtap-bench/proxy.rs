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

use super::servers::chat_request_body;
use super::stats::{Summary, fmt_delta_us, fmt_rate, fmt_us};

pub struct Scale {
    pub latency_requests: usize,
    pub latency_rate: u64,
    pub saturation_secs: u64,
    pub saturation_conns: usize,
    pub streams: usize,
    pub stream_events: usize,
    pub long_streams: usize,
}

pub const FULL: Scale = Scale {
    latency_requests: 5_000,
    latency_rate: 500,
    saturation_secs: 5,
    saturation_conns: 32,
    streams: 100,
    stream_events: 200,
    long_streams: 1_000,
};

pub const SMOKE: Scale = Scale {
    latency_requests: 200,
    latency_rate: 200,
    saturation_secs: 1,
    saturation_conns: 4,
    streams: 5,
    stream_events: 20,
    long_streams: 50,
};

struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(mut cmd: Command) -> Proc {
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

fn exe_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|p| p.to_owned()))
        .unwrap_or_default()
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

fn start_llmtap(upstream: SocketAddr, capture: bool, data_dir: &std::path::Path) -> Proc {
    let config = data_dir.join("bench.toml");
    let _ = std::fs::create_dir_all(data_dir);
    let _ = std::fs::write(
        &config,
        format!(
            "[capture]\nenabled = {capture}\n[api]\nlisten = \"off\"\n[upstreams.bench]\nurl = \"http://{upstream}\"\napi = \"openai\"\n"
        ),
    );
    let mut cmd = Command::new(exe_dir().join("llmtap"));
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

/// `n` concurrent SSE streams: (time to first byte, time to last byte) each.
async fn streams(url: &str, n: usize, events: usize, delay_ms: u64) -> Vec<(Duration, Duration)> {
    let client = client(n);
    let body = chat_request_body();
    let spec = format!("{events},{delay_ms}");
    let mut handles = Vec::new();
    for _ in 0..n {
        let (client, body, url, spec) = (client.clone(), body.clone(), url.to_owned(), spec.clone());
        handles.push(tokio::spawn(
            async move { one(&client, &url, &body, Some(&spec)).await },
        ));
    }
    let mut out = Vec::new();
    for h in handles {
        if let Ok(Some(t)) = h.await {
            out.push(t);
        }
    }
    out
}

pub fn run(scale: &Scale) {
    let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    else {
        return;
    };
    let me = exe_dir().join("llmtap-bench");
    let upstream = spawn({
        let mut c = Command::new(&me);
        c.arg("upstream");
        c
    });
    let passthrough = spawn({
        let mut c = Command::new(&me);
        c.args(["passthrough", &upstream.addr.port().to_string()]);
        c
    });
    let dir = std::env::temp_dir().join(format!("llmtap-bench-proxy-{}", std::process::id()));
    let tap_off = start_llmtap(upstream.addr, false, &dir.join("off"));
    let tap_on = start_llmtap(upstream.addr, true, &dir.join("on"));
    std::thread::sleep(Duration::from_millis(300));
    let idle_rss = rss_kib(tap_on.child.id());

    let targets: [(&str, String); 4] = [
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
            "llmtap, capture+store on",
            format!("http://{}/bench/v1/chat/completions", tap_on.addr),
        ),
    ];
    println!("proxy: non-streamed ~2 KB chat completion; upstream, passthrough and llmtap are separate processes;");
    println!("  load generator: Rust hyper client in the bench process (HTTP/1.1 keep-alive). All on loopback.");

    println!(
        "latency at {} req/s open loop ({} requests):",
        scale.latency_rate, scale.latency_requests
    );
    let mut direct_lat: Option<Summary> = None;
    for (name, url) in &targets {
        let mut lat = rt.block_on(latency(url, scale.latency_requests, scale.latency_rate));
        let s = Summary::of(&mut lat);
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
        if direct_lat.is_none() {
            direct_lat = Some(s);
        }
    }

    println!(
        "throughput at saturation ({} connections, {} s):",
        scale.saturation_conns, scale.saturation_secs
    );
    let mut bare = 0.0;
    for (name, url) in &targets {
        let rps = rt.block_on(saturation(url, scale.saturation_conns, scale.saturation_secs));
        if name.starts_with("bare") {
            bare = rps;
        }
        let vs = if bare > 0.0 && name.starts_with("llmtap") {
            format!("  ({:.0}% of bare passthrough)", 100.0 * rps / bare)
        } else {
            String::new()
        };
        println!("  {name:<26} {:>8} req/s{vs}", fmt_rate(rps));
    }

    println!(
        "streams: {} concurrent SSE streams, {} events 5 ms apart:",
        scale.streams, scale.stream_events
    );
    let mut direct_streams: Option<(Summary, Summary)> = None;
    for (name, url) in &targets {
        let t = rt.block_on(streams(url, scale.streams, scale.stream_events, 5));
        let mut ttfb: Vec<Duration> = t.iter().map(|x| x.0).collect();
        let mut last: Vec<Duration> = t.iter().map(|x| x.1).collect();
        let (a, b) = (Summary::of(&mut ttfb), Summary::of(&mut last));
        let added = match &direct_streams {
            Some((da, db)) => format!(
                "  added TTFB p50 {} p99 {}; last byte p50 {} p99 {}",
                fmt_delta_us(a.pct(0.5), da.pct(0.5)),
                fmt_delta_us(a.pct(0.99), da.pct(0.99)),
                fmt_delta_us(b.pct(0.5), db.pct(0.5)),
                fmt_delta_us(b.pct(0.99), db.pct(0.99))
            ),
            None => format!(
                "  TTFB p50 {} p99 {}; last byte p50 {}",
                a.p50_us(),
                a.p99_us(),
                b.p50_us()
            ),
        };
        println!("  {name:<26}{added}");
        if direct_streams.is_none() {
            direct_streams = Some((a, b));
        }
    }

    // Memory of llmtap with capture on.
    let pid = tap_on.child.id();
    let before_long = rss_kib(pid);
    let url = targets[3].1.clone();
    let sampler = std::thread::spawn(move || {
        let mut peak = 0;
        for _ in 0..200 {
            peak = peak.max(rss_kib(pid));
            std::thread::sleep(Duration::from_millis(50));
        }
        peak
    });
    let long = rt.block_on(streams(&url, scale.long_streams, 100, 50));
    let peak = sampler.join().unwrap_or(0);
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_kib(pid);
    println!("memory (llmtap, capture+store on):");
    println!("  idle RSS {:.1} MiB", idle_rss as f64 / 1024.0);
    println!(
        "  {} concurrent long streams ({} completed, 100 events 50 ms apart): peak RSS {:.1} MiB (before {:.1} MiB)",
        scale.long_streams,
        long.len(),
        peak as f64 / 1024.0,
        before_long as f64 / 1024.0
    );
    println!("  after the whole run, 2 s later: RSS {:.1} MiB", after as f64 / 1024.0);
    let _ = fmt_us;
    drop(targets);
    drop((tap_on, tap_off, passthrough, upstream));
    let _ = std::fs::remove_dir_all(&dir);
}
