//! The store's body format through the real binary: bodies are written as zstd frames, or plain behind a magic
//! and a CRC-32 when shorter than 1 KB (requests with repeated parts as manifests of content-addressed chunks,
//! see `store/chunks.rs` and `store/codec.rs`), and a store whose bodies an earlier build wrote as zlib streams
//! still reads back (an upgrade keeps the history readable). A store of schema v8 is upgraded in place to v9's
//! indexes and reads back as before.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;

use common::*;
use serde_json::Value;

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
const MANIFEST_MAGIC: [u8; 4] = *b"LTM1";
const PLAIN_MAGIC: [u8; 4] = *b"LTP1";
/// Bodies shorter than this are stored plain (`store/codec.rs`).
const PLAIN_BELOW: usize = 1024;

/// The bytes of a body as the store keeps it: a zstd frame of at least [`PLAIN_BELOW`] bytes, or a shorter body
/// plain, after [`PLAIN_MAGIC`] and its CRC-32.
fn stored_bytes(id: &str, blob: &[u8]) -> Vec<u8> {
    if blob.starts_with(&ZSTD_MAGIC) {
        let bytes = zstd::decode_all(blob).unwrap();
        assert!(
            bytes.len() >= PLAIN_BELOW,
            "{id}: {} bytes in a zstd frame",
            bytes.len()
        );
        return bytes;
    }
    assert!(
        blob.starts_with(&PLAIN_MAGIC),
        "{id}: neither a zstd frame nor a plain body"
    );
    let (crc, bytes) = blob[4..].split_at(4);
    assert_eq!(crc, crc32fast::hash(bytes).to_le_bytes(), "{id}: checksum");
    assert!(bytes.len() < PLAIN_BELOW, "{id}: {} bytes plain", bytes.len());
    bytes.to_vec()
}

fn zlib(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_zstd_and_zlib_bodies_of_earlier_builds_still_read() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "");
    let traces = record_calls(&config, dir.path(), &json_calls(2)).await;

    // As written: zstd frames or plain bodies holding exactly the captured JSON text.
    let db = open_store_db(dir.path());
    let rows: Vec<(String, Vec<u8>, Vec<u8>)> = db
        .prepare("SELECT trace_id, request, response FROM trace_bodies ORDER BY trace_id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows.len(), 2);
    for (id, request, response) in &rows {
        for blob in [request, response] {
            if blob.starts_with(&MANIFEST_MAGIC) {
                // A manifest's entries are kept as a body is.
                assert!(!stored_bytes(id, &blob[4..]).is_empty(), "{id}: manifest entries");
                continue;
            }
            let text = stored_bytes(id, blob);
            serde_json::from_slice::<Value>(&text).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
    }

    // Steps are blobs as bodies are; one rewritten as the JSON text an earlier build stored.
    let steps_before = {
        let tap = Llmtap::start(&config, dir.path());
        tap.export("steps", &[])
    };
    assert!(!steps_before.is_empty());
    let (step_seq, step_blob): (i64, Vec<u8>) = db
        .query_row("SELECT seq, body FROM steps ORDER BY seq LIMIT 1", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    let step_text = String::from_utf8(stored_bytes("step", &step_blob)).unwrap();
    db.execute(
        "UPDATE steps SET body = ?1 WHERE seq = ?2",
        rusqlite::params![step_text, step_seq],
    )
    .unwrap();

    // One trace's bodies rewritten as an earlier build stored them (zlib), the other left as zstd.
    let (old_id, _, response) = &rows[0];
    let request = traces.iter().find(|t| t["id"].as_str() == Some(old_id)).unwrap()["request"].to_string();
    db.execute(
        "UPDATE trace_bodies SET request = ?1, response = ?2 WHERE trace_id = ?3",
        rusqlite::params![zlib(request.as_bytes()), zlib(&stored_bytes(old_id, response)), old_id],
    )
    .unwrap();
    drop(db);

    let tap = Llmtap::start(&config, dir.path());
    let reread = tap.export("provider-traces", &[]);
    assert_eq!(reread.len(), 2);
    for t in &traces {
        let again = reread.iter().find(|r| r["id"] == t["id"]).expect("same trace ids");
        assert!(!t["request"].is_null() && !t["response"].is_null(), "{}", t["id"]);
        assert_eq!(again["request"], t["request"], "{}", t["id"]);
        assert_eq!(again["response"], t["response"], "{}", t["id"]);
    }
    assert!(
        reread.iter().any(|r| r["id"].as_str() == Some(old_id)),
        "the rewritten trace is one of them"
    );
    assert_eq!(tap.export("steps", &[]), steps_before, "a text step reads as before");
}

/// An agent session's requests repeat the conversation: the repeated messages are stored once (chunks
/// referenced by several requests) and every request reads back as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_messages_of_a_session_are_stored_once_and_read_back_as_sent() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "");
    let calls = session("pydantic-ai__gemini_tool_loop_5calls");
    assert!(calls.len() >= 3);
    let traces = record_calls(&config, dir.path(), &calls).await;
    for f in &calls {
        let sent: Value = serde_json::from_slice(&f.request).unwrap();
        assert!(
            traces.iter().any(|t| t["request"] == sent),
            "{}: its request reads back as sent",
            f.name
        );
    }
    let db = open_store_db(dir.path());
    let (chunks, refs): (i64, i64) = db
        .query_row("SELECT COUNT(*), COALESCE(SUM(refs), 0) FROM chunks", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert!(chunks > 0, "the session's requests have chunks");
    assert!(
        refs > chunks,
        "some chunks serve several requests: {chunks} chunks, {refs} references"
    );
    let manifests: i64 = db
        .query_row(
            "SELECT COUNT(*) FROM trace_bodies WHERE substr(request, 1, 4) = ?1",
            [&MANIFEST_MAGIC[..]],
            |r| r.get(0),
        )
        .unwrap();
    assert!(manifests >= 2, "{manifests}");
}

/// A store an earlier build (schema v8) left is upgraded by the binary in place: the indexes v9 drops are gone,
/// a conversation that is its own session no longer names itself in the session column, traces and steps carry
/// their trajectory's number (v10), and everything reads back as before, session by session. The v8 store is
/// made from a current one as v8 wrote it: no trajectory numbers, the steps' unique key the step id alone and
/// `traces_trajectory` (undoing v10), each trajectory's session column holding its session key, and the v8
/// indexes in place of v9's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v8_store_is_upgraded_in_place_and_reads_as_before() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "");
    // A handoff (a child trajectory in its parent's session) and a tool loop; the handoff's recording also holds
    // the SDK's own trace uploads (`/v1/traces/ingest`, answered 204), which are not model calls: left out.
    let mut calls: Vec<Fixture> = session("openllmetry__openai_agents_sdk_handoff_hierarchy")
        .into_iter()
        .filter(|f| f.status == 200)
        .collect();
    calls.extend(session("pydantic-ai__gemini_tool_loop_5calls"));
    record_calls(&config, dir.path(), &calls).await;
    let read_all = || {
        let tap = Llmtap::start(&config, dir.path());
        let sessions: Vec<String> = tap
            .export("steps", &[])
            .iter()
            .filter_map(|s| s["session_id"].as_str().map(str::to_owned))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let by_session: Vec<Vec<Value>> = sessions
            .iter()
            .map(|s| tap.export("steps", &["--session", s]))
            .collect();
        (tap.export("steps", &[]), tap.export("atif", &[]), sessions, by_session)
    };
    let before = read_all();
    assert!(before.2.len() >= 2, "sessions: {:?}", before.2);
    assert!(before.3.iter().all(|s| !s.is_empty()));

    let db = open_store_db(dir.path());
    db.execute_batch(
        "BEGIN;
         DROP INDEX traces_trajectory_seq;
         ALTER TABLE traces DROP COLUMN trajectory_seq;
         CREATE INDEX traces_trajectory ON traces(trajectory_id);
         DROP INDEX trajectories_seq;
         ALTER TABLE trajectories DROP COLUMN seq;
         CREATE TABLE steps_v9 (seq INTEGER PRIMARY KEY AUTOINCREMENT, step_id TEXT NOT NULL UNIQUE,
             trajectory_id TEXT NOT NULL, session_id TEXT, step_index INTEGER NOT NULL, role TEXT NOT NULL,
             trace_id TEXT, started_us INTEGER NOT NULL, body TEXT NOT NULL);
         INSERT INTO steps_v9 SELECT seq, step_id, trajectory_id, session_id, step_index, role, trace_id,
             started_us, body FROM steps;
         DROP TABLE steps;
         ALTER TABLE steps_v9 RENAME TO steps;
         CREATE INDEX steps_trace ON steps(trace_id);
         COMMIT;
         UPDATE trajectories SET session_id = trajectory_id WHERE session_id IS NULL;
         DROP INDEX trajectories_named_session;
         CREATE INDEX trajectories_session_start ON trajectories(COALESCE(session_id, trajectory_id), started_us);
         CREATE INDEX steps_trajectory ON steps(trajectory_id, step_index);
         PRAGMA user_version = 8;",
    )
    .unwrap();
    let own = rows_naming_their_own_session(&db);
    assert!(own > 0, "some conversation is its own session");
    drop(db);

    let after = read_all();
    assert_eq!(after, before);
    let db = open_store_db(dir.path());
    let version: i64 = db.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(
        version, 14,
        "upgraded to the current schema (v12: the replays index, v13: annotations, v14: search)"
    );
    let own = rows_naming_their_own_session(&db);
    assert_eq!(own, 0);
    let indexes: Vec<String> = db
        .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let unnumbered: i64 = db
        .query_row(
            "SELECT (SELECT COUNT(*) FROM steps WHERE trajectory_seq IS NULL)
                  + (SELECT COUNT(*) FROM traces WHERE trajectory_id IS NOT NULL AND trajectory_seq IS NULL)
                  + (SELECT COUNT(*) FROM trajectories WHERE seq IS NULL)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(unnumbered, 0);
    for gone in ["trajectories_session_start", "steps_trajectory", "traces_trajectory"] {
        assert!(!indexes.iter().any(|i| i == gone), "{indexes:?}");
    }
    assert!(indexes.iter().any(|i| i == "trajectories_named_session"), "{indexes:?}");
    assert!(indexes.iter().any(|i| i == "traces_replay_of"), "{indexes:?}");
}
