//! Records the writer could not store on their own, kept aside instead of lost.
//!
//! When a batch fails for a reason that is not transient (see `write`), the writer splits it until the record
//! that fails alone is found; that record goes here, with the error, and every other record of the batch is
//! stored. A trace is kept in its `provider-traces` export form (bodies already redacted), a step or a
//! trajectory summary as its JSON. The table is created by the writer when it starts (no schema version: an
//! older llmtap ignores a table it does not know). Each record put aside counts in
//! `llmtap_store_quarantined_total`.

use rusqlite::Connection;

use super::StoreError;
use crate::model::record::Record;

const TABLE: &str = r#"
CREATE TABLE IF NOT EXISTS quarantine (
    id      INTEGER PRIMARY KEY,
    at_us   INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    ref     TEXT NOT NULL,
    error   TEXT NOT NULL,
    record  TEXT
);
"#;

pub fn create(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch(TABLE)?;
    Ok(())
}

/// Keep `record`, which failed to store with `error`.
pub fn put(conn: &Connection, record: &Record, error: &StoreError) -> Result<(), StoreError> {
    let (kind, reference, json) = match record {
        Record::Trace(t) => ("trace", t.id.as_str(), Ok(t.to_export_json())),
        Record::Step(s) => ("step", s.step_id.as_str(), serde_json::to_value(s)),
        Record::Trajectory(t) => ("trajectory", t.trajectory_id.as_str(), serde_json::to_value(t)),
    };
    // A record that does not serialize is still named, with its error.
    let json = json.ok().map(|v| v.to_string());
    conn.prepare_cached("INSERT INTO quarantine (at_us, kind, ref, error, record) VALUES (?1, ?2, ?3, ?4, ?5)")?
        .execute(rusqlite::params![
            crate::model::exchange::now_micros(),
            kind,
            reference,
            error.to_string(),
            json
        ])?;
    Ok(())
}
