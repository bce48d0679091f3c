//! The exporters' cache of the writer's last committed records (`store::recent`) answers as the store does.
//!
//! Every recorded agent session and every single recorded call goes through the pipeline's own processing and
//! derivation, into a real store writer thread and SQLite file, a batch per call as the pipeline sends them. Then
//! every record the exporters look up is read both ways, and every export-log entry is turned into spans by a
//! reader that asks the store and by two (two sinks) that ask the cache first. Some calls carry a session header.
//! (A trace the deriver read always has its own session id; the fallback to the header, for a trace it did not
//! read, is covered by `store::recent`'s unit tests.)
//!
//! The same stored corpus checks the store's keys (schema v9): a trajectory's steps found by their ids' range and
//! a session's trajectories found through the partial session index equal what their columns name.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use llmtap::derive::Deriver;
use llmtap::export::otlp::spans::SpanBuilder;
use llmtap::model::record::ExportSeq;
use llmtap::store::{RecentRecords, Record, StoreReader, StoreWriter};

const T0: i64 = 1_700_000_000_000_000;

/// Stores every recorded call through a writer that fills `recent`; returns the trace, step and trajectory ids.
fn store_the_corpus(dir: &std::path::Path, recent: Arc<RecentRecords>) -> (Vec<String>, Vec<String>, Vec<String>) {
    let conn = llmtap::store::open_for_writing(dir).unwrap();
    let metrics = Arc::new(llmtap::telemetry::Metrics::default());
    // Kept forever: the recorded calls are years old.
    let config = llmtap::config::StoreConfig {
        retention_days: 0,
        ..Default::default()
    };
    let (tx, writer) = StoreWriter::spawn(conn, config, metrics.clone(), recent).unwrap();
    let prices = llmtap::cost::CostTable::embedded().unwrap();
    let mut deriver = Deriver::new(llmtap::config::DeriveConfig::default());
    let (mut traces, mut steps, mut trajectories) = (Vec::new(), Vec::new(), Vec::new());
    let mut keep = |records: &[Record]| {
        for r in records {
            match r {
                Record::Trace(t) => traces.push(t.id.clone()),
                Record::Step(s) => steps.push(s.step_id.clone()),
                Record::Trajectory(t) => trajectories.push(t.trajectory_id.clone()),
            }
        }
    };
    let mut batches = Vec::new();
    let mut calls: Vec<Fixture> = session_names().iter().flat_map(|n| session(n)).collect();
    calls.extend(all_fixtures());
    for (i, f) in calls.iter().enumerate() {
        let mut ex = f.raw_exchange(T0 + i as i64 * 1_000_000, 200_000, 500_000);
        if i % 3 == 0 {
            ex.meta.session = Some(format!("session-{}", i % 7));
        }
        let mut p = llmtap::pipeline::process::process(ex, usize::MAX);
        llmtap::pipeline::pricing::price(&prices, &mut p.trace, p.call.as_ref(), &metrics);
        let records = deriver.observe(p.trace, p.call);
        keep(&records);
        batches.push(records);
    }
    let closing = deriver.close_all();
    keep(&closing);
    batches.push(closing);
    // Sent back to back: the writer empties the cache after a second without records.
    for batch in batches {
        tx.send(batch);
    }
    drop(tx);
    writer.join().unwrap();
    traces.sort();
    traces.dedup();
    steps.sort();
    steps.dedup();
    trajectories.sort();
    trajectories.dedup();
    (traces, steps, trajectories)
}

#[test]
fn lookups_from_the_cache_equal_the_stores() {
    let dir = tempfile::tempdir().unwrap();
    let recent = Arc::new(RecentRecords::new(1));
    let (traces, _, trajectories) = store_the_corpus(dir.path(), recent.clone());
    assert!(traces.len() > 100 && trajectories.len() > 50, "{} traces", traces.len());
    // The cache holds every trace with an agent step (the corpus is smaller than its bound), so the comparisons
    // below compare the cache's answers, not the store's with itself. A trace without one is never exported as a
    // span and not held.
    let store = StoreReader::open(dir.path()).unwrap();
    let mut with_agent_step = 0;
    for id in &traces {
        let facts = store.step_span_facts_for_trace(id).unwrap();
        let held = recent.trace_without_bodies(id);
        if facts.is_none() {
            assert!(held.is_none(), "trace {id} without an agent step is held");
            continue;
        }
        with_agent_step += 1;
        assert!(held.is_some(), "trace {id} not held");
        // Every field, bodies (left out) included.
        assert_eq!(
            format!("{held:?}"),
            format!("{:?}", store.trace_without_bodies(id).unwrap()),
            "trace {id}"
        );
        assert_eq!(recent.step_span_facts_for_trace(id), facts, "step facts of {id}");
    }
    assert!(with_agent_step > 100, "{with_agent_step} traces with an agent step");
    assert_eq!(recent.held_traces(), 0, "each trace was read once");
    let mut with_parent = 0;
    for id in &trajectories {
        let parent = store.parent_trajectory(id).unwrap();
        with_parent += usize::from(parent.is_some());
        assert_eq!(recent.parent_trajectory(id), Some(parent), "parent of {id}");
    }
    assert!(with_parent > 0, "the corpus has sub-agents");
    // Every trajectory was closed (`close_all`): its summary is held for its agent span, as the store reads it.
    assert_eq!(recent.held_closed(), trajectories.len());
    for id in &trajectories {
        let held = recent.trajectory_light(id);
        assert!(held.as_ref().is_some_and(|t| t.closed), "trajectory {id} not held");
        assert_eq!(held, store.trajectory_light(id).unwrap(), "trajectory {id}");
    }
    assert_eq!(recent.held_closed(), 0, "each summary was read once");
}

/// Every export-log entry's spans, with and without content, as two sinks build them from the cache, equal the
/// spans built from the store.
#[test]
fn spans_from_the_cache_equal_the_stores() {
    let dir = tempfile::tempdir().unwrap();
    let recent = Arc::new(RecentRecords::new(2));
    let (traces, steps, _) = store_the_corpus(dir.path(), recent.clone());
    let store = StoreReader::open(dir.path()).unwrap();
    let cached = StoreReader::open(dir.path()).unwrap().with_recent(recent.clone());
    let servers = HashMap::new();
    let entries = store.export_log(ExportSeq(0), 1_000_000).unwrap();
    assert!(entries.len() > traces.len(), "{} entries", entries.len());
    let mut spans = 0;
    for capture_content in [false, true] {
        let mut from_store = SpanBuilder::new(&store, capture_content, &servers);
        let mut from_cache = SpanBuilder::new(&cached, capture_content, &servers);
        for e in &entries {
            let want = from_store.spans_for(e.kind, &e.reference).unwrap();
            spans += want.len();
            assert_eq!(
                from_cache.spans_for(e.kind, &e.reference).unwrap(),
                want,
                "{:?} {}",
                e.kind,
                e.reference
            );
        }
        if !capture_content {
            assert!(recent.held_traces() > 100, "one of two sinks read them");
            assert!(recent.held_closed() > 50, "one of two sinks read them");
        }
    }
    // Both passes (two sinks) read every call's trace and every closed trajectory from the cache.
    assert_eq!(recent.held_traces(), 0);
    assert_eq!(recent.held_closed(), 0);
    assert!(spans > entries.len(), "{spans} spans");
    assert!(!steps.is_empty());
}

/// Retention's deletes empty the cache: no span is built from a record the store no longer has.
#[test]
fn the_cache_forgets_what_retention_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let recent = Arc::new(RecentRecords::new(1));
    let (traces, _, trajectories) = store_the_corpus(dir.path(), recent.clone());
    assert!(recent.held_traces() > 100 && recent.held_closed() > 50);
    // The recorded calls are from 2023; a writer that keeps 1 day deletes them all when it starts.
    let config = llmtap::config::StoreConfig {
        retention_days: 1,
        ..Default::default()
    };
    let conn = llmtap::store::open_for_writing(dir.path()).unwrap();
    let (tx, writer) = StoreWriter::spawn(
        conn,
        config,
        Arc::new(llmtap::telemetry::Metrics::default()),
        recent.clone(),
    )
    .unwrap();
    drop(tx);
    writer.join().unwrap();
    assert_eq!(recent.held_traces(), 0);
    assert_eq!(recent.held_closed(), 0);
    let store = StoreReader::open(dir.path()).unwrap();
    assert!(
        store.trace_without_bodies(&traces[0]).unwrap().is_none(),
        "retention deleted it"
    );
    let cached = StoreReader::open(dir.path()).unwrap().with_recent(recent.clone());
    for id in &traces {
        assert!(cached.trace_without_bodies(id).unwrap().is_none(), "trace {id}");
    }
    // What retention kept (a trajectory whose steps remain) is still read, from the store.
    for id in &trajectories {
        assert_eq!(recent.parent_trajectory(id), None, "trajectory {id}");
        assert_eq!(
            cached.parent_trajectory(id).unwrap(),
            store.parent_trajectory(id).unwrap(),
            "trajectory {id}"
        );
    }
}

/// After a second without records the writer empties the cache: a quiet llmtap holds no copies of old records,
/// and the exporters read the store.
#[test]
fn an_idle_writer_empties_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let recent = Arc::new(RecentRecords::new(1));
    let conn = llmtap::store::open_for_writing(dir.path()).unwrap();
    let metrics = Arc::new(llmtap::telemetry::Metrics::default());
    let (tx, writer) = StoreWriter::spawn(conn, Default::default(), metrics.clone(), recent.clone()).unwrap();
    let f = &session(&session_names()[0])[0];
    let p = llmtap::pipeline::process::process(f.raw_exchange(T0, 200_000, 500_000), usize::MAX);
    let id = p.trace.id.clone();
    let mut deriver = Deriver::new(llmtap::config::DeriveConfig::default());
    tx.send(deriver.observe(p.trace, p.call));
    // The writer runs at SCHED_IDLE: on a busy machine it may take a while, so both waits poll.
    let within = |secs: u64, what: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while std::time::Instant::now() < deadline {
            if what() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        false
    };
    assert!(within(5, &|| recent.held_traces() == 1), "the committed trace is held");
    assert!(within(10, &|| recent.held_traces() == 0), "still held after 10 s idle");
    let store = StoreReader::open(dir.path()).unwrap().with_recent(recent);
    assert!(
        store.trace_without_bodies(&id).unwrap().is_some(),
        "read from the store"
    );
    drop(tx);
    writer.join().unwrap();
}

/// Schema v9 finds a trajectory's steps by their ids' key range and a session's trajectories through a partial
/// index (`store::sql`). Over every recorded session and call, as the writer stores them: each trajectory's steps
/// page equals the rows whose `trajectory_id` column names it, and each session's trajectories equal the rows
/// whose session key names it.
#[test]
fn every_recorded_trajectorys_steps_and_sessions_are_found_by_the_v9_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (_, steps, trajectories) = store_the_corpus(dir.path(), Arc::new(RecentRecords::default()));
    let store = StoreReader::open(dir.path()).unwrap();
    let conn = llmtap::store::open(dir.path()).unwrap();
    let column = |sql: &str, key: &str| -> Vec<String> {
        let mut stmt = conn.prepare(sql).unwrap();
        stmt.query_map([key], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    let mut seen_steps = 0;
    let mut sessions = std::collections::BTreeSet::new();
    for id in &trajectories {
        let paged: Vec<String> = store
            .steps_page(id, None, 1000)
            .unwrap()
            .into_iter()
            .map(|s| s.step_id)
            .collect();
        let by_column = column(
            "SELECT step_id FROM steps WHERE trajectory_id = ?1 ORDER BY step_index, seq",
            id,
        );
        assert!(!by_column.is_empty(), "trajectory {id} has steps");
        assert_eq!(paged, by_column, "steps of {id}");
        seen_steps += paged.len();
        sessions.extend(column(
            "SELECT COALESCE(session_id, trajectory_id) FROM trajectories WHERE trajectory_id = ?1",
            id,
        ));
    }
    assert_eq!(seen_steps, steps.len(), "every step belongs to one trajectory's range");
    assert!(
        sessions.len() > 10 && sessions.len() < trajectories.len(),
        "{} sessions",
        sessions.len()
    );
    let mut grouped = 0;
    for key in &sessions {
        let found: Vec<String> = store
            .session_trajectories(key)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t.trajectory_id)
            .collect();
        let by_key = column(
            "SELECT trajectory_id FROM trajectories WHERE COALESCE(session_id, trajectory_id) = ?1
             ORDER BY started_us, trajectory_id",
            key,
        );
        assert_eq!(found, by_key, "session {key}");
        grouped += found.len();
    }
    assert_eq!(grouped, trajectories.len());
    // A conversation that is its own session leaves the column empty.
    let own = rows_naming_their_own_session(&conn);
    assert_eq!(own, 0);
}
