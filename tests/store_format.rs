//! The store's body format through the real binary: bodies are written as zstd frames, and a store whose
//! bodies an earlier build wrote as zlib streams still reads back (an upgrade keeps the history readable).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;

use common::*;
use serde_json::Value;

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

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

    // As written: zstd frames holding exactly the captured JSON text.
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
            assert!(blob.starts_with(&ZSTD_MAGIC), "{id}: a zstd frame");
            let text = zstd::decode_all(&blob[..]).unwrap();
            serde_json::from_slice::<Value>(&text).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
    }

    // One trace's bodies rewritten as an earlier build stored them (zlib), the other left as zstd.
    let (old_id, request, response) = &rows[0];
    db.execute(
        "UPDATE trace_bodies SET request = ?1, response = ?2 WHERE trace_id = ?3",
        rusqlite::params![
            zlib(&zstd::decode_all(&request[..]).unwrap()),
            zlib(&zstd::decode_all(&response[..]).unwrap()),
            old_id
        ],
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
}
