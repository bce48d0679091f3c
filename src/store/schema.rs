//! Schema and migrations. `PRAGMA user_version` records the version; migrations only ever add.

use rusqlite::Connection;

use super::StoreError;

pub const VERSION: i64 = 14;

const V1: &str = r#"
CREATE TABLE IF NOT EXISTS traces (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT NOT NULL UNIQUE,
    trajectory_id   TEXT,
    session_id      TEXT,
    agent           TEXT,
    upstream        TEXT NOT NULL,
    api             TEXT NOT NULL,
    method          TEXT NOT NULL,
    path            TEXT NOT NULL,
    status          INTEGER,
    outcome         TEXT NOT NULL,
    error           TEXT,
    streamed        INTEGER NOT NULL,
    model           TEXT,
    started_us      INTEGER NOT NULL,
    first_byte_us   INTEGER,
    ended_us        INTEGER NOT NULL,
    request_bytes   INTEGER NOT NULL,
    response_bytes  INTEGER NOT NULL,
    usage           TEXT,
    request_headers TEXT NOT NULL,
    response_headers TEXT NOT NULL,
    metadata        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS traces_session ON traces(session_id);
CREATE INDEX IF NOT EXISTS traces_trajectory ON traces(trajectory_id);
CREATE INDEX IF NOT EXISTS traces_started ON traces(started_us);

-- Bodies apart from the rows: JSON text as zstd frames or, when short, plain (older rows: zlib; see codec.rs).
CREATE TABLE IF NOT EXISTS trace_bodies (
    trace_id     TEXT PRIMARY KEY,
    request      BLOB,
    response     BLOB,
    raw_response BLOB
);

CREATE TABLE IF NOT EXISTS steps (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    step_id        TEXT NOT NULL UNIQUE,
    trajectory_id  TEXT NOT NULL,
    session_id     TEXT,
    step_index     INTEGER NOT NULL,
    role           TEXT NOT NULL,
    trace_id       TEXT,
    started_us     INTEGER NOT NULL,
    body           TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS steps_trajectory ON steps(trajectory_id, step_index);

-- body: the summary without system_prompts/tool_definitions, which live in their own columns and are only
-- rewritten when an update carries them.
CREATE TABLE IF NOT EXISTS trajectories (
    trajectory_id    TEXT PRIMARY KEY,
    session_id       TEXT,
    started_us       INTEGER NOT NULL,
    ended_us         INTEGER NOT NULL,
    body             TEXT NOT NULL,
    system_prompts   TEXT,
    tool_definitions TEXT
);

-- What remote sinks export, in order: 'chat' (an LLM call, ref = trace id, logged with its agent step),
-- 'tools' (a stored step was rewritten: tool results, a retry's answer; ref = step id), 'agent' (a trajectory
-- closed, ref = trajectory id).
CREATE TABLE IF NOT EXISTS export_log (
    seq   INTEGER PRIMARY KEY AUTOINCREMENT,
    kind  TEXT NOT NULL,
    ref   TEXT NOT NULL
);

-- Per-sink export position in export_log (at-least-once delivery).
CREATE TABLE IF NOT EXISTS cursors (
    sink  TEXT PRIMARY KEY,
    seq   INTEGER NOT NULL
);
"#;

/// v2: the OTLP exporter finds a call's agent step by trace id once per span; without an index that was a
/// scan of every step (export slowed to ~55 spans/s at 20k calls).
const V2: &str = r#"
CREATE INDEX IF NOT EXISTS steps_trace ON steps(trace_id);
"#;

/// v3: sessions are a level above trajectories (`llmtap sessions` groups by session, the API filters by it).
const V3: &str = r#"
CREATE INDEX IF NOT EXISTS trajectories_session ON trajectories(session_id);
CREATE INDEX IF NOT EXISTS steps_session ON steps(session_id);
"#;

/// v4: each call's cost in US dollars, priced on the pipeline thread: the total and its five disjoint parts, as
/// exact decimal text ("0.0012345"; SQLite's REAL would round). NULL = unknown (no price for the model, or no
/// usage reported), never 0. Steps and trajectories carry theirs in their JSON bodies (`cost_usd`, and for a
/// trajectory `unpriced_calls`), as they carry their token counts.
const V4_TRACE_COLUMNS: [&str; 6] = [
    "cost_usd",
    "cost_input_usd",
    "cost_cache_read_usd",
    "cost_cache_write_usd",
    "cost_output_usd",
    "cost_reasoning_usd",
];

/// `ALTER TABLE ADD COLUMN` is not idempotent: a migration cut short after some columns were added (the version
/// is written last) must not fail on the next start.
fn add_column_if_missing(conn: &Connection, table: &str, column: &str, decl: &str) -> Result<(), StoreError> {
    let exists: bool = conn
        .prepare(&format!("SELECT 1 FROM pragma_table_info('{table}') WHERE name = ?1"))?
        .exists([column])?;
    if !exists {
        conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {decl}"))?;
    }
    Ok(())
}

/// v5: content-addressed request bodies (see `chunks.rs`). A request body may be a manifest naming rows of
/// `chunks`; rows written before keep their whole-body form and read as before. `refs` counts the manifests'
/// references (retention deletes a chunk at zero); `hash` is the SHA-256 of the chunk's text. Steps written
/// from v5 on keep their JSON as a zstd blob in the same `body` column (older rows: text; SQLite columns take
/// either).
const V5: &str = r#"
CREATE TABLE IF NOT EXISTS chunks (
    id    INTEGER PRIMARY KEY,
    hash  BLOB NOT NULL UNIQUE,
    refs  INTEGER NOT NULL,
    data  BLOB NOT NULL
);
"#;

// v6: `traces.facts`, what the adapter read from each call (`model::trace::CallFacts`, JSON), so that span
// export reads no bodies. Rows written before have NULL and are read from their bodies again.

/// v7: the viewer's sessions list pages through sessions newest first without grouping the table (see
/// `StoreReader::session_page`): it walks trajectories by start (`trajectories_started`) and probes each one's
/// session by its key and start (`trajectories_session_start`, on the same expression as
/// `TrajectorySummary::session_key`). The key index replaces `trajectories_session`: every query that used
/// that one (a session's trajectories, `session_of`, the readers' session filter) asks for the key instead, so
/// the writer maintains one index more than v6, and that one only on insert (a trajectory's start is never
/// updated).
const V7: &str = r#"
DROP INDEX IF EXISTS trajectories_session;
CREATE INDEX IF NOT EXISTS trajectories_session_start
    ON trajectories(COALESCE(session_id, trajectory_id), started_us);
CREATE INDEX IF NOT EXISTS trajectories_started ON trajectories(started_us);
"#;

/// v8: bodies and steps shorter than `codec::PLAIN_BELOW` may be stored plain behind `codec`'s magic and CRC-32
/// instead of a zstd frame (the version says so: an llmtap from before refuses the store, `FutureSchema`,
/// instead of reading those bodies as damaged). And `traces` and `steps` lose their session indexes: a session's
/// rows are found through its trajectories (`TraceFilter::condition`). Session ids are hashes or client UUIDs,
/// so those indexes put two entries per exchange on random pages that each commit rewrites; without them the
/// writer spends ~13% less CPU per exchange (`llmtap-bench store-rate`, see docs/performance.md).
const V8: &str = r#"
DROP INDEX IF EXISTS traces_session;
DROP INDEX IF EXISTS steps_session;
"#;

/// v9: the writer's indexes keyed by a trajectory's hash, which put an entry on a random page for every new
/// trajectory, go where a cheaper path answers the same question (`llmtap-bench store-rate`, see
/// docs/performance.md, "The store writer's cost as the store grows"):
/// - `steps_trajectory` is dropped: a step's id is its trajectory's id, `/` and its index (see
///   `derive::steps`), so the steps unique index already holds a trajectory's steps side by side, as the key
///   range [`trajectory_id/`, `trajectory_id0`) (`sql::steps_of`).
/// - `trajectories.session_id` holds a session only when it is not the trajectory's own id (NULL otherwise;
///   the session key `COALESCE(session_id, trajectory_id)` is the same), and the session index keeps only the
///   rows that have one. A conversation without a session header, its own session, adds no entry to it.
///   Queries ask for a session through `sql::in_session`.
const V9: &str = r#"
DROP INDEX IF EXISTS steps_trajectory;
DROP INDEX IF EXISTS trajectories_session_start;
UPDATE trajectories SET session_id = NULL WHERE session_id = trajectory_id;
CREATE INDEX IF NOT EXISTS trajectories_named_session
    ON trajectories(session_id, started_us) WHERE session_id IS NOT NULL;
"#;

/// v10's indexes (see [`migrate_v10`]).
const V10_INDEXES: &str = r#"
CREATE UNIQUE INDEX IF NOT EXISTS trajectories_seq ON trajectories(seq);
DROP INDEX IF EXISTS traces_trajectory;
CREATE INDEX IF NOT EXISTS traces_trajectory_seq ON traces(trajectory_seq);
"#;

/// v10's numbers for the rows a store already holds: every trajectory by its rowid, then the traces of each.
const V10_NUMBERS: &str = r#"
UPDATE trajectories SET seq = rowid;
UPDATE traces SET trajectory_seq = (SELECT k.seq FROM trajectories k WHERE k.trajectory_id = traces.trajectory_id)
    WHERE trajectory_id IS NOT NULL;
"#;

/// The steps table of v10, built beside the old one and renamed over it.
const V10_STEPS: &str = r#"
CREATE TABLE steps_v10 (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    step_id        TEXT NOT NULL,
    trajectory_id  TEXT NOT NULL,
    trajectory_seq INTEGER,
    session_id     TEXT,
    step_index     INTEGER NOT NULL,
    role           TEXT NOT NULL,
    trace_id       TEXT,
    started_us     INTEGER NOT NULL,
    body           TEXT NOT NULL,
    UNIQUE (trajectory_seq, step_id)
);
INSERT INTO steps_v10 (seq, step_id, trajectory_id, trajectory_seq, session_id, step_index, role, trace_id,
        started_us, body)
    SELECT s.seq, s.step_id, s.trajectory_id, k.seq, s.session_id, s.step_index, s.role, s.trace_id,
        s.started_us, s.body
    FROM steps s LEFT JOIN trajectories k ON k.trajectory_id = s.trajectory_id;
DROP TABLE steps;
ALTER TABLE steps_v10 RENAME TO steps;
CREATE INDEX steps_trace ON steps(trace_id);
"#;

/// v10: a trajectory's traces and steps are found by a number the trajectory gets when its row is first written
/// (`trajectories.seq`, one more than the largest so far), not by its id. Trajectory ids are hashes: indexes
/// led by them put each new trajectory's first trace and first step on a random page, which every commit then
/// rewrites, so the writer's cost per exchange grew with the store (`llmtap-bench store-rate`, see
/// docs/performance.md, "Trajectory numbers"). New trajectories' numbers only grow, so their rows' index
/// entries go to the end of `traces_trajectory_seq` and of the steps' key.
/// - `traces_trajectory` becomes `traces_trajectory_seq`; a trace without a trajectory has NULL.
/// - The steps' key is (trajectory number, step id) instead of the step id alone. A step id begins with its
///   trajectory's id (`derive::steps`), so a step is still found by its id (`StoreReader::step`). SQLite cannot
///   drop a column's UNIQUE, so the table is rebuilt; seq values (the export order) are kept.
/// - Retention may delete the trajectory with the largest number only when every row under it is gone, so a
///   number that comes back names nothing else.
///
/// In one transaction: a store is never left with half a steps table, so a store below v10 has none of it.
fn migrate_v10(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let result = (|| {
        add_column_if_missing(conn, "trajectories", "seq", "INTEGER")?;
        add_column_if_missing(conn, "traces", "trajectory_seq", "INTEGER")?;
        conn.execute_batch(V10_NUMBERS)?;
        conn.execute_batch(V10_STEPS)?;
        conn.execute_batch(V10_INDEXES)?;
        conn.pragma_update(None, "user_version", 10)?;
        Ok(())
    })();
    match result {
        Ok(()) => conn.execute_batch("COMMIT")?,
        Err(_) => {
            let _ = conn.execute_batch("ROLLBACK");
        }
    }
    result
}

/// v11: the ship log, every record the writer commits (kind `trace`, `step` or `trajectory`, ref = its id), kept
/// only when a shared store is configured: the `shared-store` sink delivers what it names to PostgreSQL behind
/// its cursor (`store::postgres`), and the writer trims what every cursor has passed.
const V11: &str = r#"
CREATE TABLE IF NOT EXISTS ship_log (
    seq   INTEGER PRIMARY KEY AUTOINCREMENT,
    kind  TEXT NOT NULL,
    ref   TEXT NOT NULL
);
"#;

/// v12: a call's replays (`llmtap replay`, the viewer's Replay) found from the original: the few traces whose
/// metadata names the call they re-sent, indexed by it (a partial index: every other trace costs nothing).
const V12: &str = r#"
CREATE INDEX IF NOT EXISTS traces_replay_of ON traces(json_extract(metadata, '$.replay_of'))
    WHERE json_extract(metadata, '$.replay_of') IS NOT NULL;
"#;

/// v13: annotations a person makes in the viewer (a note, a label, a score) on a session, a trajectory or a step
/// (`model::annotation`). Rare and small: written by the viewer on its own connection, never by the store
/// writer. `session_key` is the target's session when it was annotated; a trajectory's or step's annotation also
/// names its trajectory, so the sessions list finds it from the session's trajectories too (label filter).
const V13: &str = r#"
CREATE TABLE IF NOT EXISTS annotations (
    id            TEXT PRIMARY KEY,
    target        TEXT NOT NULL,
    target_id     TEXT NOT NULL,
    session_key   TEXT NOT NULL,
    trajectory_id TEXT,
    note          TEXT,
    label         TEXT,
    score         REAL,
    created_us    INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS annotations_session ON annotations(session_key);
CREATE INDEX IF NOT EXISTS annotations_trajectory ON annotations(trajectory_id) WHERE trajectory_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS annotations_label ON annotations(label) WHERE label IS NOT NULL;
"#;

/// v14: full-text search (`store::search`). `search_docs` holds one row per indexed step, keyed by the step's
/// `seq`, with the filters' columns and the step's folded text (capped, `search::text`); `search_fts` is an FTS5
/// trigram index over that text (external content: the text is kept once), kept in step by triggers. The
/// search indexer thread writes them behind its cursor (`search_state`); a step's deletion (retention) takes its
/// row and index entries with it. Trigram: any substring of three characters or more is found by the index,
/// whatever the language (CJK text has no spaces between words); shorter terms are matched by a scan.
/// `detail='none'`: the index keeps which rows hold a trigram, not where (no positions to store); a term's
/// trigrams narrow the rows and `instr` over the text confirms the term (`search::sqlite`).
const V14: &str = r#"
CREATE TABLE IF NOT EXISTS search_docs (
    seq           INTEGER PRIMARY KEY,
    step_id       TEXT NOT NULL,
    session_key   TEXT NOT NULL,
    model         TEXT,
    agent         TEXT,
    error         INTEGER NOT NULL,
    cost_usd      REAL,
    started_us    INTEGER NOT NULL,
    text          TEXT NOT NULL
);
-- The filters' columns ride along in the time index: a walk newest first tests them without reading the row.
CREATE INDEX IF NOT EXISTS search_docs_started ON search_docs(started_us, step_id, error, cost_usd, model, agent);
CREATE VIRTUAL TABLE IF NOT EXISTS search_fts USING fts5(
    text, content='search_docs', content_rowid='seq', tokenize='trigram case_sensitive 1', detail='none'
);
CREATE TRIGGER IF NOT EXISTS search_docs_added AFTER INSERT ON search_docs BEGIN
    INSERT INTO search_fts (rowid, text) VALUES (new.seq, new.text);
END;
CREATE TRIGGER IF NOT EXISTS search_docs_removed AFTER DELETE ON search_docs BEGIN
    INSERT INTO search_fts (search_fts, rowid, text) VALUES ('delete', old.seq, old.text);
END;
CREATE TRIGGER IF NOT EXISTS steps_search_removed AFTER DELETE ON steps BEGIN
    DELETE FROM search_docs WHERE seq = old.seq;
END;
CREATE TABLE IF NOT EXISTS search_state (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    steps_seq INTEGER NOT NULL,
    log_seq   INTEGER NOT NULL
);
INSERT OR IGNORE INTO search_state (id, steps_seq, log_seq) VALUES (1, 0, 0);
"#;

pub fn migrate(conn: &Connection) -> Result<(), StoreError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version > VERSION {
        return Err(StoreError::FutureSchema {
            found: version,
            supported: VERSION,
        });
    }
    if version > 0 && version < VERSION {
        // Said before the work: a large store's upgrade takes seconds (v10 copies the steps table).
        tracing::info!(
            from = version,
            to = VERSION,
            "Upgrading the store's schema (once; may take a while)"
        );
    }
    if version < 1 {
        conn.execute_batch(V1)?;
    }
    if version < 2 {
        conn.execute_batch(V2)?;
    }
    if version < 3 {
        conn.execute_batch(V3)?;
    }
    if version < 4 {
        for column in V4_TRACE_COLUMNS {
            add_column_if_missing(conn, "traces", column, "TEXT")?;
        }
    }
    if version < 5 {
        conn.execute_batch(V5)?;
    }
    if version < 6 {
        add_column_if_missing(conn, "traces", "facts", "TEXT")?;
    }
    if version < 7 {
        conn.execute_batch(V7)?;
    }
    if version < 8 {
        conn.execute_batch(V8)?;
    }
    if version < 9 {
        conn.execute_batch(V9)?;
    }
    if version < 10 {
        migrate_v10(conn)?;
    }
    if version < 11 {
        conn.execute_batch(V11)?;
    }
    if version < 12 {
        conn.execute_batch(V12)?;
    }
    if version < 13 {
        conn.execute_batch(V13)?;
    }
    if version < 14 {
        conn.execute_batch(V14)?;
    }
    if version < VERSION {
        conn.pragma_update(None, "user_version", VERSION)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The indexes created on `table` (not those of its constraints), by name.
    fn indexes_of(conn: &Connection, table: &str) -> Vec<String> {
        let mut stmt = conn
            .prepare("SELECT name FROM pragma_index_list(?1) WHERE origin = 'c' ORDER BY name")
            .unwrap_or_else(|e| panic!("{e}"));
        stmt.query_map([table], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The rows of a two-column query.
    fn pairs<A: rusqlite::types::FromSql, B: rusqlite::types::FromSql>(
        conn: &Connection,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Vec<(A, B)> {
        conn.prepare(sql)
            .unwrap_or_else(|e| panic!("{e}"))
            .query_map(params, |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap_or_else(|e| panic!("{e}"))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The trajectories of session key `key`, asked as every query asks (`sql::in_session`), with the plan's
    /// index names.
    fn in_session(conn: &Connection, key: &str) -> (Vec<String>, String) {
        let sql = format!(
            "SELECT trajectory_id FROM trajectories t WHERE {} ORDER BY trajectory_id",
            super::super::sql::in_session("t", "?1")
        );
        let ids = conn
            .prepare(&sql)
            .unwrap_or_else(|e| panic!("{e}"))
            .query_map([key], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e}"));
        (ids, super::super::query_plan(conn, &sql, [key]).join("\n"))
    }

    #[test]
    fn a_v6_store_migrates_to_the_current_indexes_and_keeps_its_sessions() {
        let conn = Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        // A store as v6 left it: the migrations up to v6, and three trajectories: one of session "s", one whose
        // session is its own id (as the deriver writes a conversation without a session header), one of
        // session "t2" (another trajectory's id: a sub-agent's, grouped with its parent).
        conn.execute_batch(V1).unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch(V2).unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch(V3).unwrap_or_else(|e| panic!("{e}"));
        for column in V4_TRACE_COLUMNS {
            add_column_if_missing(&conn, "traces", column, "TEXT").unwrap_or_else(|e| panic!("{e}"));
        }
        conn.execute_batch(V5).unwrap_or_else(|e| panic!("{e}"));
        add_column_if_missing(&conn, "traces", "facts", "TEXT").unwrap_or_else(|e| panic!("{e}"));
        conn.pragma_update(None, "user_version", 6)
            .unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch(
            "INSERT INTO trajectories (trajectory_id, session_id, started_us, ended_us, body) VALUES
                 ('t1', 's', 1, 2, '{}'), ('t2', 't2', 3, 4, '{}'), ('t3', 't2', 5, 6, '{}');
             INSERT INTO traces (id, trajectory_id, upstream, api, method, path, outcome, streamed, started_us,
                     ended_us, request_bytes, response_bytes, request_headers, response_headers, metadata)
                 VALUES ('c1', 't3', 'u', 'a', 'POST', '/', 'complete', 0, 5, 6, 0, 0, '{}', '{}', '{}'),
                        ('c0', NULL, 'u', 'a', 'POST', '/', 'complete', 0, 7, 8, 0, 0, '{}', '{}', '{}');
             INSERT INTO steps (seq, step_id, trajectory_id, step_index, role, started_us, body) VALUES
                 (7, 't3/1', 't3', 1, 'user', 5, '{}'), (9, 't3/2', 't3', 2, 'agent', 5, '{}'),
                 (8, 't1/1', 't1', 1, 'user', 1, '{}');",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(indexes_of(&conn, "trajectories"), ["trajectories_session"]);
        assert_eq!(
            indexes_of(&conn, "steps"),
            ["steps_session", "steps_trace", "steps_trajectory"]
        );

        for _ in 0..2 {
            // Migrating again changes nothing.
            migrate(&conn).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                indexes_of(&conn, "trajectories"),
                ["trajectories_named_session", "trajectories_seq", "trajectories_started"]
            );
            assert_eq!(indexes_of(&conn, "steps"), ["steps_trace"]);
            assert_eq!(
                indexes_of(&conn, "traces"),
                ["traces_replay_of", "traces_started", "traces_trajectory_seq"]
            );
            let version: i64 = conn
                .pragma_query_value(None, "user_version", |r| r.get(0))
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(version, VERSION);
            let sessions: Vec<(String, Option<String>)> = pairs(
                &conn,
                "SELECT trajectory_id, session_id FROM trajectories ORDER BY trajectory_id",
                [],
            );
            let own = |t: &str, s: Option<&str>| (t.to_owned(), s.map(str::to_owned));
            assert_eq!(sessions, [own("t1", Some("s")), own("t2", None), own("t3", Some("t2"))]);
            let (s, plan) = in_session(&conn, "s");
            assert_eq!(s, ["t1"]);
            assert!(
                plan.contains("trajectories_named_session") && !plan.contains("SCAN"),
                "{plan}"
            );
            assert_eq!(in_session(&conn, "t2").0, ["t2", "t3"]);
            assert!(
                in_session(&conn, "t1").0.is_empty(),
                "t1 is in session s, not a session of its own"
            );
            assert!(in_session(&conn, "t3").0.is_empty());
            // v10: rows carry their trajectory's number; steps keep their seq (the export order).
            let steps: Vec<(i64, String)> = pairs(
                &conn,
                &format!(
                    "SELECT s.seq, s.step_id FROM steps s WHERE {} ORDER BY s.seq",
                    crate::store::sql::rows_of("s", "?1")
                ),
                ["t3"],
            );
            assert_eq!(steps, [(7, "t3/1".to_owned()), (9, "t3/2".to_owned())]);
            let traces: Vec<(String, Option<i64>)> =
                pairs(&conn, "SELECT t.id, t.trajectory_seq FROM traces t ORDER BY t.id", []);
            let t3: i64 = conn
                .query_row("SELECT seq FROM trajectories WHERE trajectory_id = 't3'", [], |r| {
                    r.get(0)
                })
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(traces, [("c0".to_owned(), None), ("c1".to_owned(), Some(t3))]);
        }
        // New steps are numbered after the ones kept (AUTOINCREMENT's counter came along).
        conn.execute(
            "INSERT INTO steps (step_id, trajectory_id, step_index, role, started_us, body) VALUES ('x/1', 'x', 1, 'user', 0, '{}')",
            [],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(conn.last_insert_rowid(), 10);
    }
}
