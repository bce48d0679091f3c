//! The search indexer: a thread of its own, at background priority, that follows the store behind a cursor and
//! writes `search_docs` (and through its triggers the FTS5 index) in small transactions.
//!
//! Why not the store writer: indexing a step costs about as much as storing it (the trigram index writes an
//! entry per distinct three-character sequence), and the writer's cost per exchange is what bounds the lossless
//! capture rate. Here the writer does no search work at all; the indexer waits while the data path needs the
//! CPU (`background::YieldToDataPath`) or the writer has records waiting (`llmtap_store_pending`), and catches
//! up afterwards, so search lags behind capture under load instead of capture losing to search. Its
//! transactions are short (one batch of [`BATCH`] steps), so a writer that still finds the lock taken waits
//! milliseconds (its busy timeout is seconds).
//!
//! The cursor (`search_state`) has two positions: `steps.seq` for new steps, and `export_log.seq` for the
//! `tools` entries the writer logs when a stored step is rewritten (tool results, a retry's answer; the step keeps
//! its seq), so those are indexed again, with the user's step before a rewritten answer (whose columns it takes).

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};

use super::DocColumns;
use super::text::indexed_text;
use crate::model::step::{Step, StepRole};
use crate::store::StoreError;
use crate::store::read::step_from_row;
use crate::store::sql::{rows_of, trajectory_of_step};
use crate::telemetry::Metrics;

/// Steps per transaction.
pub const BATCH: usize = 128;
/// How often an idle indexer looks for new steps: search results lag capture by about this much.
const POLL: Duration = Duration::from_millis(250);
/// How long the indexer waits before looking again when the store writer had records waiting.
const WRITER_BUSY: Duration = Duration::from_millis(20);

/// The running indexer; [`Indexer::stop`] ends it.
pub struct Indexer {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Indexer {
    /// Start indexing the store in `data_dir` on a thread of its own.
    pub fn spawn(data_dir: &Path, metrics: Arc<Metrics>) -> Result<Indexer, StoreError> {
        // Checkpoints belong to the checkpoint thread (see `store::open_without_checkpoints`).
        let conn = crate::store::open_without_checkpoints(data_dir)?;
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new()
            .name("llmtap-search".into())
            .spawn(move || run(conn, rx, metrics))
            .map_err(StoreError::Thread)?;
        Ok(Indexer {
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// Stop after the batch under way (the cursor keeps the position for the next start).
    pub fn stop(mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(conn: Connection, stop: Receiver<()>, metrics: Arc<Metrics>) {
    crate::background::run_in_background();
    let mut yielding = crate::background::YieldToDataPath::default();
    let wait = |d: Duration| !matches!(stop.recv_timeout(d), Err(RecvTimeoutError::Timeout));
    let mut last_count: Option<std::time::Instant> = None;
    loop {
        // How far behind search is, for `llmtap_search_pending_steps`: once a second, waiting or not.
        if last_count.is_none_or(|t| t.elapsed() >= PENDING_INTERVAL) {
            last_count = Some(std::time::Instant::now());
            if let Ok(n) = pending_steps(&conn) {
                metrics.search_pending_steps.set(n);
            }
        }
        // Nothing is lost by waiting: the cursor stays where it is. The indexer waits while the proxy needs the
        // CPU, and while the store writer has records waiting: its transactions would take the lock the writer
        // is about to ask for (the writer then sleeps in its busy handler), and capture comes first.
        let pause = yielding
            .pause(|| true)
            .or_else(|| (metrics.store_pending.get() > 0).then_some(WRITER_BUSY));
        if let Some(d) = pause {
            if wait(d) {
                return;
            }
            continue;
        }
        let idle = match index_pass(&conn) {
            Ok(n) => n < BATCH,
            Err(e) => {
                // Busy: the writer holds the lock for a long commit; try again at the next poll.
                if !e.is_busy() {
                    metrics.store_error(&e);
                }
                true
            }
        };
        if (idle && wait(POLL))
            || (!idle && matches!(stop.try_recv(), Err(std::sync::mpsc::TryRecvError::Disconnected)))
        {
            return;
        }
    }
}

/// How often the indexer counts the steps it has not indexed yet.
const PENDING_INTERVAL: Duration = Duration::from_secs(1);

/// Steps stored after the indexer's position: the last step's number minus the cursor (two lookups by key; a
/// step that retention deleted meanwhile is counted until the cursor passes it).
fn pending_steps(conn: &Connection) -> Result<u64, StoreError> {
    let cursor: i64 = conn
        .prepare_cached("SELECT steps_seq FROM search_state WHERE id = 1")?
        .query_row([], |r| r.get(0))
        .optional()?
        .unwrap_or(0);
    let last: Option<i64> = conn
        .prepare_cached("SELECT MAX(seq) FROM steps")?
        .query_row([], |r| r.get(0))?;
    Ok(last.map_or(0, |l| l.saturating_sub(cursor).max(0) as u64))
}

/// One document to write.
struct Doc {
    seq: i64,
    step_id: String,
    columns: DocColumns,
    text: String,
}

impl Doc {
    /// `call`: the step answering a user's step (see [`DocColumns::of`]).
    fn of(seq: i64, step: &Step, call: Option<&Step>) -> Doc {
        Doc {
            seq,
            step_id: step.step_id.clone(),
            columns: DocColumns::of(step, call),
            text: indexed_text(step),
        }
    }
}

/// The step with id `step_id` and its seq, when it is stored and decodes.
fn stored_step(conn: &Connection, step_id: &str) -> Result<Option<(i64, Step)>, StoreError> {
    let Some(trajectory) = trajectory_of_step(step_id) else {
        return Ok(None);
    };
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT s.step_id, s.body, s.seq FROM steps s WHERE {} AND s.step_id = ?2",
        rows_of("s", "?1")
    ))?;
    let mut rows = stmt.query(params![trajectory, step_id])?;
    let Some(row) = rows.next()? else { return Ok(None) };
    let seq: i64 = row.get(2)?;
    Ok(step_from_row::<Step>(row).ok().map(|step| (seq, step)))
}

/// A document for `step`, with the call that answered it when it is a user's step.
fn doc(conn: &Connection, seq: i64, step: &Step) -> Result<Doc, StoreError> {
    let call = match super::answer_id(step) {
        Some(id) => stored_step(conn, &id)?.map(|(_, call)| call),
        None => None,
    };
    Ok(Doc::of(seq, step, call.as_ref()))
}

/// Index the next steps behind the cursor (new ones, then rewritten ones), at most [`BATCH`] of each, in one
/// transaction; returns how many of the larger kind there were (`BATCH`: more are waiting).
pub fn index_pass(conn: &Connection) -> Result<usize, StoreError> {
    let (steps_seq, log_seq): (i64, i64) = conn
        .prepare_cached("SELECT steps_seq, log_seq FROM search_state WHERE id = 1")?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?
        .unwrap_or((0, 0));
    // Read (and decode) before taking the write lock: the transaction only writes.
    let mut docs = Vec::new();
    let mut steps = Vec::new();
    let mut new_steps = 0;
    let mut last_step = steps_seq;
    {
        let mut stmt =
            conn.prepare_cached("SELECT step_id, body, seq FROM steps WHERE seq > ?1 ORDER BY seq LIMIT ?2")?;
        let mut rows = stmt.query(params![steps_seq, BATCH as i64])?;
        while let Some(row) = rows.next()? {
            new_steps += 1;
            last_step = row.get(2)?;
            // A step that does not decode is skipped (its reads fail too), not retried forever.
            if let Ok(step) = step_from_row::<Step>(row) {
                steps.push((last_step, step));
            }
        }
    }
    let mut rewritten = 0;
    let mut last_log = log_seq;
    {
        let mut entries = conn.prepare_cached(
            "SELECT seq, ref FROM export_log WHERE seq > ?1 AND kind = 'tools' ORDER BY seq LIMIT ?2",
        )?;
        let refs: Vec<(i64, String)> = entries
            .query_map(params![log_seq, BATCH as i64], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        // A step beyond the new-step cursor is indexed when that cursor reaches it.
        let indexed_so_far = |found: Option<(i64, Step)>| found.filter(|(at, _)| *at <= last_step);
        for (seq, step_id) in refs {
            rewritten += 1;
            last_log = seq;
            let Some((at, s)) = indexed_so_far(stored_step(conn, &step_id)?) else {
                continue;
            };
            // The user's step before an agent step takes its filter columns (model, cost, error) from it: a
            // rewritten answer (a retry's) changes them.
            if s.role == StepRole::Agent && s.step_index > 0 {
                let before = format!("{}/{}", s.trajectory_id, s.step_index - 1);
                if let Some(prev) = indexed_so_far(stored_step(conn, &before)?)
                    && prev.1.role != StepRole::Agent
                {
                    steps.push(prev);
                }
            }
            steps.push((at, s));
        }
    }
    if last_step == steps_seq && last_log == log_seq {
        return Ok(0);
    }
    for (seq, step) in &steps {
        docs.push(doc(conn, *seq, step)?);
    }
    // The write lock now, not at the first write: a busy answer then comes before any work is done.
    let tx = rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Immediate)?;
    {
        let mut delete = tx.prepare_cached("DELETE FROM search_docs WHERE seq = ?1")?;
        // Only while the step is still there: retention may have deleted it since it was read.
        let mut insert = tx.prepare_cached(
            "INSERT INTO search_docs (seq, step_id, session_key, model, agent, error, cost_usd, started_us, text)
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9 WHERE EXISTS (SELECT 1 FROM steps WHERE seq = ?1)",
        )?;
        for d in &docs {
            delete.execute([d.seq])?;
            if d.text.is_empty() {
                continue;
            }
            let c = &d.columns;
            insert.execute(params![
                d.seq,
                d.step_id,
                c.session_key,
                c.model,
                c.agent,
                c.error,
                c.cost_usd,
                c.started_us,
                d.text
            ])?;
        }
    }
    tx.execute(
        "UPDATE search_state SET steps_seq = ?1, log_seq = ?2 WHERE id = 1",
        params![last_step, last_log],
    )?;
    tx.commit()?;
    Ok(new_steps.max(rewritten))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::derive::testkit::{Harness, call, calls, calls_out, result, text_out, tool_call, trace, user};
    use crate::model::exchange::Api;
    use crate::model::record::Record;
    use crate::store::StoreReader;
    use crate::store::chunks::ChunkCache;
    use crate::store::search::{Field, SearchQuery, Terms};
    use crate::store::write::write_batch;

    /// One agent conversation of three calls: each reads a file whose contents come back as the next request's
    /// tool result; the last answers in text.
    fn conversation(prompt: &str, contents: &[&str], answer: &str) -> Vec<Record> {
        let mut h = Harness::new(Api::OpenAiChat);
        let mut records = Vec::new();
        let mut messages = vec![user(prompt)];
        for (i, c) in contents.iter().enumerate() {
            let id = format!("call-{i}");
            let tc = tool_call(&id, "read_file", json!({ "path": format!("docs/file_{i}.md") }));
            let t = trace(h.api, h.now, h.now + 1_000_000);
            h.now += 2_000_000;
            records.extend(h.deriver.observe(
                t,
                Some(call("agent", messages.clone(), calls_out(std::slice::from_ref(&tc)))),
            ));
            messages.push(calls(&[tc]));
            messages.push(result(&id, c));
        }
        let t = trace(h.api, h.now, h.now + 1_000_000);
        records.extend(h.deriver.observe(t, Some(call("agent", messages, text_out(answer)))));
        records.extend(h.deriver.close_all());
        records
    }

    fn search(reader: &StoreReader, q: &str) -> Vec<(String, Field, String)> {
        let q = SearchQuery::new(Terms::parse(q).unwrap_or_else(|e| panic!("{e}")));
        reader
            .search(&q)
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .map(|h| {
                let hits = h
                    .snippet
                    .iter()
                    .filter(|p| p.hit)
                    .map(|p| p.text.as_str())
                    .collect::<Vec<_>>();
                let hits = hits.join("|");
                (h.step_id, h.field, hits)
            })
            .collect()
    }

    fn index_all(conn: &Connection) {
        while index_pass(conn).unwrap_or_else(|e| panic!("{e}")) > 0 {}
    }

    /// A user's step takes its filter columns from the agent step that answers it. When that answer is rewritten
    /// after both were indexed (a retry's answer in place of a failed call's), the user's step is indexed again.
    #[test]
    fn a_rewritten_answer_updates_the_columns_of_the_question_before_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut chunks = ChunkCache::default();
        let mut h = Harness::new(Api::OpenAiChat);
        let t = trace(h.api, h.now, h.now + 1_000_000);
        let records = h.deriver.observe(
            t,
            Some(call(
                "agent",
                vec![user("the crème brûlée question")],
                text_out("an answer"),
            )),
        );
        let mut failed = records.clone();
        let answer = failed
            .iter_mut()
            .find_map(|r| match r {
                Record::Step(s) if s.role == StepRole::Agent => Some(s),
                _ => None,
            })
            .unwrap_or_else(|| panic!("an agent step in {records:?}"));
        answer.status = "error".into();
        answer.error = Some("overloaded".into());
        write_batch(&mut conn, &failed, &mut chunks).unwrap_or_else(|e| panic!("{e}"));
        index_all(&conn);
        let question_error = |conn: &Connection| -> bool {
            conn.query_row(
                "SELECT d.error FROM search_docs d JOIN steps s ON s.seq = d.seq WHERE s.role = 'user'",
                [],
                |r| r.get(0),
            )
            .unwrap_or_else(|e| panic!("{e}"))
        };
        assert!(question_error(&conn), "indexed with the failed answer's error");
        // The successful answer alone, as a retry's version of the step: the writer rewrites the stored answer
        // and nothing else.
        let retried: Vec<Record> = records
            .iter()
            .filter(|r| matches!(r, Record::Step(s) if s.role == StepRole::Agent))
            .cloned()
            .collect();
        write_batch(&mut conn, &retried, &mut chunks).unwrap_or_else(|e| panic!("{e}"));
        index_all(&conn);
        assert!(!question_error(&conn), "the question follows its rewritten answer");
    }

    #[test]
    fn pending_steps_counts_what_is_stored_and_not_indexed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pending_steps(&conn).unwrap_or_else(|e| panic!("{e}")), 0);
        let records = conversation("a question", &["a result"], "an answer");
        write_batch(&mut conn, &records, &mut ChunkCache::default()).unwrap_or_else(|e| panic!("{e}"));
        let stored: i64 = conn
            .query_row("SELECT COUNT(*) FROM steps", [], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(stored > 1);
        let stored = stored as u64;
        assert_eq!(pending_steps(&conn).unwrap_or_else(|e| panic!("{e}")), stored);
        index_all(&conn);
        assert_eq!(pending_steps(&conn).unwrap_or_else(|e| panic!("{e}")), 0);
    }

    #[test]
    fn steps_are_found_by_substrings_of_any_language_and_tool_results_added_later_are_indexed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let records = conversation(
            "Résumé the Crème Brûlée recipe",
            &["東京タワーの高さは333メートルです", "abc bcd: not the word"],
            "Done: the tower is 333 m tall",
        );
        let mut chunks = ChunkCache::default();
        // One record per transaction: an agent step is stored first without its tool result, then rewritten
        // with it (the second write is what the export log's `tools` entry names).
        for r in records.chunks(1) {
            write_batch(&mut conn, r, &mut chunks).unwrap_or_else(|e| panic!("{e}"));
        }
        index_all(&conn);
        let reader = StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let found = search(&reader, "東京タワー");
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!((found[0].1, found[0].2.as_str()), (Field::ToolResult, "東京タワー"));
        // A two-character word (below the trigram index): the same step.
        assert_eq!(search(&reader, "東京")[0].0, found[0].0);
        // Case folded, accents kept.
        let accented = search(&reader, "crème brûlée");
        assert_eq!(accented.len(), 1, "{accented:?}");
        assert_eq!((accented[0].1, accented[0].2.as_str()), (Field::Prompt, "Crème|Brûlée"));
        assert!(search(&reader, "creme").is_empty());
        // A phrase is a substring, not a set of trigrams: "abcd" is not in "abc bcd".
        assert!(search(&reader, "abcd").is_empty());
        assert_eq!(search(&reader, "\"abc bcd\"").len(), 1);
        // Tool arguments; every term must match.
        assert_eq!(search(&reader, "docs/file_1.md")[0].1, Field::ToolCall);
        assert!(search(&reader, "東京 brûlée").is_empty());
        // Newest first: the answer, then the step that read file 1.
        let tall = search(&reader, "333");
        assert_eq!(tall.len(), 2, "{tall:?}");
        assert_eq!(tall[0].1, Field::Output);

        // Retention takes the index rows with the steps.
        let config = crate::config::StoreConfig {
            max_traces: 1,
            ..Default::default()
        };
        crate::store::read::apply_retention(&conn, &config, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
        assert!(search(&reader, "東京タワー").is_empty());
        let docs: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM search_docs WHERE seq NOT IN (SELECT seq FROM steps)",
                [],
                |r| r.get(0),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(docs, 0);
        let fts: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM search_fts WHERE text GLOB '*タワー*'",
                [],
                |r| r.get(0),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(fts, 0, "the FTS index lost the deleted rows too");
        // The user's step has no call: retention keeps it, and its index row.
        assert_eq!(search(&reader, "brûlée").len(), 1);
    }
}
