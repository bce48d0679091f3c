//! What capture keeps, and how fast it keeps it:
//! - `bytes`: bytes the store holds per call for one 100-call agent session (the conversation grows by one
//!   message per call) against the session's unique content, through the real pipeline and store writer
//!   (in-process), next to what whole-body storage (each request zstd-compressed on its own) would hold.
//! - `lossless`: the lossless capture rate: the highest steady request rate at which llmtap (capture + SQLite
//!   store + OTLP export on, as separate processes) drops no exchange, for the ~2 KB chat completion and for a
//!   ~30 KB agent request (a 20-turn conversation); rates step up until exchanges are dropped or the proxy
//!   cannot carry the rate any more.
//! - `store-rate`: the capacity of capture's background half alone: the pipeline thread and the store writer
//!   (in-process, no proxy, no export), fed exchanges as fast as they take them, with the CPU each thread
//!   spent per exchange. What `lossless` can reach is bounded by this, less what the proxy's own work takes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use llmtap::capture::{Api, Captured, ExchangeMeta, Outcome, RawExchange, Timings};
use llmtap::telemetry::Metrics;

use super::derive::InProcess;
use super::stats::fmt_rate;

/// Deterministic text of `words` words, different for each `seed` (an LCG over a small vocabulary: realistic
/// to compress, unlike a repeated sentence).
pub fn prose(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 24] = [
        "the", "parser", "token", "returns", "error", "when", "input", "ends", "after", "a", "quoted", "string", "fix",
        "test", "function", "value", "offset", "line", "we", "should", "check", "bounds", "before", "index",
    ];
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if i > 0 {
            out.push(' ');
        }
        out.push_str(VOCAB[(x >> 33) as usize % VOCAB.len()]);
        if (x >> 20).is_multiple_of(11) {
            out.push_str(&format!(" {}", (x >> 40) % 1000));
        }
    }
    out
}

/// Message `i` of agent session `session`: alternately an assistant tool call (~0.3 KB) and its result (~1.7 KB).
fn message(session: usize, i: usize) -> serde_json::Value {
    if i.is_multiple_of(2) {
        json!({"role": "assistant", "content": prose((session * 1000 + i) as u64, 20),
            "tool_calls": [{"id": format!("call_{session}_{i}"), "type": "function",
                "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/module_{i}.rs\"}}")}}]})
    } else {
        json!({"role": "tool", "tool_call_id": format!("call_{session}_{}", i - 1),
            "content": prose((session * 1000 + i) as u64, 280)})
    }
}

/// The request of agent session `session` carrying `messages` conversation messages after the system prompt
/// (~5.5 KB) and the user's task, with three tool definitions (~1.5 KB). 20 messages: ~30 KB.
pub fn agent_request(session: usize, messages: usize) -> String {
    let mut all = vec![
        json!({"role": "system", "content": prose(7, 900)}),
        json!({"role": "user", "content": format!("Session {session}: {}", prose(session as u64, 40))}),
    ];
    all.extend((0..messages).map(|i| message(session, i)));
    let tool = |name: &str, seed: u64| {
        json!({"type": "function", "function": {"name": name, "description": prose(seed, 60),
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": prose(seed + 1, 20)}}}}})
    };
    json!({"model": "gpt-4o", "messages": all,
        "tools": [tool("read_file", 11), tool("edit_file", 12), tool("run_tests", 13)]})
    .to_string()
}

fn agent_response(session: usize, call: usize) -> String {
    json!({"id": format!("chatcmpl-{session}-{call}"), "object": "chat.completion", "created": 1, "model": "gpt-4o-2024-08-06",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": prose(call as u64 + 99, 20),
            "tool_calls": [{"id": format!("call_{session}_{call}"), "type": "function",
                "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/module_{call}.rs\"}}")}}]}}],
        "usage": {"prompt_tokens": 1000 + 300 * call, "completion_tokens": 40}})
    .to_string()
}

/// A captured OpenAI chat exchange with JSON bodies, 0.3 s to first byte and 0.4 s in all: what every in-process
/// mode of the bench feeds the pipeline.
pub(super) fn chat_exchange(
    id: u128,
    status: u16,
    request: impl Into<Bytes>,
    response: impl Into<Bytes>,
    t: i64,
) -> RawExchange {
    let captured = |body: Bytes| Captured {
        headers: [("content-type", "application/json")].into_iter().collect(),
        len: body.len() as u64,
        body: [body].into(),
        ended: true,
        ..Default::default()
    };
    RawExchange {
        id: uuid::Uuid::from_u128(id),
        upstream: Arc::from("openai"),
        api: Api::OpenAiChat,
        method: http::Method::POST,
        path: "/v1/chat/completions".into(),
        status: Some(status),
        request: captured(request.into()),
        response: Some(captured(response.into())),
        timings: Timings {
            start: t,
            first_byte: Some(t + 300_000),
            end: t + 400_000,
        },
        outcome: Outcome::Complete,
        error: None,
        meta: ExchangeMeta::default(),
        charge: Default::default(),
    }
}

/// Bytes stored per call for one `calls`-call session through the real pipeline and store writer.
pub fn bytes_per_call(calls: usize) {
    let dir = std::env::temp_dir().join(format!("llmtap-bench-bytes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let metrics = Arc::new(Metrics::default());
    let Some(stack) = InProcess::start(&dir, &metrics) else {
        return;
    };
    let t0 = llmtap::capture::now_micros();
    let (mut sent, mut whole) = (0usize, 0usize);
    let mut unique = 0usize;
    for call in 0..calls {
        // Call `call` carries every message so far: the conversation grows by one message per call.
        let request = agent_request(1, call);
        let response = agent_response(1, call);
        sent += request.len() + response.len();
        whole += llmtap::store::codec::compress(&request).len() + llmtap::store::codec::compress(&response).len();
        unique += response.len();
        if call + 1 == calls {
            unique += request.len();
        }
        stack.tx.try_send(chat_exchange(
            call as u128,
            200,
            request,
            response,
            t0 + call as i64 * 1_000_000,
        ));
        // One at a time, as an agent calls: each call's records reach the store before the next.
        let deadline = Instant::now() + Duration::from_secs(5);
        while metrics.processed.get() < call as u64 + 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    stack.finish();
    let Ok(db) = llmtap::store::open(&dir) else { return };
    let _ = db.pragma_update(None, "wal_checkpoint", "TRUNCATE");
    let _ = db.execute_batch("VACUUM");
    let pages = |p: &str| db.pragma_query_value(None, p, |r| r.get::<_, i64>(0)).unwrap_or(0);
    let file = (pages("page_count") * pages("page_size")) as usize;
    let sum = |sql: &str| db.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap_or(0) as usize;
    let bodies = sum("SELECT COALESCE(SUM(LENGTH(request)) + SUM(LENGTH(response)), 0) FROM trace_bodies")
        + sum("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM chunks");
    let chunks = sum("SELECT COUNT(*) FROM chunks");
    let n = calls.max(1);
    println!(
        "store, one {calls}-call agent session growing by one message per call (last request {} KB), bytes per call:",
        agent_request(1, calls.saturating_sub(1)).len() / 1024
    );
    println!("  sent by the client (request + response)   {:>8}", sent / n);
    println!(
        "  unique content (every distinct message once + responses) {:>8}",
        unique / n
    );
    println!(
        "  stored: whole SQLite file {:>8} ({:.2}x unique content); bodies {} ({chunks} chunks); \
         whole-body zstd would be {:>8} ({:.1}x)",
        file / n,
        file as f64 / unique.max(1) as f64,
        bodies / n,
        whole / n,
        whole as f64 / unique.max(1) as f64
    );
    if std::env::var_os("LLMTAP_BENCH_KEEP").is_some() {
        println!("  kept {}", dir.display());
        return;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `LLMTAP_BENCH_RATES=8000,10000`: the rates `lossless` steps through instead of its default ladder.
fn rates_from_env() -> Option<Vec<u64>> {
    let rates: Vec<u64> = std::env::var("LLMTAP_BENCH_RATES")
        .ok()?
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();
    (!rates.is_empty()).then_some(rates)
}

/// `LLMTAP_BENCH_TIMELINE=1`: one line per sample while a `lossless` step runs, to see when a backlog forms.
fn print_timeline_row(stack: &super::proxy::CaptureStack, t0: Instant, spill: u64) {
    let text = stack.metrics();
    let get = |name: &str| super::proxy::metric_in(&text, name);
    println!(
        "    t={:5.2}s captured {:>7} processed {:>7} stored {:>8} queue {:>6.1} MB spill {:>6.1} MB checkpoints {}",
        t0.elapsed().as_secs_f64(),
        get("llmtap_captured_total "),
        get("llmtap_processed_total "),
        get("llmtap_stored_total "),
        get("llmtap_capture_queue_bytes ") as f64 / 1e6,
        spill as f64 / 1e6,
        get("llmtap_store_checkpoints_total "),
    );
}

/// The lossless capture rate for each workload: rates step up until exchanges are dropped or the achieved rate
/// falls short of the target (the proxy's own limit here).
pub fn lossless(smoke: bool) {
    let Ok(rt) = super::servers::runtime() else {
        return;
    };
    let (secs, rates): (f64, Vec<u64>) = if smoke {
        (1.0, vec![100, 200])
    } else {
        let default = vec![
            1_000, 2_000, 3_000, 4_000, 5_000, 6_000, 8_000, 10_000, 12_000, 15_000, 20_000,
        ];
        (5.0, rates_from_env().unwrap_or(default))
    };
    let timeline = std::env::var_os("LLMTAP_BENCH_TIMELINE").is_some();
    for (label, bodies) in [
        ("~2 KB chat completion", vec![super::servers::chat_request_body()]),
        (
            "~30 KB agent request (20-turn conversation, 100 sessions)",
            (0..100).map(|s| Bytes::from(agent_request(s, 20))).collect(),
        ),
    ] {
        let Some(stack) = super::proxy::CaptureStack::start("lossless") else {
            return;
        };
        println!(
            "lossless capture rate, {label} ({} B request), capture + store + OTLP on, {secs} s per rate:",
            bodies[0].len()
        );
        println!(
            "  (CPU by thread, from the step's start until its backlog is drained: llmtap-proxy is the proxy's \
             workers, tokio-rt-worker (background) the exporter's store reads)"
        );
        let mut best = None;
        // The highest rate the pipeline took without the spill: the steady processing rate (the spill absorbs
        // a burst above it, it does not raise it).
        let mut best_unspilled = None;
        let mut seen_dropped = 0;
        let mut seen_spilled = 0;
        let mut seen_deferred = 0;
        for &rate in &rates {
            let n = (rate as f64 * secs) as usize;
            let cpu_before = ThreadCpu::of(&stack.pid().to_string());
            let t0 = Instant::now();
            // The spill backlog's peak during the step (sampled every 50 ms while the load runs).
            let running = std::sync::atomic::AtomicBool::new(true);
            let (ok, peak_spill) = std::thread::scope(|scope| {
                let sampler = scope.spawn(|| {
                    let mut peak = 0;
                    while running.load(std::sync::atomic::Ordering::Relaxed) {
                        let spill = stack.metric("llmtap_capture_spill_bytes ");
                        peak = peak.max(spill);
                        if timeline {
                            print_timeline_row(&stack, t0, spill);
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    peak
                });
                let ok = rt.block_on(super::proxy::open_loop(&stack.url, &bodies, n, rate));
                running.store(false, std::sync::atomic::Ordering::Relaxed);
                (ok, sampler.join().unwrap_or(0))
            });
            let elapsed = t0.elapsed().as_secs_f64();
            let achieved = ok as f64 / elapsed;
            // Carried: every request answered, and the last one within a quarter second of the schedule's end
            // (an open-loop generator against a saturated proxy finishes late, with requests queued).
            let carried = ok == n && elapsed <= secs * 1.05 + 0.25;
            // Let the pipeline catch up: what is still queued may yet be dropped by trajectory, and what is
            // spilled must be processed before the next step measures a steady rate again.
            let drain = Instant::now();
            let deadline = drain + Duration::from_secs(300);
            let mut peak_spill = peak_spill;
            loop {
                let spill = stack.metric("llmtap_capture_spill_bytes ");
                peak_spill = peak_spill.max(spill);
                if (stack.metric("llmtap_capture_queue_bytes ") == 0 && spill == 0) || Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let drained = drain.elapsed().as_secs_f64();
            let dropped_total = stack.metric("llmtap_capture_dropped_total ");
            let dropped = dropped_total - seen_dropped;
            seen_dropped = dropped_total;
            let spilled_total = stack.metric("llmtap_capture_spilled_total ");
            let spilled = spilled_total - seen_spilled;
            seen_spilled = spilled_total;
            let deferred_total = stack.metric("llmtap_pipeline_deferred_milliseconds_total ");
            let deferred_ms = deferred_total - seen_deferred;
            seen_deferred = deferred_total;
            println!(
                "  {:>7} req/s target: {:>7} req/s achieved, {ok} of {n} answered, {dropped} dropped",
                fmt_rate(rate as f64),
                fmt_rate(achieved)
            );
            println!(
                "           spill: {spilled} exchanges spilled, peak backlog {:.1} MB, drained {drained:.1} s after the load; \
                 the pipeline waited for the data path {deferred_ms} ms",
                peak_spill as f64 / 1e6
            );
            // Until the drain: the export of the step's last batches may still be running.
            println!(
                "           llmtap CPU per exchange by thread: {}",
                ThreadCpu::of(&stack.pid().to_string()).per_exchange_since(&cpu_before, n as f64)
            );
            if dropped > 0 {
                break;
            }
            if spilled == 0 {
                best_unspilled = Some(rate);
            }
            if !carried {
                println!("  (the proxy cannot carry this rate here: capture kept up with its saturation)");
                break;
            }
            best = Some((rate, achieved));
        }
        let below = format!("below {} exchanges/s", fmt_rate(rates[0] as f64));
        let lossless = best.map_or(below.clone(), |(rate, achieved)| {
            format!(
                "{} exchanges/s offered, {} achieved",
                fmt_rate(rate as f64),
                fmt_rate(achieved)
            )
        });
        println!("  lossless capture rate ({secs} s bursts; with the spill): {lossless}");
        let steady = best_unspilled.map_or(below, |rate| format!("{} exchanges/s", fmt_rate(rate as f64)));
        println!("  steady rate (highest without spilling): {steady}");
    }
}

/// CPU time (user + system) of this process's threads named `name`, in microseconds, whatever their priority.
fn thread_cpu_us(name: &str) -> u64 {
    let cpu = ThreadCpu::of("self");
    cpu.get(name) + cpu.get(&format!("{name} (background)"))
}

/// The fields of a `/proc/<pid>/stat` (or task `stat`) line after the command name, which may itself hold
/// spaces and parentheses: the 1st is the state, the 2nd the parent's pid.
pub fn stat_fields(stat: &str) -> impl Iterator<Item = &str> {
    stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace()
}

/// CPU time (user + system, µs) of a process's threads by role: the thread's name, with ` (background)` added
/// for a thread at `SCHED_IDLE`. llmtap's tokio threads share one name; its proxy workers run at normal
/// priority and its blocking-pool threads (the exporter's store reads) at `SCHED_IDLE`, so the suffix tells
/// them apart.
#[derive(Clone, Default)]
pub struct ThreadCpu(std::collections::BTreeMap<String, u64>);

impl ThreadCpu {
    /// Adds `other`'s CPU, role by role (several readings summed).
    pub fn add(&mut self, other: &ThreadCpu) {
        for (role, us) in &other.0 {
            *self.0.entry(role.clone()).or_default() += us;
        }
    }

    /// `pid`: a process id, or "self".
    pub fn of(pid: &str) -> ThreadCpu {
        const SCHED_IDLE: u64 = 5;
        let tick_us = 1_000_000 / 100; // USER_HZ is 100 on Linux
        let mut by_role = std::collections::BTreeMap::new();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return ThreadCpu(by_role);
        };
        for task in tasks.flatten() {
            let (Ok(comm), Ok(stat)) = (
                std::fs::read_to_string(task.path().join("comm")),
                std::fs::read_to_string(task.path().join("stat")),
            ) else {
                continue;
            };
            // utime and stime are the 12th and 13th fields after the command name, the scheduling policy the 39th.
            let fields: Vec<u64> = stat_fields(&stat).map(|f| f.parse().unwrap_or(0)).collect();
            let (Some(utime), Some(stime)) = (fields.get(11), fields.get(12)) else {
                continue;
            };
            let mut role = comm.trim().to_owned();
            if fields.get(38) == Some(&SCHED_IDLE) {
                role.push_str(" (background)");
            }
            *by_role.entry(role).or_default() += (utime + stime) * tick_us;
        }
        ThreadCpu(by_role)
    }

    pub fn get(&self, role: &str) -> u64 {
        self.0.get(role).copied().unwrap_or(0)
    }

    /// Every thread's CPU together, in µs.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// The CPU of every thread not at `SCHED_IDLE` (the proxy's workers and the capture spill), in µs.
    pub fn data_path(&self) -> u64 {
        self.0
            .iter()
            .filter(|(role, _)| !role.ends_with(" (background)"))
            .map(|(_, us)| us)
            .sum()
    }

    /// The CPU each role used since `before`.
    pub fn since(&self, before: &ThreadCpu) -> ThreadCpu {
        ThreadCpu(
            self.0
                .iter()
                .map(|(role, &now)| (role.clone(), now.saturating_sub(before.get(role))))
                .collect(),
        )
    }

    /// "role µs, ..." per `per` exchanges, for every role that used CPU.
    pub fn per_exchange(&self, per: f64) -> String {
        let per = per.max(1.0);
        self.0
            .iter()
            .filter(|(_, used)| **used > 0)
            .map(|(role, &used)| format!("{role} {:.1} µs", used as f64 / per))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// "role µs, ..." per `per` exchanges, for every role that used CPU since `before`.
    pub fn per_exchange_since(&self, before: &ThreadCpu, per: f64) -> String {
        self.since(before).per_exchange(per)
    }
}

/// `store-rate`: `n` exchanges through the real pipeline and store writer as fast as they take them, for the
/// lossless bench's two workloads: the same ~2 KB chat completion each time (every call its own one-call
/// trajectory) and ~30 KB agent requests of 100 sessions in turn. Prints exchanges per second until every
/// exchange is processed and stored, and the CPU the pipeline and store threads spent per exchange. With
/// `rounds` > 1 each workload runs that many times into the same store, one line per round: how the writer's
/// cost grows with what the store already holds.
pub fn store_rate(n: usize, rounds: usize) {
    let request = String::from_utf8_lossy(&super::servers::chat_request_body()).into_owned();
    let response = String::from_utf8_lossy(&super::servers::chat_completion_body()).into_owned();
    let agent: Vec<String> = (0..100).map(|s| agent_request(s, 20)).collect();
    type Make<'a> = Box<dyn Fn(usize) -> (String, String) + 'a>;
    let workloads: [(&str, Make); 2] = [
        (
            "~2 KB chat completion, the same each time",
            Box::new(|_| (request.clone(), response.clone())),
        ),
        (
            "~30 KB agent request, 100 sessions in turn",
            Box::new(|i| (agent[i % 100].clone(), agent_response(i % 100, 20))),
        ),
    ];
    for (label, make) in workloads {
        let Some(dir) = super::derive::tempfile_dir() else {
            return;
        };
        let metrics = Arc::new(Metrics::default());
        let Some(stack) = InProcess::start(&dir, &metrics) else {
            return;
        };
        for round in 0..rounds.max(1) {
            let first = round * n;
            let bodies: Vec<(String, String)> = (first..first + n).map(&make).collect();
            let (pipe0, store0) = (thread_cpu_us("llmtap-pipeline"), thread_cpu_us("llmtap-store"));
            let stored0 = metrics.stored.get();
            let t0 = Instant::now();
            for (i, (req, resp)) in (first..).zip(bodies) {
                // Stay within the capture queue's bounds: nothing may be dropped.
                while i as u64 - metrics.processed.get() >= 2_000 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                stack.tx.try_send(chat_exchange(
                    i as u128 + 1,
                    200,
                    req,
                    resp,
                    llmtap::capture::now_micros(),
                ));
            }
            // Until every exchange is processed and its records are committed (the store count stops moving).
            let mut stored = metrics.stored.get();
            loop {
                std::thread::sleep(Duration::from_millis(100));
                let now = metrics.stored.get();
                if metrics.processed.get() >= (first + n) as u64 && now == stored {
                    break;
                }
                stored = now;
            }
            let secs = (t0.elapsed() - Duration::from_millis(100)).as_secs_f64();
            let (pipe1, store1) = (thread_cpu_us("llmtap-pipeline"), thread_cpu_us("llmtap-store"));
            let per = |a: u64, b: u64| (b - a) as f64 / n as f64;
            let held = if rounds > 1 {
                format!(" [round {}: {first} exchanges stored before]", round + 1)
            } else {
                String::new()
            };
            println!(
                "store rate, {label}{held}: {n} exchanges in {secs:.2} s = {} exchanges/s ({} dropped, {:.1} \
                 records each); CPU per exchange: pipeline {:.0} µs, store {:.0} µs",
                fmt_rate(n as f64 / secs),
                metrics.capture_dropped.get(),
                (stored - stored0) as f64 / n as f64,
                per(pipe0, pipe1),
                per(store0, store1),
            );
        }
        // Closing the trajectories still open (up to the open limit) happens at shutdown: timed apart.
        let t1 = Instant::now();
        stack.finish();
        println!(
            "  closing the open trajectories at shutdown: {:.2} s",
            t1.elapsed().as_secs_f64()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
