//! The embedded store: one SQLite file in WAL mode, written by one dedicated thread in batched transactions.
//!
//! It is the durable log: exports and the CLI read from it. Raw bodies live in their own table, compressed,
//! apart from the small indexed trace rows, so that large sessions (every request repeats the conversation)
//! do not slow queries, and body storage can change (e.g. content addressing) without touching the rest.
//! WAL + `synchronous=NORMAL` survives `kill -9` of llmtap (only an OS crash can lose the last commits).

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
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        schema::migrate(&conn)?;
        Ok(())
    };
    setup()?;
    Ok(conn)
}
