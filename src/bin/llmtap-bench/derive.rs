//! Derivation throughput: decode + reassemble + normalize + derive on one thread, for synthetic agent sessions
//! whose requests grow to ~20 messages; and latency from `try_send` to the step committed in SQLite.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use llmtap::capture::{CaptureTx, RawExchange};
use llmtap::config::{DeriveConfig, StoreConfig};
use llmtap::derive::Deriver;
use llmtap::telemetry::Metrics;

use super::stats::{Summary, fmt_rate};

/// One OpenAI chat exchange at `turn` of session `session`: the request carries the system prompt, the user
/// task, and `turn` assistant tool calls with their results (2 messages per turn): 20 messages at turn 9.
pub fn exchange(session: usize, turn: usize, t: i64) -> RawExchange {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools to read, edit and test code. Be concise and careful."}),
        json!({"role": "user", "content": format!("Session {session}: the parser test fails with an off-by-one error in parseToken; find and fix it, then run the tests.")}),
    ];
    for k in 0..turn {
        let id = format!("call_{session}_{k}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/parser_{k}.ts\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "export function parseToken(input: string): Token {\n  let i = 0;\n  while (i <= input.length) { i++; }\n  return { kind: 'ident', text: input.slice(0, i) };\n}\n".repeat(3)}));
    }
    let request = json!({"model": "gpt-4o", "messages": messages, "tools": [
        {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite", "parameters": {"type": "object", "properties": {}}}}
    ]});
    let response = json!({"id": format!("chatcmpl-{session}-{turn}"), "object": "chat.completion", "created": 1, "model": "gpt-4o-2024-08-06",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": format!("call_{session}_{turn}"), "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/parser_{turn}.ts\"}}")}}]}}],
        "usage": {"prompt_tokens": 500 + 150 * turn, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 400}}});
    let id = ((session as u128) << 64) | turn as u128;
    super::capture::chat_exchange(id, 200, request.to_string(), response.to_string(), t)
}

pub fn run(calls: usize) {
    throughput(calls);
    latency_to_store(calls);
}

pub fn throughput(calls: usize) {
    // Growing sessions: requests carry 2, 4, ..., 20 messages (mean 11).
    measure("sessions from their first call (2..20 messages, mean 11)", calls, 0..10);
    // Steady state of longer sessions: 12..30 messages per request, mean 21.
    measure("steady state (12..30 messages, mean 21)", calls, 5..15);
    // Worst case: every 20-message call starts a new trajectory (parent search, summary with tool definitions).
    measure("every call a new 20-message root", calls, 9..10);
}

pub fn steady(calls: usize) {
    measure("steady state (12..30 messages, mean 21)", calls, 5..15);
}

/// Where a call's time goes: parsing the request JSON alone, the whole of `process` (decode, parse,
/// normalize), and derivation, each over all calls.
pub fn split(calls: usize, turns: std::ops::Range<usize>) {
    let per_session = turns.len();
    let sessions = calls.div_ceil(per_session);
    let mut t = llmtap::capture::now_micros();
    let mut exchanges = Vec::new();
    for turn in turns {
        for s in 0..sessions {
            exchanges.push(exchange(s, turn, t));
            t += 1000;
        }
    }
    let n = exchanges.len() as f64;
    let t0 = Instant::now();
    for ex in &exchanges {
        let v: serde_json::Value = serde_json::from_slice(&ex.request.body[0]).unwrap_or_default();
        std::hint::black_box(v);
    }
    let parse = t0.elapsed().as_secs_f64() / n * 1e6;
    let t0 = Instant::now();
    for ex in &exchanges {
        let v = llmtap::model::json::Json::parse_slice(&ex.request.body[0]).unwrap_or_default();
        std::hint::black_box(v);
    }
    let parse_view = t0.elapsed().as_secs_f64() / n * 1e6;
    let t0 = Instant::now();
    let processed: Vec<_> = exchanges
        .into_iter()
        .map(|ex| llmtap::pipeline::process::process(ex, usize::MAX))
        .collect();
    let process = t0.elapsed().as_secs_f64() / n * 1e6;
    let mut deriver = Deriver::new(DeriveConfig::default());
    let t0 = Instant::now();
    for p in processed {
        std::hint::black_box(deriver.observe(p.trace, p.call));
    }
    let derive = t0.elapsed().as_secs_f64() / n * 1e6;
    println!(
        "  per call: request parse alone {parse:.1} us (borrowed view {parse_view:.1} us); process (decode, parse, normalize) {process:.1} us; derive {derive:.1} us"
    );
}

fn measure(label: &str, calls: usize, turns: std::ops::Range<usize>) {
    let per_session = turns.len();
    let sessions = calls.div_ceil(per_session);
    let mut exchanges = Vec::with_capacity(sessions * per_session);
    let mut t = llmtap::capture::now_micros();
    for turn in turns {
        for s in 0..sessions {
            exchanges.push(exchange(s, turn, t));
            t += 1000;
        }
    }
    let n = exchanges.len();
    let bytes: usize = exchanges.iter().map(|e| e.request.len as usize).sum();
    let mut deriver = Deriver::new(DeriveConfig::default());
    let mut per_call = Vec::with_capacity(n);
    let start = Instant::now();
    for ex in exchanges {
        let t0 = Instant::now();
        let p = llmtap::pipeline::process::process(ex, usize::MAX);
        let _records = deriver.observe(p.trace, p.call);
        per_call.push(t0.elapsed());
    }
    let elapsed = start.elapsed();
    let s = Summary::of(&mut per_call);
    println!(
        "derive, {label}: {} calls/s on one thread ({n} calls, mean request {} B); per call p50 {} p99 {}",
        fmt_rate(n as f64 / elapsed.as_secs_f64()),
        bytes / n,
        s.p50_us(),
        s.p99_us()
    );
}

/// The pipeline and the store writer running in this process over a store in a directory, as `serve` runs them
/// without the proxy: exchanges go in through `tx`; drop it, then join both threads, to finish.
pub struct InProcess {
    pub tx: CaptureTx,
    pub pipeline: std::thread::JoinHandle<()>,
    pub store_thread: std::thread::JoinHandle<()>,
}

impl InProcess {
    /// Close the capture queue and wait until the pipeline has closed every trajectory and the writer has
    /// committed everything.
    pub fn finish(self) {
        drop(self.tx);
        let _ = self.pipeline.join();
        let _ = self.store_thread.join();
    }

    pub fn start(dir: &std::path::Path, metrics: &Arc<Metrics>) -> Option<InProcess> {
        let conn = llmtap::store::open(dir).ok()?;
        let (store_tx, store_thread) =
            llmtap::store::StoreWriter::spawn(conn, StoreConfig::default(), metrics.clone(), Default::default())
                .ok()?;
        let (tx, rx) = CaptureTx::channel(&llmtap::config::CaptureConfig::default(), metrics.clone());
        let settings = llmtap::pipeline::Settings {
            derive: DeriveConfig::default(),
            body_cap: usize::MAX,
            prices: llmtap::cost::CostTable::embedded().ok()?,
            spill_limit: None,
        };
        let pipeline = llmtap::pipeline::spawn(rx, store_tx, settings, metrics.clone(), Default::default()).ok()?;
        Some(InProcess {
            tx,
            pipeline,
            store_thread,
        })
    }
}

/// From `CaptureTx::try_send` to the step committed in SQLite, one call at a time, through the real pipeline
/// thread and store writer thread.
fn latency_to_store(calls: usize) {
    let dir = match tempfile_dir() {
        Some(d) => d,
        None => return,
    };
    let metrics = Arc::new(Metrics::default());
    let Some(stack) = InProcess::start(&dir, &metrics) else {
        return;
    };
    // Back to back (each call sent as soon as the previous one is stored: traffic that flows, so the store groups
    // commits), then a sparse caller (one call every 200 ms, like an agent waiting on its model).
    // 300 and 25 calls at the full scale (100,000 derivation calls); fewer in the smoke run.
    let series = [
        ("back to back", (calls / 333).clamp(20, 300), Duration::ZERO),
        (
            "one call every 200 ms",
            (calls / 4_000).clamp(5, 25),
            Duration::from_millis(200),
        ),
    ];
    let mut next_id = 0;
    let mut results = Vec::new();
    for (name, n, gap) in series {
        let mut lat = Vec::new();
        for _ in 0..n {
            std::thread::sleep(gap);
            let before = metrics.stored.get();
            let t0 = Instant::now();
            stack.tx.try_send(exchange(next_id, 9, llmtap::capture::now_micros()));
            next_id += 1;
            // A 20-message call in a new trajectory: trace + agent step + trajectory summary = 3 records.
            while metrics.stored.get() < before + 3 {
                if t0.elapsed() > Duration::from_secs(5) {
                    break;
                }
                std::thread::sleep(Duration::from_micros(20));
            }
            lat.push(t0.elapsed());
        }
        results.push((name, Summary::of(&mut lat)));
    }
    stack.finish();
    for (name, s) in results {
        println!(
            "  latency try_send -> step committed in SQLite (20-message call, {name}): p50 {} p99 {}",
            s.p50_us(),
            s.p99_us()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

pub fn tempfile_dir() -> Option<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("llmtap-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).ok()?;
    Some(d)
}
