//! Content-addressed request bodies: each repeated part of a request is stored once.
//!
//! An agent's every request carries the whole conversation so far (and the system prompt and tool definitions
//! again), so storing each body whole grows with the square of the conversation's length. The store instead
//! splits a request's JSON text into **chunks** at a level every provider's conversation lives on: each member
//! of a top-level array (`messages`, `input`, `contents`, `tools`, `system` blocks, ...) and each top-level
//! string value (`instructions`, a string `system`). A chunk of at least [`MIN_CHUNK`] bytes is stored once in
//! `chunks`, keyed by its SHA-256; the body becomes a **manifest**: the bytes between chunks (the glue: keys,
//! brackets, commas, small members) inline, and the chunks by their row id. Generic over providers: the split is
//! on the JSON's shape, not on field names, so a new API needs nothing here.
//!
//! Reassembly is byte-exact: the manifest is a cover of the original bytes in order (glue, chunk, glue, ...),
//! so what the client sent is what a reader gets back, whitespace and key order included (the test
//! `every_fixture_body_reads_back_identical` checks every recorded body).
//!
//! Manifests name chunks by row id (varint deltas from the previous id), not by hash: a 100-message body's
//! manifest is then ~100 bytes before compression, where hashes would be 3.2 KB of incompressible bytes per
//! call — at 100 calls the manifests alone would outweigh the conversation. The hash is the unique key that
//! finds an existing chunk.
//!
//! Retention: each chunk counts the manifests referring to it (`refs`, once per reference). The writer adds
//! a batch's references in one update per distinct chunk; retention subtracts those of the bodies it deletes
//! and deletes chunks left at zero. A trace replaced under the same id keeps its old references: the chunk then
//! outlives its last reader (never the reverse).
//!
//! Blob formats in `trace_bodies.request`: a manifest starts with [`MANIFEST_MAGIC`] then the entries as
//! `codec.rs` stores a body (a zstd frame, or plain when short); whole bodies (every response, small requests,
//! rows written before this existed) are zstd frames, plain bodies or zlib streams (see `codec.rs`). `LTM1` is
//! neither a zstd magic nor a valid zlib header (zlib's first byte has
//! compression method 8 in its low nibble; `L` is 0x4C).

use rusqlite::{Connection, OptionalExtension, Transaction};
use rustc_hash::FxHashMap;
use sha2::{Digest, Sha256};

use super::StoreError;
use super::codec::{compress, compress_frame, decompress};

/// The first bytes of a manifest blob.
pub const MANIFEST_MAGIC: [u8; 4] = *b"LTM1";

/// Smaller parts stay inline in the manifest: a chunk costs a row (~80 bytes with its hash and index entry),
/// more than a short message saves.
pub const MIN_CHUNK: usize = 128;

/// Bodies below this are stored whole: too small for a chunk to pay off.
const MIN_BODY: usize = 2 * MIN_CHUNK;

/// Chunk ids the writer remembers by hash, so that a repeated chunk costs no lookup. Cleared when full and
/// whenever retention deletes chunks (a remembered id could then point at nothing).
const CACHE_ENTRIES: usize = 1 << 16;

/// The byte ranges of `body` that become chunks, in order and disjoint: members of top-level arrays and
/// top-level string values, of at least [`MIN_CHUNK`] bytes. Empty when the text is not a JSON object (or not
/// well nested): such a body is stored whole.
pub fn chunk_spans(body: &str) -> Vec<std::ops::Range<usize>> {
    let b = body.as_bytes();
    let mut spans = Vec::new();
    // Depth of nesting; whether depth 1 is an object and depth 2 an array inside it.
    let mut depth = 0usize;
    let mut top_object = false;
    let mut in_array = false;
    // Inside a top-level object: the next string is a value (after ':'), not a key.
    let mut expect_value = false;
    let mut in_string = false;
    // The open span (an array member or a top-level string value) and where its last byte so far ends.
    let mut start: Option<usize> = None;
    let mut end = 0usize;
    let mut push = |start: &mut Option<usize>, end: usize| {
        if let Some(s) = start.take()
            && end - s >= MIN_CHUNK
        {
            spans.push(s..end);
        }
    };
    let mut i = 0;
    while i < b.len() {
        if in_string {
            // Most of a body is string content: jump to the next quote or backslash instead of stepping.
            let Some(k) = memchr::memchr2(b'"', b'\\', &b[i..]) else {
                return Vec::new();
            };
            i += k;
            if b[i] == b'\\' {
                // The escaped byte cannot end the string (a `\uXXXX` escape's digits are plain bytes).
                i += 2;
                continue;
            }
            in_string = false;
            end = i + 1;
            // A top-level string value ends with its closing quote.
            if depth == 1 && start.is_some() {
                push(&mut start, end);
            }
            i += 1;
            continue;
        }
        let c = b[i];
        let member_starts = depth == 2 && in_array && start.is_none();
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => {
                i += 1;
                continue;
            }
            b'"' => {
                in_string = true;
                if member_starts || (depth == 1 && top_object && expect_value) {
                    start = Some(i);
                }
                if depth == 1 {
                    expect_value = false;
                }
            }
            b'{' | b'[' => {
                if member_starts {
                    start = Some(i);
                }
                depth += 1;
                match depth {
                    1 => top_object = c == b'{',
                    2 => {
                        in_array = top_object && c == b'[';
                        expect_value = false;
                    }
                    _ => {}
                }
            }
            b'}' | b']' => {
                if depth == 0 {
                    return Vec::new();
                }
                if depth == 2 && in_array {
                    // The array itself closes: its last member ends at the last byte before.
                    push(&mut start, end);
                    in_array = false;
                }
                depth -= 1;
            }
            b',' if depth == 2 && in_array => {
                push(&mut start, end);
                i += 1;
                continue;
            }
            b':' if depth == 1 => expect_value = true,
            b',' if depth == 1 => expect_value = false,
            _ => {
                if member_starts {
                    start = Some(i);
                }
                if depth == 1 {
                    expect_value = false;
                }
            }
        }
        end = i + 1;
        i += 1;
    }
    if depth != 0 || in_string || !top_object {
        return Vec::new();
    }
    spans
}

/// The writer's memory of chunk ids by hash, plus what the current batch added (kept apart until it commits:
/// a rolled-back batch's new ids do not exist).
#[derive(Default)]
pub struct ChunkCache {
    known: FxHashMap<[u8; 32], i64>,
    pending: Vec<([u8; 32], i64)>,
    /// References added by the current batch, per chunk id (written by [`ChunkCache::flush_refs`]).
    refs: FxHashMap<i64, i64>,
}

impl ChunkCache {
    /// The batch committed: its new chunks are known from now on.
    pub fn committed(&mut self) {
        if self.known.len() + self.pending.len() > CACHE_ENTRIES {
            self.known.clear();
        }
        self.known.extend(self.pending.drain(..));
        self.refs.clear();
    }

    /// The batch failed: forget what it added.
    pub fn rolled_back(&mut self) {
        self.pending.clear();
        self.refs.clear();
    }

    /// Chunks were deleted: no remembered id can be trusted.
    pub fn forget(&mut self) {
        self.known.clear();
        self.pending.clear();
    }

    fn lookup(&self, hash: &[u8; 32]) -> Option<i64> {
        self.known
            .get(hash)
            .copied()
            .or_else(|| self.pending.iter().find(|(h, _)| h == hash).map(|(_, id)| *id))
    }

    /// Write the batch's reference counts: one update per distinct chunk.
    pub fn flush_refs(&mut self, tx: &Transaction<'_>) -> Result<(), StoreError> {
        if self.refs.is_empty() {
            return Ok(());
        }
        let mut stmt = tx.prepare_cached("UPDATE chunks SET refs = refs + ?2 WHERE id = ?1")?;
        for (id, n) in self.refs.drain() {
            stmt.execute([id, n])?;
        }
        Ok(())
    }
}

/// The blob stored for a request body: a manifest when the body has chunks, else the whole body compressed.
/// New chunks are inserted; references are counted in `cache` (written by [`ChunkCache::flush_refs`]).
pub fn store_request(tx: &Transaction<'_>, cache: &mut ChunkCache, body: &str) -> Result<Vec<u8>, StoreError> {
    let spans = if body.len() >= MIN_BODY {
        chunk_spans(body)
    } else {
        Vec::new()
    };
    if spans.is_empty() {
        return Ok(compress(body));
    }
    let mut entries = Vec::with_capacity(spans.len() * 3 + 16);
    let mut at = 0;
    let mut last_id = 0i64;
    for span in spans {
        literal(&mut entries, &body.as_bytes()[at..span.start]);
        let id = chunk_id(tx, cache, &body[span.clone()])?;
        *cache.refs.entry(id).or_insert(0) += 1;
        // Ids as deltas: a conversation's chunks were mostly stored one after another, so most deltas are +1.
        put_varint(&mut entries, (zigzag(id.wrapping_sub(last_id)) << 1) | 1);
        last_id = id;
        at = span.end;
    }
    literal(&mut entries, &body.as_bytes()[at..]);
    let mut blob = MANIFEST_MAGIC.to_vec();
    blob.extend(compress_bytes(&entries));
    Ok(blob)
}

fn literal(out: &mut Vec<u8>, bytes: &[u8]) {
    if !bytes.is_empty() {
        put_varint(out, (bytes.len() as u64) << 1);
        out.extend_from_slice(bytes);
    }
}

fn chunk_id(tx: &Transaction<'_>, cache: &mut ChunkCache, text: &str) -> Result<i64, StoreError> {
    let hash: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    if let Some(id) = cache.lookup(&hash) {
        return Ok(id);
    }
    let found: Option<i64> = tx
        .prepare_cached("SELECT id FROM chunks WHERE hash = ?1")?
        .query_row([&hash[..]], |r| r.get(0))
        .optional()?;
    let id = match found {
        Some(id) => id,
        None => {
            tx.prepare_cached("INSERT INTO chunks (hash, refs, data) VALUES (?1, 0, ?2)")?
                .execute(rusqlite::params![&hash[..], compress_frame(text)])?;
            tx.last_insert_rowid()
        }
    };
    cache.pending.push((hash, id));
    Ok(id)
}

/// A stored request blob back as text: manifests are reassembled from their chunks, whole bodies
/// decompressed. None if anything is missing or damaged (the reader reports the body as unreadable).
pub fn load_request(conn: &Connection, blob: Option<Vec<u8>>) -> Option<String> {
    let blob = blob?;
    let Some(payload) = blob.strip_prefix(&MANIFEST_MAGIC) else {
        return decompress(Some(blob));
    };
    let entries = super::codec::decompress_bytes(payload)?;
    let mut out = Vec::with_capacity(entries.len() * 4);
    let mut stmt = conn.prepare_cached("SELECT data FROM chunks WHERE id = ?1").ok()?;
    let mut rest = &entries[..];
    let mut last_id = 0i64;
    while !rest.is_empty() {
        let tag = get_varint(&mut rest)?;
        if tag & 1 == 1 {
            let id = last_id.wrapping_add(unzigzag(tag >> 1));
            last_id = id;
            let data: Option<Vec<u8>> = stmt.query_row([id], |r| r.get(0)).optional().ok()?;
            out.extend_from_slice(decompress(data)?.as_bytes());
        } else {
            let len = usize::try_from(tag >> 1).ok()?;
            let bytes = rest.get(..len)?;
            out.extend_from_slice(bytes);
            rest = &rest[len..];
        }
    }
    String::from_utf8(out).ok()
}

/// The chunk ids a stored blob refers to (once per reference); empty for a whole body.
pub fn referenced(blob: &[u8]) -> Vec<i64> {
    let Some(payload) = blob.strip_prefix(&MANIFEST_MAGIC) else {
        return Vec::new();
    };
    let Some(entries) = super::codec::decompress_bytes(payload) else {
        return Vec::new();
    };
    let mut ids = Vec::new();
    let mut rest = &entries[..];
    let mut last_id = 0i64;
    while let Some(tag) = get_varint(&mut rest) {
        if tag & 1 == 1 {
            last_id = last_id.wrapping_add(unzigzag(tag >> 1));
            ids.push(last_id);
        } else {
            let Some(len) = usize::try_from(tag >> 1).ok().filter(|l| *l <= rest.len()) else {
                break;
            };
            rest = &rest[len..];
        }
    }
    ids
}

/// Drop the references held by the request bodies of the traces in temp table `retired_traces`, then delete
/// the chunks nobody refers to any more. Returns how many chunks went. Runs inside retention's transaction.
pub fn release_retired(conn: &Connection) -> Result<u64, StoreError> {
    let mut counts: FxHashMap<i64, i64> = FxHashMap::default();
    {
        let mut stmt = conn.prepare(
            "SELECT request FROM trace_bodies WHERE trace_id IN (SELECT id FROM retired_traces)
             AND substr(request, 1, 4) = ?1",
        )?;
        let mut rows = stmt.query([&MANIFEST_MAGIC[..]])?;
        while let Some(row) = rows.next()? {
            let blob: Vec<u8> = row.get(0)?;
            for id in referenced(&blob) {
                *counts.entry(id).or_insert(0) += 1;
            }
        }
    }
    let mut deleted = 0;
    let mut release = conn.prepare_cached("UPDATE chunks SET refs = refs - ?2 WHERE id = ?1")?;
    let mut delete = conn.prepare_cached("DELETE FROM chunks WHERE id = ?1 AND refs <= 0")?;
    for (id, n) in counts {
        release.execute([id, n])?;
        deleted += delete.execute([id])? as u64;
    }
    Ok(deleted)
}

fn compress_bytes(bytes: &[u8]) -> Vec<u8> {
    super::codec::compress_bytes(bytes)
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(input: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = input.split_first()?;
        *input = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans_text(body: &str) -> Vec<&str> {
        chunk_spans(body).into_iter().map(|r| &body[r]).collect()
    }

    #[test]
    fn members_of_top_level_arrays_and_long_top_level_strings_are_chunks() {
        let long = "x".repeat(MIN_CHUNK);
        let body = format!(
            r#"{{ "model": "m", "instructions": "{long}", "messages": [ {{"role":"user","content":"{long}"}} , "{long}",
            [1, 2, {{"k": "{long}"}}], 3 ], "n": {{"deep": ["{long}"]}}, "short": ["a", "b"] }}"#
        );
        let got = spans_text(&body);
        assert_eq!(
            got,
            vec![
                format!("\"{long}\""),
                format!(r#"{{"role":"user","content":"{long}"}}"#),
                format!("\"{long}\""),
                format!(r#"[1, 2, {{"k": "{long}"}}]"#),
            ],
            "nested arrays below the top level and short members are glue"
        );
        // Keys are never chunks, even long ones; a quote or bracket inside a string changes nothing.
        let tricky = format!(r#"{{"{long}": 1, "m": ["a\"],[{{\\", "{long}\"]"]}}"#);
        assert_eq!(spans_text(&tricky), vec![format!(r#""{long}\"]""#)]);
    }

    #[test]
    fn what_is_not_a_json_object_has_no_chunks() {
        let long = "y".repeat(400);
        for body in [
            format!(r#"["{long}", "{long}"]"#),
            format!(r#"{{"m": ["{long}", "{long}"]"#),
            format!(r#"{{"m": ["{long}"]}}]}}"#),
            format!(r#"{{"m": "{long}"#),
            String::new(),
        ] {
            assert!(chunk_spans(&body).is_empty(), "{body}");
        }
    }

    use crate::config::StoreConfig;
    use crate::model::exchange::Api;
    use crate::model::json::JsonText;
    use crate::model::record::Record;
    use crate::telemetry::Metrics;

    fn fixture_files() -> Vec<std::path::PathBuf> {
        fn walk(p: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                let path = e.path();
                if path.is_dir() {
                    walk(&path, out);
                } else {
                    out.push(path);
                }
            }
        }
        let mut out = Vec::new();
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
            &mut out,
        );
        out.sort();
        out
    }

    fn trace(n: i64, request: &str) -> Record {
        let mut t = crate::derive::testkit::trace(Api::OpenAiChat, n, n + 1);
        t.request = JsonText::from_redacted(request.to_owned());
        Record::Trace(Box::new(t))
    }

    fn write(conn: &mut Connection, cache: &mut ChunkCache, records: &[Record]) {
        super::super::write::write_batch(conn, records, cache).unwrap_or_else(|e| panic!("{e}"));
    }

    fn count(conn: &Connection, sql: &str) -> i64 {
        conn.query_row(sql, [], |r| r.get(0)).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every recorded file (requests, JSON and SSE responses, whatever their whitespace) stored as a request
    /// reads back byte for byte, each on its own and again once all the others' chunks are in the table.
    #[test]
    fn every_fixture_body_reads_back_identical() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut cache = ChunkCache::default();
        let texts: Vec<String> = fixture_files()
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .filter(|t| !t.is_empty() && t != "null")
            .collect();
        assert!(texts.len() > 50, "{}", texts.len());
        let records: Vec<Record> = texts.iter().enumerate().map(|(i, t)| trace(i as i64, t)).collect();
        let mut rows = Vec::new();
        for pass in 0..2 {
            write(&mut conn, &mut cache, &records);
            rows.push(count(&conn, "SELECT COUNT(*) FROM chunks"));
            let reader = super::super::StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
            let mut manifests = 0;
            for (i, text) in texts.iter().enumerate() {
                let t = reader
                    .trace(&format!("trace-{i}"))
                    .unwrap_or_else(|e| panic!("{e}"))
                    .unwrap_or_else(|| panic!("trace-{i}"));
                assert_eq!(t.request.as_str(), text.as_str(), "pass {pass}, body {i}");
                let blob: Vec<u8> = conn
                    .query_row(
                        "SELECT request FROM trace_bodies WHERE trace_id = ?1",
                        [format!("trace-{i}")],
                        |r| r.get(0),
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                manifests += usize::from(blob.starts_with(&MANIFEST_MAGIC));
            }
            assert!(
                manifests > texts.len() / 3,
                "most recorded requests have chunks: {manifests}"
            );
        }
        assert!(
            rows[0] > 0 && rows[0] == rows[1],
            "the same bodies again add no chunks: {rows:?}"
        );
    }

    /// A conversation growing by one message per call stores each message once, and retention deletes a
    /// chunk exactly when no kept body refers to it.
    #[test]
    fn a_growing_conversation_stores_each_message_once_and_retention_frees_unreferenced_chunks() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut cache = ChunkCache::default();
        let message = |i: usize| format!(r#"{{"role":"user","content":"message {i} {}"}}"#, "z".repeat(200));
        let body = |n: usize| {
            let messages: Vec<String> = (0..n).map(message).collect();
            format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
        };
        let calls = 20;
        let records: Vec<Record> = (1..=calls).map(|n| trace(n as i64, &body(n))).collect();
        // Two batches, so that the second finds the first's chunks in the table or the cache.
        write(&mut conn, &mut cache, &records[..7]);
        write(&mut conn, &mut cache, &records[7..]);
        assert_eq!(
            count(&conn, "SELECT COUNT(*) FROM chunks"),
            calls as i64,
            "one chunk per message"
        );
        // Message i is in calls i+1..=calls.
        assert_eq!(
            count(&conn, "SELECT SUM(refs) FROM chunks"),
            (calls * (calls + 1) / 2) as i64
        );

        let metrics = Metrics::default();
        let keep = 5;
        let config = StoreConfig {
            max_traces: keep,
            retention_days: 0,
            ..StoreConfig::default()
        };
        let deleted = super::super::read::apply_retention(&conn, &config, &metrics).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(deleted, 0, "the newest call refers to every message");
        assert_eq!(count(&conn, "SELECT COUNT(*) FROM chunks"), calls as i64);
        let kept_refs: usize = (calls - keep as usize + 1..=calls).sum();
        assert_eq!(count(&conn, "SELECT SUM(refs) FROM chunks"), kept_refs as i64);
        let reader = super::super::StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        for t in reader.traces(&Default::default()).unwrap_or_else(|e| panic!("{e}")) {
            let n: usize =
                t.id.trim_start_matches("trace-")
                    .parse()
                    .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(t.request.as_str(), body(n));
        }

        // A new conversation; then retention down to its one call frees every chunk of the first.
        write(
            &mut conn,
            &mut cache,
            &[trace(
                1000,
                &format!(r#"{{"messages":[{},{}]}}"#, message(998), message(999)),
            )],
        );
        let config = StoreConfig {
            max_traces: 1,
            ..config
        };
        let deleted = super::super::read::apply_retention(&conn, &config, &metrics).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(deleted, calls as u64);
        assert_eq!(count(&conn, "SELECT COUNT(*) FROM chunks"), 2);
        assert_eq!(count(&conn, "SELECT SUM(refs) FROM chunks"), 2);
        cache.forget();
        // The freed message comes back as a new chunk when a body needs it again.
        write(&mut conn, &mut cache, &[trace(1001, &body(2))]);
        let t = reader
            .trace("trace-1001")
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("stored"));
        assert_eq!(t.request.as_str(), body(2));
    }

    #[test]
    fn varints_and_zigzag_round_trip() {
        for v in [0i64, 1, -1, 63, -64, 1 << 40, i64::MAX, i64::MIN] {
            let mut buf = Vec::new();
            put_varint(&mut buf, zigzag(v));
            let mut rest = &buf[..];
            assert_eq!(get_varint(&mut rest).map(unzigzag), Some(v));
            assert!(rest.is_empty());
        }
        assert_eq!(get_varint(&mut &[0x80u8][..]), None, "cut varint");
    }
}
