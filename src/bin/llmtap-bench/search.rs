//! Search over a large store: `calls` calls (default 100,000) of 10-call agent conversations, each call's prompt,
//! tool result and output made of words drawn from a synthetic vocabulary (a few common, most rare, as in real
//! text), every seventh conversation's prompt in Japanese, every 50th call failed; written through the real
//! store writer, then indexed by the search indexer's own pass (`store::search::index`, timed: the rate at which
//! it catches up), then each query answered as `GET /api/search` answers it (hits and snippets as JSON), timed.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use llmtap::capture::RawExchange;
use llmtap::config::{DeriveConfig, StoreConfig};
use llmtap::derive::Deriver;
use llmtap::store::search::{SearchQuery, Terms, TermsError};
use llmtap::store::{StoreReader, search::index};
use llmtap::telemetry::Metrics;

use super::stats::Summary;

const TURNS: usize = 10;
const SYLLABLES: [&str; 16] = [
    "ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du", "zor", "qua", "fen", "gli", "bra", "tus",
];

/// A small deterministic generator (xorshift), so every run builds the same store.
struct Words(u64);

impl Words {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Word `i` of the vocabulary (4,352 words: two or three syllables).
    fn word(i: usize) -> String {
        let i = i % (16 * 16 + 16 * 16 * 16);
        if i < 256 {
            format!("{}{}", SYLLABLES[i / 16], SYLLABLES[i % 16])
        } else {
            let i = i - 256;
            format!(
                "{}{}{}",
                SYLLABLES[i / 256],
                SYLLABLES[(i / 16) % 16],
                SYLLABLES[i % 16]
            )
        }
    }

    /// `n` words, skewed towards the start of the vocabulary (word 0 is in most texts, the last ones in few).
    fn text(&mut self, n: usize) -> String {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let r = (self.next() % 1_000_000) as f64 / 1_000_000.0;
            out.push(Words::word((r * r * r * 4352.0) as usize));
        }
        out.join(" ")
    }
}

fn exchange(words: &mut Words, conv: usize, turn: usize, t: i64) -> RawExchange {
    let prompt = if conv.is_multiple_of(7) {
        format!(
            "東京タワーの近くで会議があります。チケット{conv}の件を調べてください。{}",
            words.text(10)
        )
    } else {
        format!("Ticket {conv}: {}", words.text(25))
    };
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": prompt}),
    ];
    let mut inner = Words(((conv as u64) << 8 | 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for k in 0..turn {
        let id = format!("call_{conv}_{k}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "search_logs", "arguments": format!("{{\"query\":\"{}\"}}", inner.text(3))}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": inner.text(120)}));
    }
    let request = json!({"model": "gpt-4o", "messages": messages});
    let failed = (conv * TURNS + turn) % 50 == 49;
    let response = if failed {
        json!({"error": {"message": format!("upstream overloaded: {}", words.text(5)), "type": "server_error"}})
    } else {
        json!({"id": format!("chatcmpl-{conv}-{turn}"), "object": "chat.completion", "created": 1,
            "model": if conv.is_multiple_of(2) { "gpt-4o-2024-08-06" } else { "gpt-4o-mini-2024-07-18" },
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
                "content": words.text(30),
                "tool_calls": [{"id": format!("call_{conv}_{turn}"), "type": "function",
                    "function": {"name": "search_logs", "arguments": format!("{{\"query\":\"{}\"}}", words.text(3))}}]}}],
            "usage": {"prompt_tokens": 500 + 150 * turn, "completion_tokens": 40}})
    };
    let id = ((conv as u128) << 64) | turn as u128;
    let status = if failed { 500 } else { 200 };
    super::capture::chat_exchange(id, status, request.to_string(), response.to_string(), t)
}

pub fn run(calls: usize) {
    let dir = std::env::temp_dir().join(format!("llmtap-bench-search-{}", std::process::id()));
    if let Err(e) = measure(&dir, calls) {
        eprintln!("llmtap-bench search: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn measure(dir: &std::path::Path, calls: usize) -> Result<(), llmtap::store::StoreError> {
    let t0 = Instant::now();
    let start = llmtap::capture::now_micros() - 86_400_000_000;
    {
        let conn = llmtap::store::open(dir)?;
        let (tx, thread) = llmtap::store::StoreWriter::spawn(
            conn,
            StoreConfig::default(),
            Arc::new(Metrics::default()),
            Default::default(),
        )
        .map_err(llmtap::store::StoreError::Thread)?;
        let mut deriver = Deriver::new(DeriveConfig::default());
        let mut words = Words(0x2545_F491_4F6C_DD1D);
        let mut batch = Vec::new();
        for n in 0..calls {
            let (conv, turn) = (n / TURNS, n % TURNS);
            let p = llmtap::pipeline::process::process(
                exchange(&mut words, conv, turn, start + n as i64 * 100_000),
                usize::MAX,
            );
            batch.extend(deriver.observe(p.trace, p.call));
            if n % 64 == 63 {
                tx.send(std::mem::take(&mut batch));
            }
            if n % 10_000 == 9_999 {
                tx.send(deriver.close_all());
            }
        }
        tx.send(batch);
        tx.send(deriver.close_all());
        drop(tx);
        let _ = thread.join();
    }
    let built = t0.elapsed();
    let size = |dir: &std::path::Path| std::fs::metadata(llmtap::store::db_path(dir)).map_or(0, |m| m.len());
    let conn = llmtap::store::open(dir)?;
    conn.pragma_update(None, "wal_checkpoint", "TRUNCATE")?;
    let before = size(dir);
    let t1 = Instant::now();
    let mut passes = 0;
    while index::index_pass(&conn)? > 0 {
        passes += 1;
    }
    let indexing = t1.elapsed();
    conn.pragma_update(None, "wal_checkpoint", "TRUNCATE")?;
    let docs: i64 = conn.query_row("SELECT COUNT(*) FROM search_docs", [], |r| r.get(0))?;
    let text: i64 = conn.query_row("SELECT COALESCE(SUM(length(text)), 0) FROM search_docs", [], |r| {
        r.get(0)
    })?;
    let after = size(dir);
    println!(
        "search: {calls} calls stored in {:.1} s ({:.1} MB); {docs} steps indexed in {:.1} s ({:.0} steps/s, {passes} \
         transactions of up to {} steps), {:.1} M chars of text, the store grew by {:.1} MB",
        built.as_secs_f64(),
        before as f64 / 1e6,
        indexing.as_secs_f64(),
        docs as f64 / indexing.as_secs_f64().max(1e-9),
        index::BATCH,
        text as f64 / 1e6,
        (after.saturating_sub(before)) as f64 / 1e6
    );

    let reader = StoreReader::open(dir)?;
    let end = start + calls as i64 * 100_000;
    let query = |q: &str| Terms::parse(q).map(SearchQuery::new);
    let rare = Words::word(4300);
    let medium = Words::word(2000);
    let common = Words::word(3);
    let ticket = format!("ticket {}", calls / TURNS / 2);
    let cases: Vec<(String, Result<SearchQuery, TermsError>)> = vec![
        (format!("a rare word ({rare})"), query(&rare)),
        (format!("a medium word ({medium})"), query(&medium)),
        (format!("a common word ({common})"), query(&common)),
        (
            format!("two words ({medium} {common})"),
            query(&format!("{medium} {common}")),
        ),
        (format!("a phrase (\"{ticket}:\")"), query(&format!("\"{ticket}:\""))),
        ("Japanese, 5 characters (東京タワー)".into(), query("東京タワー")),
        ("Japanese, 2 characters (会議: a scan)".into(), query("会議")),
        (
            "a medium word, model gpt-4o-mini, the last hour".to_owned(),
            query(&medium).map(|q| SearchQuery {
                model: Some("gpt-4o-mini".into()),
                since_us: Some(end - 3_600_000_000),
                ..q
            }),
        ),
        (
            "\"overloaded\", errors only".into(),
            query("overloaded").map(|q| SearchQuery { errors_only: true, ..q }),
        ),
        (
            "a common word, cost ≥ $0.003".to_owned(),
            query(&common).map(|q| SearchQuery {
                min_cost: Some(0.003),
                ..q
            }),
        ),
    ];
    for (name, q) in cases {
        let q = match q {
            Ok(q) => q,
            Err(e) => {
                eprintln!("llmtap-bench search: {name}: {e}");
                continue;
            }
        };
        let mut times = Vec::new();
        let mut hits = 0;
        for _ in 0..30 {
            let t = Instant::now();
            let answer = llmtap::api::viewer::search::answer(&reader, &q)?;
            times.push(t.elapsed());
            hits = answer["hits"].as_array().map_or(0, Vec::len);
        }
        let s = Summary::of(&mut times);
        println!(
            "  {name}: p50 {:.1} ms, p99 {:.1} ms, {hits} hits (limit {})",
            s.pct(0.5).as_secs_f64() * 1e3,
            s.pct(0.99).as_secs_f64() * 1e3,
            q.limit
        );
    }
    Ok(())
}
