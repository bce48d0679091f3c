//! The web viewer's page reads on a large store: one session of `calls` calls (default 10,000) among many small
//! sessions, written through the real store writer; then each page's read (sessions list, session page, first
//! and last page of steps, a call) timed as the viewer's data module does it.
//!
//! The big session is derived from 20-call agent conversations whose records are renumbered into one
//! trajectory (a real 10,000-call conversation would repeat a history that grows to 20,000 messages in every
//! request: no agent sends that, they compact). `LLMTAP_BENCH_VIEWER_PAD` adds that many bytes of distinct text
//! to every request body, to grow the store (e.g. 100000 for about 1 GB of bodies at 10,000 calls).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use llmtap::api::viewer::data;
use llmtap::config::{DeriveConfig, StoreConfig};
use llmtap::derive::Deriver;
use llmtap::model::record::Record;
use llmtap::store::{Query, SessionQuery, StoreReader};
use llmtap::telemetry::Metrics;

use super::derive::exchange;
use super::stats::Summary;

const BIG: &str = "tr_bench_big_session";
const ROUNDS: usize = 20;

pub fn run(calls: usize, small_sessions: usize) {
    let dir = std::env::temp_dir().join(format!("llmtap-bench-viewer-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let pad: usize = std::env::var("LLMTAP_BENCH_VIEWER_PAD")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let t0 = Instant::now();
    if let Err(e) = build(&dir, calls, small_sessions, pad) {
        eprintln!("llmtap-bench viewer: {e}");
        return;
    }
    let size = std::fs::metadata(llmtap::store::db_path(&dir)).map_or(0, |m| m.len());
    println!(
        "viewer: store with one {calls}-call session and {small_sessions} 3-call sessions: {:.1} MB on disk, built in {:.1} s",
        size as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    if let Err(e) = measure(&dir) {
        eprintln!("llmtap-bench viewer: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sessions list on a store of `sessions` one-call sessions.
pub fn run_flood(sessions: usize) {
    let dir = std::env::temp_dir().join(format!("llmtap-bench-viewer-flood-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let t0 = Instant::now();
    let start = match build_flood(&dir, sessions, StoreConfig::default()) {
        Ok(start) => start,
        Err(e) => {
            eprintln!("llmtap-bench viewer: {e}");
            return;
        }
    };
    let size = std::fs::metadata(llmtap::store::db_path(&dir)).map_or(0, |m| m.len());
    println!(
        "viewer: store with {sessions} one-call sessions: {:.1} MB on disk, built in {:.1} s",
        size as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    if let Err(e) = StoreReader::open(&dir).and_then(|r| measure_flood(&r, sessions, start)) {
        eprintln!("llmtap-bench viewer: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Session `s` starts at `start + s * FLOOD_STEP_US`.
const FLOOD_STEP_US: i64 = 1_000_000;

/// The store writer on a store in `dir`, as `llmtap serve` runs it.
fn start_writer(
    dir: &std::path::Path,
    config: StoreConfig,
) -> Result<(llmtap::store::StoreTx, std::thread::JoinHandle<()>), llmtap::store::StoreError> {
    let conn = llmtap::store::open(dir)?;
    llmtap::store::StoreWriter::spawn(conn, config, Arc::new(Metrics::default()), Default::default()).map_err(
        |source| llmtap::store::StoreError::DataDir {
            path: dir.to_owned(),
            source,
        },
    )
}

/// Writes `sessions` one-call sessions through the store writer (as `config` sets it up); returns the first
/// one's start (Unix micros).
pub fn build_flood(
    dir: &std::path::Path,
    sessions: usize,
    config: StoreConfig,
) -> Result<i64, llmtap::store::StoreError> {
    let (tx, thread) = start_writer(dir, config)?;
    let start = llmtap::capture::now_micros() - 86_400_000_000 - sessions as i64 * FLOOD_STEP_US;
    let mut deriver = Deriver::new(DeriveConfig::default());
    let mut batch = Vec::new();
    for s in 0..sessions {
        let t = start + s as i64 * FLOOD_STEP_US;
        let p = llmtap::pipeline::process::process(exchange(s, 0, t), usize::MAX);
        batch.extend(deriver.observe(p.trace, p.call));
        if s % 64 == 63 {
            tx.send(std::mem::take(&mut batch));
        }
        // Each session is one call: close them as they go, so the deriver holds a bounded number open (a
        // million open at once took 8 GB).
        if s % 10_000 == 9_999 {
            tx.send(deriver.close_all());
        }
    }
    tx.send(batch);
    tx.send(deriver.close_all());
    drop(tx);
    let _ = thread.join();
    Ok(start)
}

/// The viewer's sessions list on a store of `sessions` one-call sessions (`build_flood`), read through `reader`.
pub fn measure_flood(reader: &dyn Query, sessions: usize, start: i64) -> Result<(), llmtap::store::StoreError> {
    // The keyset cursor of the middle session: its start and key, as the previous page's last row gives them.
    let middle = reader
        .session_page(&SessionQuery {
            until_us: Some(start + (sessions / 2) as i64 * FLOOD_STEP_US),
            limit: 1,
            ..SessionQuery::default()
        })?
        .pop()
        .map(|h| (h.started_us, h.session));
    let hour = 3_600 * 1_000_000;
    let end = start + sessions as i64 * FLOOD_STEP_US;
    let queries = [
        ("first page of 50", SessionQuery::default()),
        (
            "keyset page of 50 from the middle",
            SessionQuery {
                before: middle.clone(),
                ..SessionQuery::default()
            },
        ),
        (
            "first page of 50, since the last hour",
            SessionQuery {
                since_us: Some(end - hour),
                ..SessionQuery::default()
            },
        ),
        (
            "keyset page of 50 from the middle, until then",
            SessionQuery {
                until_us: middle.as_ref().map(|m| m.0),
                before: middle.clone(),
                ..SessionQuery::default()
            },
        ),
    ];
    for (name, q) in queries {
        let q = SessionQuery { limit: 50, ..q };
        let mut times = Vec::new();
        let mut rows = 0;
        for _ in 0..5 {
            let t0 = Instant::now();
            rows = data::list_sessions(reader, &q)?["sessions"]
                .as_array()
                .map_or(0, Vec::len);
            times.push(t0.elapsed());
        }
        let s = Summary::of(&mut times);
        println!(
            "  sessions list, {name}: median {:.1} ms, best {:.1} ms, {rows} rows",
            s.pct(0.5).as_secs_f64() * 1e3,
            s.pct(0.0).as_secs_f64() * 1e3,
        );
    }
    Ok(())
}

/// The call priced as the pipeline prices it (the cost report sums real costs and cache savings).
fn priced(mut p: llmtap::pipeline::process::Processed) -> llmtap::pipeline::process::Processed {
    type Pricing = Option<(llmtap::cost::CostTable, Metrics)>;
    static PRICING: std::sync::OnceLock<Pricing> = std::sync::OnceLock::new();
    let pricing = PRICING.get_or_init(|| Some((llmtap::cost::CostTable::embedded().ok()?, Metrics::default())));
    if let Some((table, metrics)) = pricing {
        llmtap::pipeline::pricing::price(table, &mut p.trace, p.call.as_ref(), metrics);
    }
    p
}

fn build(dir: &std::path::Path, calls: usize, small: usize, pad: usize) -> Result<(), llmtap::store::StoreError> {
    let (tx, thread) = start_writer(dir, StoreConfig::default())?;
    let mut t = llmtap::capture::now_micros() - 86_400_000_000;
    let mut deriver = Deriver::new(DeriveConfig::default());
    // The big session: conversations of ROUNDS calls, renumbered into one trajectory.
    let mut index: HashMap<String, u32> = HashMap::new();
    let mut summary = None;
    for n in 0..calls {
        let (conv, turn) = (n / ROUNDS, n % ROUNDS);
        let mut ex = exchange(1_000_000 + conv, turn, t);
        if pad > 0 {
            ex = padded(ex, pad, n);
        }
        t += 2_000_000;
        let p = priced(llmtap::pipeline::process::process(ex, usize::MAX));
        let mut out = Vec::new();
        for r in deriver.observe(p.trace, p.call) {
            match r {
                Record::Trace(mut tr) => {
                    tr.trajectory_id = Some(BIG.into());
                    out.push(Record::Trace(tr));
                }
                Record::Step(mut s) => {
                    let next = index.len() as u32;
                    let i = *index.entry(s.step_id.clone()).or_insert(next);
                    s.trajectory_id = BIG.into();
                    s.step_index = i;
                    s.step_id = format!("{BIG}/{i}");
                    out.push(Record::Step(s));
                }
                Record::Trajectory(mut s) => {
                    if summary.is_none() {
                        s.trajectory_id = BIG.into();
                        summary = Some(s);
                    }
                }
            }
        }
        tx.send(out);
    }
    if let Some(mut s) = summary {
        s.llm_calls = calls as u32;
        s.steps = index.len() as u32;
        s.ended_at = llmtap::model::trace::rfc3339(t);
        s.closed = true;
        tx.send(vec![Record::Trajectory(s)]);
    }
    // Many small sessions for the list.
    for s in 0..small {
        for turn in 0..3 {
            let p = priced(llmtap::pipeline::process::process(exchange(s, turn, t), usize::MAX));
            t += 1_000_000;
            tx.send(deriver.observe(p.trace, p.call));
        }
    }
    tx.send(deriver.close_all());
    drop(tx);
    let _ = thread.join();
    Ok(())
}

/// `ex` with `pad` bytes of call-specific text appended to its last message (so compression cannot fold them).
fn padded(mut ex: llmtap::capture::RawExchange, pad: usize, n: usize) -> llmtap::capture::RawExchange {
    let Some(body) = ex.request.body.first() else { return ex };
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return ex;
    };
    let mut text = String::with_capacity(pad);
    let mut x = n as u64 ^ 0x9e37_79b9_7f4a_7c15;
    while text.len() < pad {
        // xorshift: cheap distinct words.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{:x} ", x));
    }
    if let Some(last) = v["messages"].as_array_mut().and_then(|m| m.last_mut()) {
        last["content"] = serde_json::Value::String(text);
    }
    let bytes = bytes::Bytes::from(v.to_string());
    ex.request.len = bytes.len() as u64;
    ex.request.body = [bytes].into();
    ex
}

fn measure(dir: &std::path::Path) -> Result<(), llmtap::store::StoreError> {
    let ctx = data::Context {
        upstreams: [("openai".to_owned(), "https://api.openai.com".to_owned())].into(),
        redactor: llmtap::proxy::redact::Redactor::new(&[]),
        replay_proxy: None,
    };
    let reader = StoreReader::open(dir)?;
    let last_call = reader.call_heads(BIG)?.last().map(|c| c.id.clone()).unwrap_or_default();
    let last_step = reader.trajectory_light(BIG)?.map_or(0, |s| s.steps);
    type Page<'a> = (&'a str, Box<dyn Fn() -> Result<usize, llmtap::store::StoreError> + 'a>);
    let size = |v: serde_json::Value| v.to_string().len();
    let list = SessionQuery {
        limit: 50,
        ..SessionQuery::default()
    };
    let pages: Vec<Page> = vec![
        (
            "sessions list, first page of 50",
            Box::new(|| Ok(size(data::list_sessions(&reader, &list)?))),
        ),
        (
            "sessions list, text search",
            Box::new(|| {
                let q = SessionQuery {
                    text: Some("no-such-text".into()),
                    limit: 50,
                    ..SessionQuery::default()
                };
                Ok(size(data::list_sessions(&reader, &q)?))
            }),
        ),
        (
            "session page (tree + totals over every call)",
            Box::new(|| Ok(size(data::session(&reader, BIG)?.unwrap_or_default()))),
        ),
        (
            "steps, first page of 100",
            Box::new(|| Ok(size(data::steps(&reader, BIG, None, 100)?))),
        ),
        (
            "steps, last page of 100",
            Box::new(|| {
                Ok(size(data::steps(
                    &reader,
                    BIG,
                    Some(last_step.saturating_sub(101)),
                    100,
                )?))
            }),
        ),
        (
            "cost report (every call: totals, by day, model, agent, top 10 sessions)",
            Box::new(|| {
                let q = llmtap::store::CostQuery {
                    since_us: 0,
                    until_us: i64::MAX,
                    utc_offset_s: 0,
                    top: 10,
                };
                let r = reader.cost_report(&q)?;
                Ok(format!("{:?}", r.totals).len())
            }),
        ),
        (
            "call page (last call, with its previous call)",
            Box::new(|| Ok(size(data::call(&reader, &ctx, &last_call)?.unwrap_or_default()))),
        ),
    ];
    for (name, page) in pages {
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..5 {
            let t0 = Instant::now();
            bytes = page()?;
            times.push(t0.elapsed());
        }
        let s = Summary::of(&mut times);
        println!(
            "  {name}: median {:.1} ms, best {:.1} ms, {} KB of JSON",
            s.pct(0.5).as_secs_f64() * 1e3,
            s.pct(0.0).as_secs_f64() * 1e3,
            bytes / 1024
        );
    }
    Ok(())
}
