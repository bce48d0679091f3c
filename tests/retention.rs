//! Store retention through the real binary: `store.max_traces` keeps the newest traces with their bodies and
//! steps, removes what was derived from the others, counts what it removed, and applies to a store that was
//! already over the limit when llmtap started; `store.retention_days` removes traces older than that.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_traces_keeps_the_newest_and_trims_a_store_found_over_the_limit() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "[store]\nmax_traces = 3\n");
    let fixtures = json_calls(6);

    // Six calls in quick succession: retention runs at start and then once a minute, so all six are stored.
    record_calls(&config, dir.path(), &fixtures).await;

    // Restarted over a store holding twice the limit: trimmed to the newest three without any new traffic.
    let tap = Llmtap::start(&config, dir.path());
    let traces = tap.wait_for_at_most_traces(3);
    assert_eq!(traces.len(), 3, "max_traces = 3");
    for (t, f) in traces.iter().zip(&fixtures[3..]) {
        let request: Value = serde_json::from_slice(&f.request).unwrap();
        assert_eq!(
            t["request"], request,
            "{}: the newest are kept, with their bodies",
            f.name
        );
        assert_eq!(Some(&t["response"]), f.response_json.as_ref(), "{}", f.name);
    }
    assert_eq!(tap.metric("llmtap_evicted_total"), 3);

    // What was derived from the removed calls went with them: every step left belongs to a kept trace, each
    // kept trace still has its steps, and no trajectory or export-log entry is left pointing at nothing.
    let kept: Vec<&str> = traces.iter().filter_map(|t| t["id"].as_str()).collect();
    let steps = tap.export("steps", &[]);
    let step_traces: Vec<&str> = steps.iter().filter_map(|s| s["provider_trace_id"].as_str()).collect();
    assert!(!step_traces.is_empty());
    assert!(
        step_traces.iter().all(|t| kept.contains(t)),
        "{step_traces:?} vs kept {kept:?}"
    );
    for id in &kept {
        assert!(step_traces.contains(id), "kept trace {id} keeps its steps");
    }
    let db = open_store_db(dir.path());
    let count = |sql: &str| -> i64 { db.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(
        count("SELECT COUNT(*) FROM steps WHERE trace_id NOT IN (SELECT id FROM traces)"),
        0
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM trajectories WHERE trajectory_id NOT IN (SELECT trajectory_id FROM steps)"),
        0
    );
    assert!(count("SELECT COUNT(*) FROM trajectories") > 0);
    assert_eq!(
        count("SELECT COUNT(*) FROM export_log WHERE kind = 'chat' AND ref NOT IN (SELECT id FROM traces)"),
        0
    );
}

/// `retention_days`: traces that started longer ago than that are removed at start, with what was derived from
/// them; recent ones stay. Age is set by moving two stored traces' start times back 40 days (the store is the
/// only place llmtap reads them from).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_days_removes_traces_older_than_the_limit() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "[store]\nretention_days = 30\n");
    let ids: Vec<String> = record_calls(&config, dir.path(), &json_calls(4))
        .await
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_owned())
        .collect();
    let old = &ids[..2];
    let db = open_store_db(dir.path());
    let forty_days_us: i64 = 40 * 86_400 * 1_000_000;
    for id in old {
        let n = db
            .execute(
                "UPDATE traces SET started_us = started_us - ?1 WHERE id = ?2",
                rusqlite::params![forty_days_us, id],
            )
            .unwrap();
        assert_eq!(n, 1);
    }
    drop(db);

    let tap = Llmtap::start(&config, dir.path());
    let left = tap.wait_for_at_most_traces(2);
    let left: Vec<&str> = left.iter().filter_map(|t| t["id"].as_str()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(
        left.iter().all(|id| !old.iter().any(|o| o == id)),
        "the two aged traces went"
    );
    let step_traces: Vec<String> = tap
        .export("steps", &[])
        .iter()
        .filter_map(|s| s["provider_trace_id"].as_str().map(str::to_owned))
        .collect();
    assert!(step_traces.iter().all(|t| !old.contains(t)), "their steps went too");
    assert_eq!(tap.metric("llmtap_evicted_total"), 2);
}
