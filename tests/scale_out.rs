//! Scale-out through real processes: llmtap replicas behind real nginx (config/nginx/llmtap.conf), exporting
//! OTLP/gRPC to a real OpenTelemetry collector (rotel), which forwards to a gRPC receiver in this test. The
//! recorded agent sessions are replayed against a single llmtap (the baseline) and against the replicas:
//! with session affinity every span equals the baseline; round-robin keeps trajectory ids and step indexes
//! but loses cross-call facts; a replica killed with SIGKILL loses nothing it stored.
//!
//! nginx and rotel-agent come from `scripts/test.sh` (it installs them when missing).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::nginx::{Balance, Nginx, nginx_bin};
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::AnyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AV;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::Value;

const REPLICA_CONFIG: &str = include_str!("../config/collector.toml");
/// The resource attribute that tells the runs apart at the one receiver.
const RUN_ATTR: &str = "test.run";

// === the tools scripts/test.sh installs ===

fn rotel_bin() -> PathBuf {
    let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
    let found = std::fs::read_dir(&lib).into_iter().flatten().flatten().find_map(|e| {
        let p = e.path().join("site-packages/rotel/rotel-agent");
        p.exists().then_some(p)
    });
    found.unwrap_or_else(|| panic!("rotel-agent is not in .venv: run scripts/test.sh (it installs rotel)"))
}

/// A loopback port picked up front, so that a process can be restarted on it.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// SIGTERM, then wait: nginx's master stops its workers, rotel and llmtap flush.
fn terminate(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
}

async fn wait_until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "timed out after {secs} s waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// === the receiver behind the collector ===

#[derive(Clone)]
struct Got {
    run: String,
    instance: String,
    span: Span,
}

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Got>>>);

impl Receiver {
    /// One run's spans, one per span id (delivery is at-least-once: a span may arrive twice).
    fn run(&self, run: &str) -> Vec<Got> {
        let mut seen = HashSet::new();
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|g| g.run == run && seen.insert(g.span.span_id.clone()))
            .cloned()
            .collect()
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for rs in request.into_inner().resource_spans {
            let attrs: Vec<(String, String)> = rs
                .resource
                .map(|r| r.attributes.into_iter().map(|kv| (kv.key, str_of(&kv.value))).collect())
                .unwrap_or_default();
            let get = |k: &str| {
                attrs
                    .iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default()
            };
            let (run, instance) = (get(RUN_ATTR), get("service.instance.id"));
            let mut all = self.0.lock().unwrap();
            for span in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                all.push(Got {
                    run: run.clone(),
                    instance: instance.clone(),
                    span,
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn serve_receiver(r: Receiver) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = TraceServiceServer::new(r).accept_compressed(tonic::codec::CompressionEncoding::Gzip);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(llmtap::api::incoming(listener))
            .await
            .unwrap();
    });
    addr
}

fn str_of(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AV::StringValue(s)) => s.clone(),
        Some(AV::IntValue(i)) => i.to_string(),
        Some(AV::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes.iter().find(|kv| kv.key == key).map(|kv| str_of(&kv.value))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// === the collector tier: rotel ===

struct Collector {
    child: Option<Child>,
    grpc_port: u16,
    http_port: u16,
    receiver: SocketAddr,
    dir: PathBuf,
}

impl Collector {
    async fn start(receiver: SocketAddr, dir: &Path) -> Collector {
        let mut c = Collector {
            child: None,
            grpc_port: free_port(),
            http_port: free_port(),
            receiver,
            dir: dir.to_owned(),
        };
        c.restart().await;
        c
    }

    /// Start rotel on the collector's ports. The ports are fixed (the replicas export to them), and while rotel
    /// was stopped another process's outgoing connection may have taken one as its ephemeral port: rotel then
    /// exits at once ("Address already in use"), and is started again until that connection is gone.
    async fn restart(&mut self) {
        let addr: SocketAddr = format!("127.0.0.1:{}", self.grpc_port).parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.spawn();
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(20) {
                if std::net::TcpStream::connect(addr).is_ok() {
                    return;
                }
                if self
                    .child
                    .as_mut()
                    .is_some_and(|c| c.try_wait().ok().flatten().is_some())
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for rotel to listen on {addr}"
            );
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn spawn(&mut self) {
        let child = Command::new(rotel_bin())
            .arg("start")
            .arg("--otlp-grpc-endpoint")
            .arg(format!("127.0.0.1:{}", self.grpc_port))
            .arg("--otlp-http-endpoint")
            .arg(format!("127.0.0.1:{}", self.http_port))
            .args(["--exporter", "otlp", "--otlp-exporter-endpoint"])
            .arg(format!("http://{}", self.receiver))
            // The default /tmp/rotel-agent.pid is shared by everyone on the machine.
            .arg("--pid-file")
            .arg(self.dir.join("rotel.pid"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// SIGTERM: rotel flushes its batches to the receiver before it exits, so afterwards the receiver holds
    /// everything the collector acknowledged.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c);
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop();
    }
}

// === llmtap on a fixed port ===

struct Replica {
    child: Option<Child>,
    port: u16,
    name: String,
    run: String,
    data_dir: PathBuf,
    config_path: PathBuf,
}

/// config/collector.toml as shipped, pointed at the test's collector and upstream. Its `listen` is replaced by
/// `--listen`; the faster retries and no metrics keep the test short and the receiver to traces.
fn replica_config(up: &Upstream, collector: &Collector) -> String {
    // Only the top-level `listen` goes: `[api] listen = "off"` stays.
    let (top, tables) = REPLICA_CONFIG.split_at(REPLICA_CONFIG.find("\n[").unwrap());
    let top: Vec<&str> = top.lines().filter(|l| !l.starts_with("listen =")).collect();
    let shipped = format!("{}{tables}", top.join("\n"));
    let endpoint = format!("http://127.0.0.1:{}", collector.grpc_port);
    let config = shipped.replace("http://otel-collector:4317", &endpoint);
    assert!(
        config.contains(&endpoint) && config.contains("[api]"),
        "config/collector.toml changed"
    );
    upstream_config(
        up,
        &format!("{config}\nmetrics = false\nretry_initial_ms = 100\nretry_max_ms = 500\ntimeout_secs = 2\n"),
    )
}

impl Replica {
    fn start(config: &str, dir: &Path, name: &str, run: &str) -> Replica {
        let data_dir = dir.join(format!("{run}-{name}"));
        std::fs::create_dir_all(&data_dir).unwrap();
        let config_path = data_dir.join("llmtap.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut r = Replica {
            child: None,
            port: free_port(),
            name: name.to_owned(),
            run: run.to_owned(),
            data_dir,
            config_path,
        };
        r.restart();
        r
    }

    /// Start (again) on the same port and data dir.
    fn restart(&mut self) {
        let mut child = llmtap_command()
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--config")
            .arg(&self.config_path)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .env("RUST_LOG", "warn")
            .env(
                "OTEL_RESOURCE_ATTRIBUTES",
                format!("service.instance.id={},{RUN_ATTR}={}", self.name, self.run),
            )
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // The first stdout line says it listens; the rest is drained so that llmtap never writes into a closed pipe.
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        let line = lines.next().and_then(Result::ok).unwrap_or_default();
        std::thread::spawn(move || lines.for_each(drop));
        assert!(
            line.contains(&format!(":{}", self.port)),
            "llmtap did not start: {line}"
        );
        self.child = Some(child);
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM: closes the open trajectories (invoke_agent spans) and flushes the exporter.
    fn terminate(&mut self) {
        let mut c = self.child.take().unwrap();
        terminate(&mut c);
    }

    fn metric(&self, name: &str) -> Option<u64> {
        let out = llmtap_command()
            .args(["status", "--addr", &self.addr()])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
    }

    /// Exchanges this replica has processed (its records handed to the store writer).
    fn processed(&self) -> u64 {
        self.metric("llmtap_processed_total").unwrap_or(0)
    }

    /// The store's provider traces, read by the CLI (works while llmtap runs and after it stopped).
    fn traces(&self) -> Vec<Value> {
        let out = llmtap_command()
            .args(["export", "--format", "provider-traces", "--data-dir"])
            .arg(&self.data_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The replicas' listen addresses, for nginx's upstream block.
fn addrs(replicas: &[&Replica]) -> Vec<SocketAddr> {
    replicas.iter().map(|r| r.addr().parse().unwrap()).collect()
}

// === traffic ===

/// Replay `sessions` (session header value, recorded session) one call after another, through `base`;
/// every call must get its recorded status. Returns when the last response was read.
async fn replay(base: &str, sessions: &[(String, String)]) -> usize {
    let client = client();
    let mut n = 0;
    for (key, name) in sessions {
        for f in session(name) {
            let headers = [
                ("content-type", "application/json"),
                ("x-replay-fixture", f.name.as_str()),
                ("x-llmtap-session", key.as_str()),
            ];
            let reply = send(
                &client,
                &f.method,
                &format!("{base}{}", f.client_path),
                &headers,
                f.request.clone(),
            )
            .await;
            assert_eq!(reply.status, f.status, "{} via {base}", f.name);
            n += 1;
        }
    }
    n
}

/// Every recorded session, tagged with its own session header (the same values on every run).
fn all_sessions() -> Vec<(String, String)> {
    session_names().into_iter().map(|n| (format!("s-{n}"), n)).collect()
}

// === comparing runs ===

/// The facts of one span that must agree across deployments.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Facts {
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    conversation: Option<String>,
    step_index: Option<String>,
    call_type: Option<String>,
    /// `no_result` on a tool span: the call's result never reached this replica.
    error: Option<String>,
}

/// provider trace id → the recording it replayed, for the LLM calls (a chat span each) in the stores of a run.
fn recording_of(stores: &[&Replica]) -> HashMap<String, String> {
    stores
        .iter()
        .flat_map(|r| r.traces())
        .filter(|t| t["api"] != "other")
        .map(|t| {
            let id = t["id"].as_str().unwrap().to_owned();
            (
                id,
                t["headers"]["request"]["x-replay-fixture"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A run's spans by a key that is the same in every run. A chat span's id derives from its capture's id (a
/// UUIDv7, new on every capture, on one node as on many), so chat spans are keyed by the recording they
/// replay and their span id is left out; every other span id is derived from what it stands for.
fn facts(spans: &[Got], recordings: &HashMap<String, String>) -> BTreeMap<String, Facts> {
    spans
        .iter()
        .map(|g| {
            let s = &g.span;
            let op = attr(s, "gen_ai.operation.name").unwrap_or_default();
            let chat = op == "chat";
            let key = if chat {
                let trace = attr(s, "llmtap.provider_trace_id").unwrap();
                format!("chat {}", recordings[&trace])
            } else {
                format!("{op} {}", hex(&s.span_id))
            };
            let f = Facts {
                trace_id: hex(&s.trace_id),
                span_id: if chat { String::new() } else { hex(&s.span_id) },
                parent: hex(&s.parent_span_id),
                name: s.name.clone(),
                conversation: attr(s, "gen_ai.conversation.id"),
                step_index: attr(s, "llmtap.step_index"),
                call_type: attr(s, "llmtap.call_type"),
                error: attr(s, "error.type"),
            };
            (key, f)
        })
        .collect()
}

/// Human-readable differences between two runs' facts.
fn differences(want: &BTreeMap<String, Facts>, got: &BTreeMap<String, Facts>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, w) in want {
        match got.get(k) {
            None => out.push(format!("missing: {k} {w:?}")),
            Some(g) if g != w => out.push(format!("differs: {k}\n  want {w:?}\n  got  {g:?}")),
            Some(_) => {}
        }
    }
    out.extend(
        got.keys()
            .filter(|k| !want.contains_key(*k))
            .map(|k| format!("extra: {k}")),
    );
    out
}

fn count(facts: &BTreeMap<String, Facts>, op: &str) -> usize {
    facts.keys().filter(|k| k.starts_with(&format!("{op} "))).count()
}

/// invoke_agent spans with a parent: sub-agents linked under their parent's execute_tool span.
fn subagent_links(facts: &BTreeMap<String, Facts>) -> usize {
    facts
        .iter()
        .filter(|(k, f)| k.starts_with("invoke_agent ") && !f.parent.is_empty())
        .count()
}

/// Chat span ids the receiver should get for what `r` stored.
fn stored_chat_ids(r: &Replica) -> HashSet<Vec<u8>> {
    r.traces()
        .iter()
        .filter(|t| t["api"] != "other")
        .map(|t| llmtap::export::otlp::spans::chat_span_id(t["id"].as_str().unwrap()))
        .collect()
}

/// How many of `want` arrived from the replica `instance` (its `service.instance.id`).
fn arrived(receiver: &Receiver, run: &str, instance: &str, want: &HashSet<Vec<u8>>) -> usize {
    let got: HashSet<Vec<u8>> = receiver
        .run(run)
        .into_iter()
        .filter(|g| g.instance == instance)
        .map(|g| g.span.span_id)
        .collect();
    want.intersection(&got).count()
}

// === the test ===

struct World {
    /// Kept alive for the replicas.
    _up: Upstream,
    receiver: Receiver,
    collector: Collector,
    config: String,
    dir: tempfile::TempDir,
}

/// Until `calls` exchanges are processed across `replicas` and committed: an exchange is counted in
/// `llmtap_processed_total` once its records are with the store writer, and `llmtap_store_pending_records` counts
/// the records the writer has not committed yet (capture is asynchronous; a `kill -9` loses what is not
/// committed).
async fn wait_committed(replicas: &[&Replica], calls: usize) {
    wait_until("every call committed", 20, || {
        // Processed is read before pending, each from its own `llmtap status`: records are pending before their
        // exchange counts as processed, so "processed >= calls, then nothing pending" means those records are
        // committed. Read the other way round, an exchange emitted between the two reads passes as committed
        // while its records still wait for the writer (a kill -9 then loses them).
        let processed: u64 = replicas.iter().map(|r| r.processed()).sum();
        processed >= calls as u64
            && replicas
                .iter()
                .all(|r| r.metric("llmtap_store_pending_records") == Some(0))
    })
    .await;
}

/// One deployment: `n` replicas (no nginx for the baseline), the sessions replayed, every llmtap stopped with
/// SIGTERM. Returns provider trace id → recording.
async fn run_deployment(w: &World, run: &str, balance: Option<Balance>) -> HashMap<String, String> {
    let started = Instant::now();
    let n = if balance.is_some() { 2 } else { 1 };
    let mut replicas: Vec<Replica> = (0..n)
        .map(|i| Replica::start(&w.config, w.dir.path(), &format!("llmtap-{i}"), run))
        .collect();
    let calls = {
        let refs: Vec<&Replica> = replicas.iter().collect();
        let nginx = match balance {
            Some(b) => Some(Nginx::start(&addrs(&refs), b, w.dir.path()).await),
            None => None,
        };
        let base = nginx.as_ref().map_or(format!("http://{}", refs[0].addr()), Nginx::url);
        replay(&base, &all_sessions()).await
    };
    wait_committed(&replicas.iter().collect::<Vec<_>>(), calls).await;
    for r in &mut replicas {
        r.terminate();
    }
    let refs: Vec<&Replica> = replicas.iter().collect();
    let per_replica: Vec<usize> = refs.iter().map(|r| r.traces().len()).collect();
    println!(
        "{run}: {calls} calls, stored per replica {per_replica:?}, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        per_replica.iter().sum::<usize>(),
        calls,
        "{run}: every call stored once"
    );
    recording_of(&refs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_behind_nginx_agree_with_one_node() {
    let started = Instant::now();
    let (nginx, rotel) = (nginx_bin(), rotel_bin());
    println!("nginx {}, collector {}", nginx.display(), rotel.display());
    let up = Upstream::start(ReplayOptions::default()).await;
    let receiver = Receiver::default();
    let receiver_addr = serve_receiver(receiver.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let collector = Collector::start(receiver_addr, dir.path()).await;
    let config = replica_config(&up, &collector);
    let mut w = World {
        _up: up,
        receiver,
        collector,
        config,
        dir,
    };

    let base_rec = run_deployment(&w, "baseline", None).await;
    let aff_rec = run_deployment(&w, "affinity", Some(Balance::Affinity)).await;
    let rr_rec = run_deployment(&w, "round-robin", Some(Balance::RoundRobin)).await;
    // Every llmtap drained its exports into the collector before exiting; stopping the collector flushes them
    // on to the receiver, so what the receiver holds now is complete.
    w.collector.stop();

    let base = facts(&w.receiver.run("baseline"), &base_rec);
    let chats = count(&base, "chat");
    let missing: Vec<&String> = base_rec
        .values()
        .filter(|r| !base.contains_key(&format!("chat {r}")))
        .collect();
    assert_eq!(
        chats,
        base_rec.len(),
        "one chat span per stored call; none for {missing:?}"
    );
    println!(
        "baseline: {} spans ({chats} chat, {} execute_tool, {} invoke_agent, {} sub-agent links)",
        base.len(),
        count(&base, "execute_tool"),
        count(&base, "invoke_agent"),
        subagent_links(&base)
    );

    // (a) Affinity: every span equals the single node's.
    let aff = facts(&w.receiver.run("affinity"), &aff_rec);
    let diff = differences(&base, &aff);
    assert!(diff.is_empty(), "affinity differs from one node:\n{}", diff.join("\n"));
    println!("affinity: {} spans, all equal to the baseline", aff.len());

    // (b) Round-robin: the per-exchange facts still agree, the cross-call ones go missing.
    let rr = facts(&w.receiver.run("round-robin"), &rr_rec);
    round_robin_findings(&base, &rr);

    // (c) A replica killed with SIGKILL mid-run loses nothing it stored.
    failover(&mut w).await;
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}

/// Round-robin against the baseline: per-exchange facts must agree, and the cross-call facts the design names
/// must be missing. Prints what it finds.
fn round_robin_findings(base: &BTreeMap<String, Facts>, rr: &BTreeMap<String, Facts>) {
    // A failed first call is adopted into its retry's trajectory (architecture.md, Retries): the only trajectory
    // fact that needs the previous call. Chat spans of those trajectories are allowed to differ, no others.
    let retried: HashSet<&Option<String>> = base
        .iter()
        .filter(|(k, b)| k.starts_with("chat ") && b.error.is_some())
        .map(|(_, b)| &b.conversation)
        .collect();
    // Inside a native session the root key leaves the system prompt out (a resumed conversation keeps its id), so
    // a handoff target, which starts with its parent's history, is told apart from its parent only by the
    // parent's open call: its trajectory id needs the replica that saw the parent (architecture.md, Sessions).
    let handed_off: HashSet<&Option<String>> = base
        .iter()
        .filter(|(k, b)| k.starts_with("chat ") && b.call_type.as_deref() == Some("subagent"))
        .map(|(_, b)| &b.conversation)
        .collect();
    let (mut same, mut moved_by_retry, mut moved_by_handoff) = (0, 0, 0);
    for (k, b) in base.iter().filter(|(k, _)| k.starts_with("chat ")) {
        let r = rr.get(k).unwrap_or_else(|| panic!("round-robin lost {k}"));
        if (&r.conversation, &r.step_index) == (&b.conversation, &b.step_index) {
            same += 1;
            continue;
        }
        if handed_off.contains(&b.conversation) && r.step_index == b.step_index {
            moved_by_handoff += 1;
            continue;
        }
        assert!(
            retried.contains(&b.conversation) && r.step_index == b.step_index,
            "{k}: trajectory and step index are per-exchange facts\n  baseline {b:?}\n  round-robin {r:?}"
        );
        moved_by_retry += 1;
    }
    println!(
        "round-robin: {moved_by_handoff} chat spans of handoff targets in a native session moved to their parent's id"
    );
    let answered = |f: &BTreeMap<String, Facts>| {
        f.iter()
            .filter(|(k, t)| k.starts_with("execute_tool ") && t.error.is_none())
            .count()
    };
    let (bt, rt) = (answered(base), answered(rr));
    let (bl, rl) = (subagent_links(base), subagent_links(rr));
    let other_parent = base
        .iter()
        .filter(|(k, b)| {
            rr.get(*k)
                .is_some_and(|r| r.trace_id != b.trace_id || r.parent != b.parent)
        })
        .count();
    println!(
        "round-robin: {same} of {} chat spans keep trajectory id and step index ({moved_by_retry} in a retried \
         trajectory do not); tool calls with their result (and a duration) {rt} vs {bt}, the others end as \
         no_result; sub-agent links {rl} vs {bl}; spans in another trace or under another parent: {other_parent}",
        count(base, "chat")
    );
    assert!(same > 0 && moved_by_retry <= retried.len() * 2);
    assert!(
        rt < bt,
        "a tool result that reaches the other replica is not joined to its call"
    );
    // A sub-agent link needs the parent's open call on the same replica; whether round-robin happens to keep the
    // two on one replica depends on the order of the calls, so it may lose links, never invent them.
    assert!(rl <= bl, "round-robin invented sub-agent links: {rl} vs {bl}");
}

/// (c): collector down (so that what the replicas store waits in their stores), half the sessions through
/// nginx, SIGKILL one replica, the rest of the sessions (nginx moves the dead replica's session to the other),
/// collector back: the survivor's spans arrive, the dead replica's do not until it restarts on its port and data.
async fn failover(w: &mut World) {
    let run = "failover";
    let mut replicas: Vec<Replica> = (0..2)
        .map(|i| Replica::start(&w.config, w.dir.path(), &format!("llmtap-{i}"), run))
        .collect();
    let refs: Vec<&Replica> = replicas.iter().collect();
    let nginx = Nginx::start(&addrs(&refs), Balance::Affinity, w.dir.path()).await;
    let sessions: Vec<(String, String)> = session_names().into_iter().map(|n| (format!("f-{n}"), n)).collect();
    let (first, rest) = sessions.split_at(sessions.len() / 2 + 1);
    let sent1 = replay(&nginx.url(), first).await;
    wait_committed(&replicas.iter().collect::<Vec<_>>(), sent1).await;
    let stored: Vec<Vec<Value>> = replicas.iter().map(Replica::traces).collect();
    let v = if stored[0].len() >= stored[1].len() { 0 } else { 1 };
    let victim_session = stored[v][0]["metadata"]["session"].as_str().unwrap().to_owned();
    let victim_processed = replicas[v].processed() as usize;
    let victim_ids = stored_chat_ids(&replicas[v]);
    let victim_name = replicas[v].name.clone();
    replicas[v].kill9();

    // One of the victim's sessions goes on after the kill (a next conversation), so nginx must fail it over.
    let mut rest = rest.to_vec();
    rest[0].0 = victim_session.clone();
    let sent2 = replay(&nginx.url(), &rest).await;
    let (victim_addr, survivor_addr) = (replicas[v].addr(), replicas[1 - v].addr());
    let retried = nginx
        .access_log()
        .iter()
        .filter(|(s, ups, status)| {
            *s == victim_session && *ups == format!("{victim_addr}, {survivor_addr}") && status == "200"
        })
        .count();
    assert!(
        retried >= 1,
        "nginx tried the killed replica, then the other: {:?}",
        nginx.access_log()
    );
    let survivor = &replicas[1 - v];
    // Everything after the kill went to the survivor.
    wait_committed(&[survivor], sent1 + sent2 - victim_processed).await;
    let survivor_ids = stored_chat_ids(survivor);
    let total: usize = stored_chat_ids(&replicas[v]).len() + survivor_ids.len();
    assert_eq!(
        total,
        sent1 + sent2 - non_llm_calls(&sessions),
        "every call stored by one replica"
    );

    // Collector back: the survivor exports its backlog; the killed replica's stays in its store.
    w.collector.restart().await;
    wait_until("the survivor's spans", 30, || {
        arrived(&w.receiver, run, &survivor.name, &survivor_ids) == survivor_ids.len()
    })
    .await;
    let before = arrived(&w.receiver, run, &victim_name, &victim_ids);
    assert_eq!(before, 0, "nothing of the killed replica can arrive while it is down");
    replicas[v].restart();
    wait_until("the restarted replica's spans", 30, || {
        arrived(&w.receiver, run, &victim_name, &victim_ids) == victim_ids.len()
    })
    .await;
    println!(
        "failover: {sent1} + {sent2} calls, all answered; {retried} request(s) nginx moved from the killed replica; \
         survivor exported {} chat spans; killed replica had {} stored: {before} arrived while it was down, {} after \
         its restart",
        survivor_ids.len(),
        victim_ids.len(),
        arrived(&w.receiver, run, &victim_name, &victim_ids)
    );
    for r in &mut replicas {
        if r.child.is_some() {
            r.terminate();
        }
    }
}

/// Recorded calls that are not LLM calls (no chat span).
fn non_llm_calls(sessions: &[(String, String)]) -> usize {
    sessions
        .iter()
        .flat_map(|(_, n)| session(n))
        .filter(|f| f.api() == llmtap::capture::Api::Other)
        .count()
}
