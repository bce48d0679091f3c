//! The shared store's schema and its migrations. `llmtap_schema` holds the version; migrations only ever add,
//! and run under a transaction-scoped advisory lock, so that replicas starting together migrate once.

use super::{StoreError, db_error};

pub const VERSION: i32 = 4;

/// An arbitrary constant naming llmtap's migration lock among the database's advisory locks.
const MIGRATION_LOCK: i64 = 0x6c6c_6d74_6170;

/// v1. Times are Unix micros. `session_key` is the session a row is grouped under (the trajectory's session id,
/// else its own id). Traces keep their facts and headers as JSON text (`head`) and their bodies apart, zstd
/// compressed (`bodies`, see `store::codec`), so lists never read bodies.
const V1: &str = r#"
CREATE TABLE IF NOT EXISTS traces (
    id            text PRIMARY KEY,
    replica       text NOT NULL,
    trajectory_id text,
    session_key   text,
    started_us    bigint NOT NULL,
    head          text NOT NULL,
    bodies        bytea
);
CREATE INDEX IF NOT EXISTS traces_trajectory ON traces (trajectory_id, started_us, id);
CREATE INDEX IF NOT EXISTS traces_session ON traces (session_key, started_us, id);
CREATE INDEX IF NOT EXISTS traces_started ON traces (started_us, id);

CREATE TABLE IF NOT EXISTS steps (
    step_id       text PRIMARY KEY,
    trajectory_id text NOT NULL,
    step_index    integer NOT NULL,
    role          text NOT NULL,
    trace_id      text,
    started_us    bigint NOT NULL,
    body          text NOT NULL
);
CREATE INDEX IF NOT EXISTS steps_trajectory ON steps (trajectory_id, step_index);
CREATE INDEX IF NOT EXISTS steps_trace ON steps (trace_id);

CREATE TABLE IF NOT EXISTS trajectory_parts (
    trajectory_id    text NOT NULL,
    replica          text NOT NULL,
    session_key      text NOT NULL,
    started_us       bigint NOT NULL,
    ended_us         bigint NOT NULL,
    body             text NOT NULL,
    system_prompts   text,
    tool_definitions text,
    PRIMARY KEY (trajectory_id, replica)
);
CREATE INDEX IF NOT EXISTS trajectory_parts_session ON trajectory_parts (session_key, started_us);

CREATE TABLE IF NOT EXISTS sessions (
    session_key text PRIMARY KEY,
    started_us  bigint NOT NULL,
    ended_us    bigint NOT NULL,
    agents      text[] NOT NULL DEFAULT '{}',
    models      text[] NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS sessions_started ON sessions (started_us DESC, session_key DESC);
"#;

/// v2: a call's replays found from the original (`Query::replays_of`): the few traces whose head names the call
/// they re-sent, by a partial index on it.
const V2: &str = r#"
CREATE INDEX IF NOT EXISTS traces_replay_of ON traces (((head::jsonb) -> 'meta' ->> 'replay_of'))
    WHERE ((head::jsonb) -> 'meta' ->> 'replay_of') IS NOT NULL;
"#;

/// v3: annotations made in a viewer reading this store (`model::annotation`; SQLite's v13 has the same table).
/// The viewer writes them here, not in a replica's spool: every viewer of the team reads this store.
const V3: &str = r#"
CREATE TABLE IF NOT EXISTS annotations (
    id            text PRIMARY KEY,
    target        text NOT NULL,
    target_id     text NOT NULL,
    session_key   text NOT NULL,
    trajectory_id text,
    note          text,
    label         text,
    score         double precision,
    created_us    bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS annotations_session ON annotations (session_key);
CREATE INDEX IF NOT EXISTS annotations_trajectory ON annotations (trajectory_id) WHERE trajectory_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS annotations_label ON annotations (label) WHERE label IS NOT NULL;
"#;

/// v4: search (`store::search`, `postgres::search`): one row per step with the filters' columns and its folded
/// text, under a `pg_trgm` GIN index. `pg_trgm` ships with PostgreSQL and is a trusted extension (a database
/// owner may create it); where it cannot be created the table is still made and searched without the index.
/// Steps stored before v4 have no row: search covers what is delivered from then on.
const V4: &str = r#"
CREATE TABLE IF NOT EXISTS search_docs (
    step_id     text PRIMARY KEY,
    session_key text NOT NULL,
    model       text,
    agent       text,
    error       boolean NOT NULL,
    cost_usd    double precision,
    started_us  bigint NOT NULL,
    has_trace   boolean NOT NULL,
    text        text NOT NULL
);
CREATE INDEX IF NOT EXISTS search_docs_started ON search_docs (started_us);
DO $$
BEGIN
    CREATE EXTENSION IF NOT EXISTS pg_trgm;
EXCEPTION WHEN OTHERS THEN
    RAISE WARNING 'llmtap: pg_trgm is not available (%); search reads every row', SQLERRM;
END
$$;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm') THEN
        CREATE INDEX IF NOT EXISTS search_docs_text ON search_docs USING gin (text gin_trgm_ops);
    END IF;
END
$$;
"#;

const MIGRATIONS: [&str; 4] = [V1, V2, V3, V4];

pub(super) async fn migrate(client: &mut deadpool_postgres::Object, display: &str) -> Result<(), StoreError> {
    let err = |e| db_error(display, e);
    let tx = client.transaction().await.map_err(err)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(err)?;
    // "Already exists, skipping" notices are not news on every start.
    tx.batch_execute("SET LOCAL client_min_messages = warning")
        .await
        .map_err(err)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS llmtap_schema (version integer NOT NULL)")
        .await
        .map_err(err)?;
    let found: Option<i32> = tx
        .query_opt("SELECT version FROM llmtap_schema", &[])
        .await
        .map_err(err)?
        .map(|r| r.get(0));
    let found = found.unwrap_or(0);
    if found > VERSION {
        return Err(StoreError::FutureSchema {
            found: i64::from(found),
            supported: i64::from(VERSION),
        });
    }
    for sql in MIGRATIONS.iter().skip(found as usize) {
        tx.batch_execute(sql).await.map_err(err)?;
    }
    if found == 0 {
        tx.execute("INSERT INTO llmtap_schema (version) VALUES ($1)", &[&VERSION])
            .await
            .map_err(err)?;
    } else if found < VERSION {
        tx.execute("UPDATE llmtap_schema SET version = $1", &[&VERSION])
            .await
            .map_err(err)?;
    }
    tx.commit().await.map_err(err)
}
