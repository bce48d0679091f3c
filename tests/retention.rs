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

/// Annotations go with what retention removes (a note may quote the conversation it is about): a removed call's
/// step annotation, and the trajectory's and session's annotations once their last call is gone; those on what
/// is kept stay. Annotated through the viewer's API, trimmed by a restart with `max_traces`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotations_go_with_what_retention_removes() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let traces = record_calls(&upstream_config(&up, ""), dir.path(), &json_calls(6)).await;

    let mut tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let client = client();
    let steps = tap.export("steps", &[]);
    let mut step_labels = std::collections::BTreeMap::new();
    for (i, t) in traces.iter().enumerate() {
        let step = steps
            .iter()
            .find(|s| s["provider_trace_id"] == t["id"])
            .unwrap_or_else(|| panic!("a step of {}", t["id"]));
        let trajectory = step["trajectory_id"].as_str().unwrap();
        let reply = send(
            &client,
            "GET",
            &format!("{base}/api/sessions/{trajectory}"),
            &[],
            Vec::new(),
        )
        .await;
        assert_eq!(reply.status, 200);
        let session: Value = serde_json::from_slice(&reply.body).unwrap();
        let label = format!("call-{i}");
        for (target, id) in [
            ("step", step["step_id"].as_str().unwrap()),
            ("trajectory", trajectory),
            ("session", session["id"].as_str().unwrap()),
        ] {
            let body = serde_json::json!({"target": target, "id": id, "label": label, "note": "quotes the call"});
            let reply = send(
                &client,
                "POST",
                &format!("{base}/api/annotations"),
                &[("content-type", "application/json")],
                serde_json::to_vec(&body).unwrap(),
            )
            .await;
            assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        }
        step_labels.insert(t["id"].as_str().unwrap().to_owned(), label);
    }
    assert!(tap.terminate().success());

    let tap = Llmtap::start(&upstream_config(&up, "[store]\nmax_traces = 3\n"), dir.path());
    let kept = tap.wait_for_at_most_traces(3);
    assert_eq!(kept.len(), 3);
    let db = open_store_db(dir.path());
    let strings = |sql: &str| -> Vec<String> {
        let mut stmt = db.prepare(sql).unwrap();
        let rows = stmt.query_map([], |r| r.get::<_, String>(0)).unwrap();
        let mut v: Vec<String> = rows.map(Result::unwrap).collect();
        v.sort();
        v
    };
    let mut want: Vec<String> = kept
        .iter()
        .map(|t| step_labels[t["id"].as_str().unwrap()].clone())
        .collect();
    want.sort();
    assert_eq!(
        strings("SELECT label FROM annotations WHERE target = 'step'"),
        want,
        "the kept calls' step annotations stay, the removed ones' go"
    );
    let orphans = |sql: &str| strings(sql).len();
    assert_eq!(
        orphans(
            "SELECT id FROM annotations WHERE trajectory_id IS NOT NULL
             AND trajectory_id NOT IN (SELECT trajectory_id FROM trajectories)"
        ),
        0,
        "no annotation of a removed trajectory"
    );
    assert_eq!(
        orphans(
            "SELECT id FROM annotations WHERE target = 'session'
             AND session_key NOT IN (SELECT COALESCE(session_id, trajectory_id) FROM trajectories)"
        ),
        0,
        "no annotation of a removed session"
    );
    // The kept calls' trajectories and sessions keep theirs.
    for label in &want {
        let n = db
            .query_row("SELECT COUNT(*) FROM annotations WHERE label = ?1", [label], |r| {
                r.get::<_, i64>(0)
            })
            .unwrap();
        assert_eq!(n, 3, "{label}: step, trajectory and session annotations kept");
    }
}
