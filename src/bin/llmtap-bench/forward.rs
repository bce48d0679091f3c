//! Forward-mode benchmark (`llmtap-bench forward`): the same ~2 KB chat completion through llmtap's
//! TLS-terminating forward hop (CONNECT, then TLS with a leaf from llmtap's CA, then TLS again to the provider
//! host) and through nginx doing the same TLS-terminating hop (`listen ... ssl`, `proxy_pass https://` with
//! the upstream's certificate checked), against the upstream over TLS directly, in the same interleaved rounds.
//!
//! The provider host is `api.openai.com` (on llmtap's intercept list); the bench's upstream serves it over TLS
//! under a test CA made for the run, and llmtap reaches it through `[forward] resolve` and `ca_file`. Clients
//! keep their TLS connections open (the per-request figures are the steady state); the handshake phase opens a
//! new connection per request (no session resumption: a full handshake each, llmtap's leaf cache warm).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::capture::ThreadCpu;
use super::proxy::{
    Nginx, Proc, Scale, exe_dir, metric_in, metrics_text, spawn, start_llmtap_from, wait_caught_up, wait_idle,
};
use super::servers::chat_request_body;
use super::stats::{Summary, fmt_delta_us, fmt_rate};

/// The provider host the clients ask for (built into llmtap's intercept list).
const HOST: &str = "api.openai.com";

/// One way to reach the upstream: where to connect, whether through a CONNECT first, and the TLS client
/// trusting that hop's certificate.
#[derive(Clone)]
struct Target {
    name: &'static str,
    addr: SocketAddr,
    connect: bool,
    /// The CA this hop's certificate is under (the handshake phase makes its own clients from it).
    ca: PathBuf,
    tls: tokio_rustls::TlsConnector,
    /// A capture-on llmtap's metrics address and pid: after each of its rounds it catches up and goes idle.
    capture: Option<(SocketAddr, u32)>,
    /// The proxy's processes, whose CPU a throughput round is charged (none for the direct path).
    pids: Vec<u32>,
}

impl Target {
    fn new(
        name: &'static str,
        addr: SocketAddr,
        connect: bool,
        ca: &Path,
        capture: Option<&Proc>,
    ) -> Result<Target, String> {
        Ok(Target {
            name,
            addr,
            connect,
            ca: ca.to_owned(),
            tls: tls_client(ca, true)?,
            capture: capture.map(|p| (p.addr, p.child.id())),
            pids: Vec::new(),
        })
    }

    fn charged_to(mut self, pids: Vec<u32>) -> Target {
        self.pids = pids;
        self
    }

    /// A capture-on llmtap's CPU so far, by thread.
    fn capture_threads(&self) -> Option<ThreadCpu> {
        self.capture.map(|(_, pid)| ThreadCpu::of(&pid.to_string()))
    }

    /// CPU time (user and system, µs) the target's processes have used so far.
    fn cpu_us(&self) -> u64 {
        self.pids.iter().map(|p| ThreadCpu::of(&p.to_string()).total()).sum()
    }
}

/// The run's test CA and a leaf for [`HOST`] signed by it, as PEM files in `dir`: (CA, leaf chain, leaf key).
fn test_pki(dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let e = |e: rcgen::Error| e.to_string();
    let ca_key = KeyPair::generate().map_err(e)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "llmtap-bench test CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(e)?;
    let issuer = Issuer::new(ca, ca_key);
    let leaf_key = KeyPair::generate().map_err(e)?;
    let leaf = CertificateParams::new(vec![HOST.to_owned()])
        .map_err(e)?
        .signed_by(&leaf_key, &issuer)
        .map_err(e)?;
    let paths = (dir.join("test-ca.pem"), dir.join("leaf.pem"), dir.join("leaf-key.pem"));
    for (path, pem) in [
        (&paths.0, ca_cert.pem()),
        (&paths.1, leaf.pem()),
        (&paths.2, leaf_key.serialize_pem()),
    ] {
        std::fs::write(path, pem).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(paths)
}

/// A TLS client trusting only the certificates in `ca` (HTTP/1.1); `resume: false` turns session resumption
/// off, so that every new connection is a full handshake.
fn tls_client(ca: &Path, resume: bool) -> Result<tokio_rustls::TlsConnector, String> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        roots.add(cert.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    if !resume {
        config.resumption = rustls::client::Resumption::disabled();
    }
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A new connection to `t`: TCP, `CONNECT` when `t` is a forward proxy, TLS, HTTP/1.1.
async fn open(t: &Target, tls: &tokio_rustls::TlsConnector) -> Option<SendRequest<Full<Bytes>>> {
    let mut tcp = TcpStream::connect(t.addr).await.ok()?;
    let _ = tcp.set_nodelay(true);
    if t.connect {
        tcp.write_all(format!("CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n").as_bytes())
            .await
            .ok()?;
        // Read as the agents' HTTP stacks do (hyper-util's tunnel, httpcore, undici): whatever has arrived, until
        // the head is complete. In TLS the client speaks first, so nothing can follow the head yet; a byte
        // beyond it is an error, as it is for them. (Byte-by-byte reads cost this client ~40 syscalls per
        // tunnel, which counted against llmtap's rate in the new-connection rounds.)
        let mut head = Vec::with_capacity(256);
        let mut buf = [0u8; 256];
        let end = loop {
            let n = tcp.read(&mut buf).await.ok()?;
            if n == 0 || head.len() + n > 8192 {
                return None;
            }
            head.extend_from_slice(&buf[..n]);
            if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        if end != head.len() || !head.starts_with(b"HTTP/1.1 200") {
            return None;
        }
    }
    let name = rustls_pki_types::ServerName::try_from(HOST).ok()?;
    let stream = tls.connect(name, tcp).await.ok()?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(conn);
    Some(sender)
}

/// One request over `sender`: the time from sending to the last byte of the answer.
async fn call(sender: &mut SendRequest<Full<Bytes>>, body: &Bytes) -> Option<Duration> {
    sender.ready().await.ok()?;
    let req = Request::post("/v1/chat/completions")
        .header("host", HOST)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .ok()?;
    let start = Instant::now();
    let resp = sender.send_request(req).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.into_body().collect().await.ok()?;
    Some(start.elapsed())
}

/// Open loop: `n` requests at `rate` over `conns` kept-alive connections (request i on connection i % conns,
/// sent when due), after 20 warm-up requests per connection.
async fn latency(t: &Target, n: usize, rate: u64, conns: usize) -> Vec<Duration> {
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let per_request = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let body = chat_request_body();
    let mut lanes = Vec::new();
    for lane in 0..conns.min(n) {
        let Some(mut sender) = open(t, &t.tls).await else {
            continue;
        };
        for _ in 0..20 {
            let _ = call(&mut sender, &body).await;
        }
        let body = body.clone();
        lanes.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for i in (lane..n).step_by(conns) {
                tokio::time::sleep_until(start + per_request * i as u32).await;
                out.extend(call(&mut sender, &body).await);
            }
            out
        }));
    }
    let mut out = Vec::with_capacity(n);
    for lane in lanes {
        out.extend(lane.await.unwrap_or_default());
    }
    out
}

/// Closed loop for `secs`: `conns` workers, each on its own connection opened before the clock starts
/// (`new_conns: false`), or opening a new connection with a full handshake for every request (`true`).
/// Requests answered per second.
async fn closed_loop(t: &Target, conns: usize, secs: Duration, new_conns: Option<&tokio_rustls::TlsConnector>) -> f64 {
    let body = chat_request_body();
    let count = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    if new_conns.is_none() {
        for _ in 0..conns {
            senders.extend(open(t, &t.tls).await);
        }
    }
    let start = Instant::now();
    let deadline = start + secs;
    let mut workers = Vec::new();
    for _ in 0..conns {
        let (count, body) = (count.clone(), body.clone());
        let mut kept = if new_conns.is_none() { senders.pop() } else { None };
        if new_conns.is_none() && kept.is_none() {
            break;
        }
        let fresh = new_conns.cloned();
        let target = t.clone();
        workers.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let ok = match (&mut kept, &fresh) {
                    (Some(sender), _) => call(sender, &body).await.is_some(),
                    (None, Some(tls)) => match open(&target, tls).await {
                        Some(mut sender) => call(&mut sender, &body).await.is_some(),
                        None => false,
                    },
                    (None, None) => return,
                };
                if ok {
                    count.fetch_add(1, Ordering::Relaxed);
                } else if kept.is_some() {
                    // A broken kept-alive connection: this worker stops rather than spinning on it.
                    return;
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    count.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Whether `LLMTAP_BENCH_PHASES` (comma-separated: `latency`, `throughput`, `handshakes`; all when unset) names
/// this phase of the forward benchmark.
fn phase(name: &str) -> bool {
    std::env::var("LLMTAP_BENCH_PHASES").map_or(true, |p| p.split(',').any(|x| x.trim() == name))
}

/// The forward-mode benchmark; `smoke`: one short round of each phase (checks only that the mode works).
pub fn run(scale: &Scale, smoke: bool) {
    if let Err(e) = run_inner(scale, smoke) {
        eprintln!("llmtap-bench forward: {e}");
    }
}

fn run_inner(scale: &Scale, smoke: bool) -> Result<(), String> {
    let rt = super::servers::runtime().map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("llmtap-bench-forward-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let result = run_in(&rt, &dir, scale, smoke);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in(rt: &tokio::runtime::Runtime, dir: &Path, scale: &Scale, smoke: bool) -> Result<(), String> {
    let (test_ca, leaf, leaf_key) = test_pki(dir)?;
    let upstream = spawn({
        let mut c = Command::new(exe_dir().join("llmtap-bench"));
        c.arg("upstream-tls").arg(&leaf).arg(&leaf_key);
        c
    });
    let (otlp_addr, _spans) = super::servers::otlp_receiver().map_err(|e| e.to_string())?;
    let forward = format!(
        "[forward]\nca_file = \"{}\"\n[forward.resolve]\n\"{HOST}\" = \"{}\"\n",
        test_ca.display(),
        upstream.addr
    );
    // Each llmtap's CA is made before it starts (`llmtap ca`), so that its clients can trust it.
    let tap = |name: &str, bin: &Path, capture: bool| -> Result<(Proc, PathBuf), String> {
        let data = dir.join(name);
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        let made = Command::new(bin)
            .arg("ca")
            .arg("--data-dir")
            .arg(&data)
            .output()
            .map_err(|e| format!("cannot run llmtap ca: {e}"))?;
        if !made.status.success() {
            return Err(format!("llmtap ca failed: {}", String::from_utf8_lossy(&made.stderr)));
        }
        let otlp = capture.then_some(otlp_addr);
        let proc = start_llmtap_from(bin, upstream.addr, capture, otlp, &data, &forward);
        Ok((proc, data.join("ca/llmtap-ca.pem")))
    };
    let this = exe_dir().join("llmtap");
    let (tap_off, off_ca) = tap("off", &this, false)?;
    let (tap_on, on_ca) = tap("on", &this, true)?;
    // Another build, capture on, as one more target (`LLMTAP_BENCH_BASELINE`, as in the proxy benchmark): the
    // same interleaved rounds compare two builds side by side, which the VM's drift between runs does not.
    let baseline = match std::env::var_os("LLMTAP_BENCH_BASELINE") {
        Some(bin) => Some(tap("baseline", Path::new(&bin), true)?),
        None => None,
    };
    let nginx = Nginx::start_with(
        upstream.addr,
        &dir.join("nginx"),
        "ssl",
        &format!(
            "ssl_certificate {}; ssl_certificate_key {};",
            leaf.display(),
            leaf_key.display()
        ),
        &format!(
            "proxy_pass https://up; proxy_set_header Host {HOST}; proxy_ssl_server_name on; proxy_ssl_name {HOST}; \
             proxy_ssl_verify on; proxy_ssl_trusted_certificate {};",
            test_ca.display()
        ),
    );
    let mut targets = vec![Target::new(
        "direct (TLS to the upstream)",
        upstream.addr,
        false,
        &test_ca,
        None,
    )?];
    match &nginx {
        Some(n) => targets
            .push(Target::new("nginx TLS-terminating proxy", n.addr, false, &test_ca, None)?.charged_to(n.pids())),
        None => println!("  (nginx not found: no nginx reference hop in this run)"),
    }
    targets.push(
        Target::new("llmtap forward, capture off", tap_off.addr, true, &off_ca, None)?
            .charged_to(vec![tap_off.child.id()]),
    );
    targets.push(
        Target::new("llmtap forward, capture on", tap_on.addr, true, &on_ca, Some(&tap_on))?
            .charged_to(vec![tap_on.child.id()]),
    );
    if let Some((b, b_ca)) = &baseline {
        targets.push(
            Target::new("baseline build, capture on", b.addr, true, b_ca, Some(b))?.charged_to(vec![b.child.id()]),
        );
    }
    // Every target answers before anything is measured (and llmtap's leaf cache is warm).
    for t in &targets {
        let ok = rt.block_on(async {
            let mut s = open(t, &t.tls).await?;
            call(&mut s, &chat_request_body()).await
        });
        if ok.is_none() {
            return Err(format!("{} does not answer over TLS", t.name));
        }
    }
    let on_addr = tap_on.addr;
    // After each capture-on round that llmtap catches up and goes idle, so no other round carries its work
    // (skipped by the smoke run, which measures nothing).
    let settle = |t: &Target| {
        if let (false, Some((addr, pid))) = (smoke, t.capture) {
            wait_caught_up(|m| metric_in(&metrics_text(addr), m), Duration::from_millis(100));
            wait_idle(pid);
        }
    };
    println!(
        "forward mode: CONNECT + TLS (llmtap's CA) through llmtap, TLS to nginx; both proxies terminate TLS and \
         connect to the upstream over TLS (keep-alive); ~2 KB chat completion for {HOST}:"
    );

    let find = |prefix: &str| targets.iter().position(|t| t.name.starts_with(prefix));
    let (nginx_i, on_i) = (find("nginx"), find("llmtap forward, capture on"));
    if phase("latency") {
        // Added latency, kept-alive TLS connections.
        let (lat_n, lat_rounds) = if smoke {
            (100, 1)
        } else {
            (scale.latency_requests, scale.latency_rounds)
        };
        println!(
            "  latency at {} req/s open loop, 4 kept-alive connections ({lat_n} requests per target in {lat_rounds} \
             interleaved rounds):",
            scale.latency_rate
        );
        let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); targets.len()];
        for round in 0..lat_rounds {
            for k in 0..targets.len() {
                let i = (round + k) % targets.len();
                let t = &targets[i];
                samples[i].extend(rt.block_on(latency(t, lat_n / lat_rounds, scale.latency_rate, 4)));
                settle(t);
            }
        }
        let summaries: Vec<Summary> = samples.iter_mut().map(|s| Summary::of(s)).collect();
        for (t, s) in targets.iter().zip(&summaries) {
            let d = &summaries[0];
            println!(
                "    {:<30} p50 {:>10} p99 {:>10}  added p50 {} p99 {}",
                t.name,
                s.p50_us(),
                s.p99_us(),
                fmt_delta_us(s.pct(0.5), d.pct(0.5)),
                fmt_delta_us(s.pct(0.99), d.pct(0.99))
            );
        }
        if let (Some(n), Some(o)) = (nginx_i, on_i) {
            println!(
                "    llmtap forward, capture on vs nginx, added p50: {} (target: no more than +100 us)",
                fmt_delta_us(summaries[o].pct(0.5), summaries[n].pct(0.5))
            );
        }
    }

    // Throughput over kept-alive connections, then new connections per second (a full handshake each).
    let (rounds, secs) = if smoke {
        (1, Duration::from_millis(300))
    } else {
        (scale.rounds, Duration::from_secs(scale.saturation_secs))
    };
    let fresh: Vec<tokio_rustls::TlsConnector> = targets
        .iter()
        .map(|t| tls_client(&t.ca, false))
        .collect::<Result<_, _>>()?;
    for (label, conns, new_conns) in [
        ("throughput", scale.saturation_conns, false),
        ("new TLS connections (one request each, no resumption)", 8, true),
    ] {
        if !phase(if new_conns { "handshakes" } else { "throughput" }) {
            continue;
        }
        println!(
            "  {label}: {conns} connections closed loop, {rounds} rounds of {:.1} s per target, median round:",
            secs.as_secs_f64()
        );
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
        // The proxy's CPU per exchange in each round (µs): what the machine's cores pay for one exchange,
        // whatever else shares them.
        let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
        // The same, the data path's threads only (a capture-on llmtap's background threads left out; all of
        // the others' CPU): the cost of the exchange itself, which for new connections is the handshake's.
        let mut data_cpu: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
        // A capture-on llmtap's CPU by thread over all its rounds, and its exchanges: where the extra goes.
        let mut roles: Vec<(ThreadCpu, f64)> = vec![Default::default(); targets.len()];
        for round in 0..rounds {
            for k in 0..targets.len() {
                let i = (round + k) % targets.len();
                let t = &targets[i];
                let tls = new_conns.then_some(&fresh[i]);
                let (before, threads_before, started) = (t.cpu_us(), t.capture_threads(), Instant::now());
                let rate = rt.block_on(closed_loop(t, conns, secs, tls));
                let exchanges = rate * started.elapsed().as_secs_f64();
                let used = (!t.pids.is_empty() && exchanges > 0.0).then(|| t.cpu_us().saturating_sub(before));
                let threads = match (threads_before, t.capture_threads()) {
                    (Some(b), Some(a)) => Some(a.since(&b)),
                    _ => None,
                };
                if let Some(used) = used {
                    cpu[i].push(used as f64 / exchanges);
                    let data_path = threads.as_ref().map_or(used, ThreadCpu::data_path);
                    data_cpu[i].push(data_path as f64 / exchanges);
                }
                if let Some(threads) = threads {
                    roles[i].0.add(&threads);
                    roles[i].1 += exchanges;
                }
                rates[i].push(rate);
                settle(t);
            }
        }
        // Each round's figure over nginx's in the same round (rates before they are sorted; CPU per exchange):
        // the VM's speed drifts by a third between rounds but little within one, so the median of these pairs
        // is the steadier figure. With new connections the CPU is the handshake's cost, which a forward proxy
        // pays as a reverse proxy does (the rate also carries the CONNECT round trip).
        let per_round = |per: &[Vec<f64>], i: usize| -> Option<f64> {
            let n = nginx_i.filter(|n| *n != i && per[*n].len() == per[i].len())?;
            let mut ratios: Vec<f64> = per[i]
                .iter()
                .zip(&per[n])
                .filter(|(_, n)| **n > 0.0)
                .map(|(r, n)| r / n)
                .collect();
            ratios.sort_by(|a, b| a.total_cmp(b));
            ratios.get(ratios.len() / 2).copied()
        };
        let paired: Vec<Option<f64>> = (0..targets.len()).map(|i| per_round(&rates, i)).collect();
        let cpu_paired: Vec<Option<f64>> = (0..targets.len()).map(|i| per_round(&cpu, i)).collect();
        let data_cpu_paired: Vec<Option<f64>> = (0..targets.len()).map(|i| per_round(&data_cpu, i)).collect();
        let medians: Vec<f64> = rates
            .iter_mut()
            .map(|v| {
                v.sort_by(|a, b| a.total_cmp(b));
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            })
            .collect();
        for (i, t) in targets.iter().enumerate() {
            let vs = match (nginx_i, paired[i]) {
                (Some(n), Some(pair)) if t.name.contains("capture") && medians[n] > 0.0 => {
                    format!("  ({:.2}x nginx; per round {pair:.2}x)", medians[i] / medians[n])
                }
                _ => String::new(),
            };
            let spread = rates[i].iter().map(|r| fmt_rate(*r)).collect::<Vec<_>>().join(" ");
            let cpu = match cpu[i].as_mut_slice() {
                [] => String::new(),
                per => {
                    per.sort_by(|a, b| a.total_cmp(b));
                    let vs = cpu_paired[i].map_or(String::new(), |r| format!(" ({r:.2}x nginx's per round)"));
                    format!("  CPU {:.1} us/exchange{vs}", per[per.len() / 2])
                }
            };
            println!(
                "    {:<30} {:>8} /s{vs}{cpu}  [rounds: {spread}]",
                t.name,
                fmt_rate(medians[i])
            );
            let (used, exchanges) = &roles[i];
            if *exchanges > 0.0 {
                println!("      by thread: {}", used.per_exchange(*exchanges));
            }
        }
        if let Some(o) = on_i {
            match (new_conns, paired[o], data_cpu_paired[o]) {
                (false, Some(rate), _) => println!(
                    "    llmtap forward, capture on vs nginx, throughput per round: {rate:.2}x (target: at least 0.8x)"
                ),
                // The background threads are left out: they derive and store each exchange, a cost per exchange
                // that kept-alive rounds defer past their end and these rounds, with CPU idle, pay as they go.
                (true, _, Some(cpu)) => println!(
                    "    llmtap forward, capture on vs nginx, data path CPU per new connection (background threads \
                     left out) per round: {cpu:.2}x (target: equal to nginx's)"
                ),
                _ => {}
            }
        }
    }
    println!(
        "  (llmtap forward, capture on: {} exchanges captured, {} dropped)",
        metric_in(&metrics_text(on_addr), "llmtap_captured_total "),
        metric_in(&metrics_text(on_addr), "llmtap_capture_dropped_total ")
    );
    drop((tap_on, tap_off, baseline, nginx, upstream));
    Ok(())
}
