//! The embedded store: one SQLite file in WAL mode, written by one dedicated thread in batched transactions.
//!
//! It is the durable log: exports and the CLI read from it. Raw bodies live in their own table, compressed,
//! apart from the small indexed trace rows, so that large sessions (every request repeats the conversation)
//! do not slow queries, and body storage can change (e.g. content addressing) without touching the rest.
//! WAL + `synchronous=NORMAL` survives `kill -9` of llmtap (only an OS crash can lose the last commits).

mod annotations;
mod browse;
mod checkpoint;
pub mod chunks;
mod coalesce;
pub mod codec;
pub mod costs;
pub mod feed;
mod in_flight;
pub mod postgres;
mod private;
mod quarantine;
pub mod query;
mod read;
pub mod recent;
mod schema;
pub mod search;
mod sql;
mod write;

pub use browse::{CallHead, SessionHead, SessionQuery};
pub use costs::{CostGroup, CostQuery, CostReport, CostTotals};
pub use query::{Query, Store};
pub use read::{Cursor, LogTable, SessionRow, StoreReader, TraceFilter};
pub use recent::RecentRecords;
pub use write::{StoreTx, StoreWriter};

use std::path::{Path, PathBuf};

use rusqlite::Connection;

pub const DB_FILE: &str = "llmtap.sqlite";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("store {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("store query failed: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("cannot serialize {what} for the store: {source}")]
    Serialize {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("store holds a corrupt record {id}: {what}")]
    Corrupt { id: String, what: String },
    #[error("store schema version {found} is newer than this llmtap understands ({supported})")]
    FutureSchema { found: i64, supported: i64 },
    #[error(
        "store {path} is not writable ({reason}); llmtap cannot capture into it: make the file and its \
         directory writable by this user, or choose another --data-dir"
    )]
    NotWritable { path: PathBuf, reason: String },
    #[error("cannot start the store's checkpoint thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The shared PostgreSQL store (named without its password) failed or refused.
    #[error("shared store {store}: {message}")]
    Shared { store: String, message: String },
    #[error("cannot make store file {path} private: {source}")]
    Permissions {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// SQLite answered "busy" or "locked": another connection held the lock past the busy timeout.
    pub fn is_busy(&self) -> bool {
        let sqlite = match self {
            StoreError::Sql(e) => e,
            _ => return false,
        };
        matches!(
            sqlite.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        )
    }
}

/// What flows into the store (derivation's output; the model owns the type).
pub use crate::model::record::Record;

pub fn db_path(data_dir: &Path) -> PathBuf {
    data_dir.join(DB_FILE)
}

/// Open (creating if needed) the store in `data_dir` and bring its schema up to date.
pub fn open(data_dir: &Path) -> Result<Connection, StoreError> {
    private::create_dir(data_dir).map_err(|source| StoreError::DataDir {
        path: data_dir.to_owned(),
        source,
    })?;
    let path = db_path(data_dir);
    private::prepare_files(&path)?;
    let conn = Connection::open(&path).map_err(|source| StoreError::Open {
        path: path.clone(),
        source,
    })?;
    let setup = || -> Result<(), StoreError> {
        // The busy timeout first: switching to WAL itself takes a lock another connection may hold.
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        stable_plans(&conn)?;
        schema::migrate(&conn)?;
        Ok(())
    };
    setup()?;
    Ok(conn)
}

/// [`open`] for the one writer (`llmtap serve`): also proves that a write commits, so a store llmtap cannot
/// write is a startup error naming the path rather than a capture that fails quietly. SQLite opens a file it
/// may not write read-only without saying so, and a directory that refuses new files (`-wal`, `-shm`) only
/// fails at the first commit.
pub fn open_for_writing(data_dir: &Path) -> Result<Connection, StoreError> {
    let path = db_path(data_dir);
    let not_writable = |reason: String| StoreError::NotWritable {
        path: path.clone(),
        reason,
    };
    let conn = match open(data_dir) {
        // A read-only file in WAL mode may fail already while opening (the -shm cannot be created).
        Err(StoreError::Open { source, .. }) if is_readonly_error(&source) => {
            return Err(not_writable(source.to_string()));
        }
        Err(StoreError::Sql(source)) if is_readonly_error(&source) => return Err(not_writable(source.to_string())),
        other => other?,
    };
    if conn.is_readonly(rusqlite::MAIN_DB)? {
        return Err(not_writable("the file opens read-only".into()));
    }
    // Rewriting the schema version is a real commit (page 1 and the WAL) that changes nothing.
    conn.pragma_update(None, "user_version", schema::VERSION)
        .map_err(|e| not_writable(e.to_string()))?;
    Ok(conn)
}

fn is_readonly_error(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::ReadOnly | rusqlite::ErrorCode::CannotOpen | rusqlite::ErrorCode::PermissionDenied)
    )
}

/// Keep each prepared statement's query plan whatever values are bound to it. The bundled SQLite is built with
/// STAT4, whose planner may look at a bound value: every new value then expired the statement, and SQLite parsed
/// and planned it again on the next step. The exporter's lookups by id (trace with its bodies, agent step) were
/// re-prepared on every call: the thread building spans spent 133 µs per exported call, 46 µs with this
/// (`perf stat --per-thread`, 500 req/s). llmtap never runs ANALYZE, so no better plan is given up.
pub(crate) fn stable_plans(conn: &Connection) -> Result<(), StoreError> {
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    Ok(())
}

/// [`open`] for a connection beside the writer's that must never checkpoint by itself (an exporter's cursor,
/// the checkpoint thread). Checkpoints belong to the checkpoint thread (`checkpoint.rs`, every
/// `CHECKPOINT_PAGES` WAL pages). With SQLite's default (1,000 pages), nearly every commit of such a connection
/// under load would find the WAL past that and run one itself, copying hot pages far more often.
pub(crate) fn open_without_checkpoints(data_dir: &Path) -> Result<Connection, StoreError> {
    let conn = open(data_dir)?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    Ok(conn)
}

/// The query plan SQLite chooses for `sql` with `params` bound, one line per step (`EXPLAIN QUERY PLAN`'s
/// detail column): what the plan tests pin.
#[cfg(test)]
pub(crate) fn query_plan(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Vec<String> {
    conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .unwrap_or_else(|e| panic!("{e}"))
        .query_map(params, |r| r.get(3))
        .unwrap_or_else(|e| panic!("{e}"))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_lock_held_elsewhere_is_reported_as_busy() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let holder = open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        holder
            .execute_batch("BEGIN IMMEDIATE")
            .unwrap_or_else(|e| panic!("{e}"));
        let other = open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        other
            .busy_timeout(std::time::Duration::from_millis(10))
            .unwrap_or_else(|e| panic!("{e}"));
        let err = other
            .execute("INSERT INTO cursors (sink, seq) VALUES ('x', 1)", [])
            .map_err(StoreError::from)
            .expect_err("the lock is held");
        assert!(err.is_busy(), "{err}");
        assert!(
            !StoreError::Corrupt {
                id: "a".into(),
                what: "b".into()
            }
            .is_busy()
        );
    }
}
