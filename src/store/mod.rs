//! The embedded store: one SQLite file in WAL mode, written by one dedicated thread in batched transactions.
//!
//! It is the durable log: exports and the CLI read from it. Raw bodies live in their own table, compressed,
//! apart from the small indexed trace rows, so that large sessions (every request repeats the conversation)
//! do not slow queries, and body storage can change (e.g. content addressing) without touching the rest.
//! WAL + `synchronous=NORMAL` survives `kill -9` of llmtap (only an OS crash can lose the last commits).

pub mod codec;
mod read;
mod schema;
mod write;

pub use read::{Cursor, SessionRow, StoreReader, TraceFilter};
pub use write::{StoreTx, StoreWriter};

use std::path::{Path, PathBuf};

use rusqlite::Connection;

use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;

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
    #[error("store holds a corrupt record {id}: {what}")]
    Corrupt { id: String, what: String },
    #[error("store schema version {found} is newer than this llmtap understands ({supported})")]
    FutureSchema { found: i64, supported: i64 },
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

/// What flows into the store.
#[derive(Debug, Clone)]
pub enum Record {
    Trace(Box<ProviderTrace>),
    /// A step, new or updated with late facts (observations, classification): upserted by id.
    Step(Box<Step>),
    Trajectory(Box<TrajectorySummary>),
}

pub fn db_path(data_dir: &Path) -> PathBuf {
    data_dir.join(DB_FILE)
}

/// Open (creating if needed) the store in `data_dir` and bring its schema up to date.
pub fn open(data_dir: &Path) -> Result<Connection, StoreError> {
    std::fs::create_dir_all(data_dir).map_err(|source| StoreError::DataDir {
        path: data_dir.to_owned(),
        source,
    })?;
    let path = db_path(data_dir);
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

/// Keep each prepared statement's query plan whatever values are bound to it. The bundled SQLite is built with
/// STAT4, whose planner may look at a bound value: every new value then expired the statement, and SQLite parsed
/// and planned it again on the next step. The exporter's lookups by id (trace with its bodies, agent step) were
/// re-prepared on every call: the thread building spans spent 133 µs per exported call, 46 µs with this
/// (`perf stat --per-thread`, 500 req/s). llmtap never runs ANALYZE, so no better plan is given up.
pub(crate) fn stable_plans(conn: &Connection) -> Result<(), StoreError> {
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    Ok(())
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
