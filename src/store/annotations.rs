//! Annotations (`model::annotation`): the one thing the store takes from people rather than from the pipeline.
//! Writes go where the viewer reads: the local SQLite store on a connection of their own (WAL with a busy
//! timeout; annotations are rare, so no share of the store writer's batches is worth the coupling), or the
//! shared PostgreSQL store when `[store] url` is set (`postgres::annotations`). Reads are [`Query::annotations`].
//!
//! [`Query::annotations`]: super::Query::annotations

use rusqlite::{Connection, params_from_iter, types::Value as SqlValue};

use super::read::StoreReader;
use super::{Store, StoreError};
use crate::model::annotation::{Annotation, AnnotationTarget};

/// Ids per `IN (...)` list: well under SQLite's bound on parameters.
const IN_CHUNK: usize = 500;

const COLUMNS: &str = "id, target, target_id, session_key, trajectory_id, note, label, score, created_us";

impl Store {
    /// Keep annotation `a` (its id is new).
    pub fn add_annotation(&self, a: &Annotation) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(pool) => {
                let conn = super::open(pool.data_dir())?;
                insert(&conn, a)
            }
            Store::Postgres(pg) => pg.add_annotation(a),
        }
    }

    /// Remove annotation `id`; false when there was none.
    pub fn delete_annotation(&self, id: &str) -> Result<bool, StoreError> {
        match self {
            Store::Sqlite(pool) => {
                let conn = super::open(pool.data_dir())?;
                Ok(conn.execute("DELETE FROM annotations WHERE id = ?1", [id])? > 0)
            }
            Store::Postgres(pg) => pg.delete_annotation(id),
        }
    }
}

fn insert(conn: &Connection, a: &Annotation) -> Result<(), StoreError> {
    conn.execute(
        &format!("INSERT INTO annotations ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"),
        rusqlite::params![
            a.id,
            a.target.as_str(),
            a.target_id,
            a.session_id,
            a.trajectory_id,
            a.note,
            a.label,
            a.score,
            a.created_us
        ],
    )?;
    Ok(())
}

/// A stored target name; one this llmtap does not know is corrupt.
pub(super) fn target(id: &str, name: &str) -> Result<AnnotationTarget, StoreError> {
    AnnotationTarget::parse(name).ok_or_else(|| StoreError::Corrupt {
        id: id.to_owned(),
        what: format!("annotation target {name:?}"),
    })
}

impl StoreReader {
    /// Annotations in any of `sessions` (by the session they were made in) or on any of `trajectories` (a
    /// trajectory's own and its steps'), oldest first, each once.
    pub fn annotations(&self, sessions: &[String], trajectories: &[String]) -> Result<Vec<Annotation>, StoreError> {
        let mut out: Vec<Annotation> = Vec::new();
        for (column, ids) in [("session_key", sessions), ("trajectory_id", trajectories)] {
            for chunk in ids.chunks(IN_CHUNK) {
                let marks = vec!["?"; chunk.len()].join(", ");
                let mut stmt = self.conn.prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM annotations WHERE {column} IN ({marks})"
                ))?;
                let params = chunk.iter().map(|s| SqlValue::Text(s.clone()));
                let mut rows = stmt.query(params_from_iter(params))?;
                while let Some(r) = rows.next()? {
                    let id: String = r.get(0)?;
                    let name: String = r.get(1)?;
                    out.push(Annotation {
                        target: target(&id, &name)?,
                        id,
                        target_id: r.get(2)?,
                        session_id: r.get(3)?,
                        trajectory_id: r.get(4)?,
                        note: r.get(5)?,
                        label: r.get(6)?,
                        score: r.get(7)?,
                        created_us: r.get(8)?,
                    });
                }
            }
        }
        sort_unique(&mut out);
        Ok(out)
    }
}

/// Oldest first (ties by id), each annotation once (one can match by session and by trajectory).
pub(super) fn sort_unique(out: &mut Vec<Annotation>) {
    out.sort_by(|a, b| (a.created_us, &a.id).cmp(&(b.created_us, &b.id)));
    out.dedup_by(|a, b| a.id == b.id);
}
