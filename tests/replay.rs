//! `llmtap replay` through the real binary: a call captured from a client is re-sent, edited, through the
//! running llmtap to a scripted upstream with the user's key from the environment; the upstream gets the edit and
//! that key (and none of llmtap's own headers), the replay streams as the original did, is captured like any
//! other call and linked both ways (the viewer's JSON API), and the key is in neither the store's files nor the
//! log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;

use common::scripted::Scripted;
use common::*;
use serde_json::{Value, json};

/// The user's key for the replay: a value found nowhere else.
const REPLAY_KEY: &str = "sk-ant-replay-6f1d2c9e8b7a4f30a1b2";
/// The key the original call was sent with.
const ORIGINAL_KEY: &str = "sk-ant-original-0c0ffee0c0ffee";

fn original_request() -> Value {
    json!({
        "model": "claude-sonnet-4-20250514",
        "max_tokens": 50,
        "stream": true,
        "messages": [{"role": "user", "content": "Say hi, replay test"}],
    })
}

/// Send the original streaming Anthropic call through llmtap, as an SDK would (key in `x-api-key`); returns its
/// stored trace.
async fn original_call(tap: &Llmtap) -> Value {
    let r = send(
        &client(),
        "POST",
        &tap.url("/anthropic/v1/messages"),
        &[
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "prompt-caching-2024-07-31"),
            ("x-api-key", ORIGINAL_KEY),
            ("x-llmtap-agent", "replay-test-agent"),
        ],
        serde_json::to_vec(&original_request()).unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    tap.wait_for_traces(1).remove(0)
}

/// Every file under `dir` (the store, its WAL, the spill...), with the paths of those containing `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> (usize, Vec<String>) {
    let mut files = 0;
    let mut hits = Vec::new();
    for path in files_under(dir) {
        let bytes = std::fs::read(&path).unwrap_or_default();
        files += 1;
        if bytes.windows(needle.len()).any(|w| w == needle) {
            hits.push(path.display().to_string());
        }
    }
    (files, hits)
}

fn replay_command(tap: &Llmtap, args: &[&str]) -> std::process::Command {
    let mut c = llmtap_command();
    c.arg("replay")
        .args(args)
        .arg("--proxy")
        .arg(tap.addr.to_string())
        .arg("--config")
        .arg(&tap.config_path)
        .arg("--data-dir")
        .arg(&tap.data_dir)
        .env_remove("ANTHROPIC_API_KEY");
    c
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_sends_the_edit_with_the_users_key_streams_is_captured_linked_and_keeps_the_key_out_of_store_and_log() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Debug logging: whatever llmtap logs about requests, the key must not be in it.
    let (tap, log) =
        Llmtap::start_capturing_log_with_env(&upstream_config(&up, ""), dir.path(), &[("RUST_LOG", "debug")]);
    let original = original_call(&tap).await;
    let id = original["id"].as_str().unwrap().to_owned();
    assert_eq!(up.received().len(), 1);

    // Without a key for a call that had one: refused, nothing sent.
    let out = replay_command(&tap, &[&id]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ANTHROPIC_API_KEY"), "{stderr}");
    // A dry run shows the request with the variable in the key's place, and sends nothing.
    let out = replay_command(&tap, &[&id, "--dry-run", "--model", "claude-replayed"])
        .env("ANTHROPIC_API_KEY", REPLAY_KEY)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("x-api-key: $ANTHROPIC_API_KEY"), "{shown}");
    assert!(shown.contains("\"model\":\"claude-replayed\""), "{shown}");
    assert!(!shown.contains(REPLAY_KEY), "{shown}");
    assert_eq!(up.received().len(), 1);

    // The replay: another model, another max_tokens, a message appended.
    let out = replay_command(
        &tap,
        &[
            &id,
            "--model",
            "claude-replayed-9",
            "--set",
            "max_tokens=77",
            "--set",
            "/messages/-={\"role\":\"assistant\",\"content\":\"hi\"}",
        ],
    )
    .env("ANTHROPIC_API_KEY", REPLAY_KEY)
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    // The stream as the provider sent it.
    assert!(
        stdout.contains("event: message_start") && stdout.contains("event: message_stop"),
        "{stdout}"
    );
    let new_id = stderr
        .split("captured as ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no new call id in {stderr:?}"))
        .to_owned();
    assert!(!stdout.contains(REPLAY_KEY) && !stderr.contains(REPLAY_KEY));

    // What the upstream got: the edits, the user's key where the original had one, the provider's headers,
    // none of llmtap's.
    let received = up.received();
    assert_eq!(received.len(), 2);
    let replayed = &received[1];
    assert_eq!(replayed.path, "/v1/messages");
    assert_eq!(replayed.headers["x-api-key"], REPLAY_KEY);
    assert_eq!(replayed.headers["anthropic-version"], "2023-06-01");
    assert_eq!(replayed.headers["anthropic-beta"], "prompt-caching-2024-07-31");
    assert!(replayed.headers.get("authorization").is_none());
    assert!(
        !replayed.headers.keys().any(|k| k.as_str().starts_with("x-llmtap-")),
        "{:?}",
        replayed.headers
    );
    let body: Value = serde_json::from_slice(&replayed.body).unwrap();
    let mut want = original_request();
    want["model"] = "claude-replayed-9".into();
    want["max_tokens"] = 77.into();
    want["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": "hi"}));
    assert_eq!(body, want);

    // Captured like any other call, streamed and reassembled, in a session of its own.
    let traces = tap.wait_for_traces(2);
    let new = traces.iter().find(|t| t["id"] == new_id.as_str()).unwrap();
    assert_eq!(new["streamed"], true);
    assert_eq!(new["status"], 200);
    assert_eq!(new["model"], "claude-replayed-9");
    assert!(new["response"]["content"].is_array(), "{new:#}");
    assert!(new["session_id"].as_str().unwrap().starts_with("replay-"), "{new:#}");
    assert_ne!(new["trajectory_id"], original["trajectory_id"]);
    // Linked: the replay names its original, the original lists its replay (the viewer's JSON API).
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let of_new = get_json(&format!("{base}/api/calls/{new_id}/replay")).await;
    assert_eq!(of_new["replay_of"], id.as_str());
    let of_original = get_json(&format!("{base}/api/calls/{id}/replay")).await;
    let replays: Vec<&Value> = of_original["replays"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["id"])
        .collect();
    assert_eq!(replays, [&Value::from(new_id.as_str())]);
    assert_eq!(of_original["replays"][0]["model"], "claude-replayed-9");
    assert!(of_original["replay_of"].is_null());
    // The link header is recorded with the trace's request headers.
    let headers = new["headers"]["request"].to_string();
    assert!(
        headers.contains(&format!("\"x-llmtap-replay-of\":\"{id}\"")),
        "{headers}"
    );

    // Neither key anywhere in llmtap's data dir (the store, its WAL) nor in its log.
    tap.wait_settled();
    for key in [REPLAY_KEY, ORIGINAL_KEY] {
        let (files, hits) = files_containing(dir.path(), key.as_bytes());
        assert!(files >= 2, "the store's files were scanned");
        assert!(hits.is_empty(), "{key} found in {hits:?}");
        let lines = log.lock().unwrap();
        assert!(!lines.is_empty(), "debug logging produced lines");
        assert!(!lines.iter().any(|l| l.contains(key)), "{key} in the log");
    }
}

async fn get_json(url: &str) -> Value {
    let r = send(&client(), "GET", url, &[], Vec::new()).await;
    assert_eq!(r.status, 200, "{url}: {}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

/// With the shared store (`[store] url`): the CLI reads the original from PostgreSQL and finds its replay there,
/// and the viewer (which reads the shared store) links the two, through PostgreSQL's `replays_of`.
#[tokio::test(flavor = "multi_thread")]
async fn replays_are_found_and_linked_in_the_shared_store() {
    let pg = postgres::server();
    let url = pg.database("replay");
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream_config(&up, &format!("[store]\nurl = \"{url}\"\n")),
        dir.path(),
    );
    let original = original_call(&tap).await;
    let id = original["id"].as_str().unwrap().to_owned();
    // Delivered to PostgreSQL (its shared-store sink runs behind the local store).
    let delivered = |n: usize| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let tables = pg.psql(&url, "SELECT to_regclass('public.traces') IS NOT NULL");
            if tables.trim() == "t"
                && pg
                    .psql(&url, "SELECT count(*) FROM traces")
                    .trim()
                    .parse::<usize>()
                    .unwrap()
                    >= n
            {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{n} traces not delivered to PostgreSQL"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    delivered(1);
    // An empty data dir of its own: the CLI can only read the shared store.
    let empty = tempfile::tempdir().unwrap();
    let out = llmtap_command()
        .args([
            "replay",
            &id,
            "--set",
            "max_tokens=5",
            "--proxy",
            &tap.addr.to_string(),
            "--store",
            &url,
        ])
        .arg("--data-dir")
        .arg(empty.path())
        .env("ANTHROPIC_API_KEY", REPLAY_KEY)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let new_id = stderr
        .split("captured as ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    assert_eq!(up.received()[1].headers["x-api-key"], REPLAY_KEY);
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let of_original = get_json(&format!("{base}/api/calls/{id}/replay")).await;
    assert_eq!(of_original["replays"][0]["id"], new_id.as_str());
    let of_new = get_json(&format!("{base}/api/calls/{new_id}/replay")).await;
    assert_eq!(of_new["replay_of"], id.as_str());
    // The lookup is the partial index's.
    let plan = pg.psql(
        &url,
        &format!(
            "SET enable_seqscan = off; EXPLAIN SELECT id FROM traces WHERE (head::jsonb -> 'meta' ->> 'replay_of') = '{id}'"
        ),
    );
    assert!(plan.contains("traces_replay_of"), "{plan}");
    assert!(pg.psql(&url, "SELECT head FROM traces").find(REPLAY_KEY).is_none());
}
