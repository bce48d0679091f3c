//! Annotations in the shared store (`store::annotations` has the why): written by the viewer that reads this
//! store, read like every other answer.

use super::{PgStore, StoreError, db_error};
use crate::model::annotation::Annotation;

impl PgStore {
    pub(in crate::store) fn add_annotation(&self, a: &Annotation) -> Result<(), StoreError> {
        let display = self.display.clone();
        let a = a.clone();
        self.block(|c| async move {
            c.execute(
                "INSERT INTO annotations (id, target, target_id, session_key, trajectory_id, note, label, score,
                     created_us) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                &[
                    &a.id,
                    &a.target.as_str(),
                    &a.target_id,
                    &a.session_id,
                    &a.trajectory_id,
                    &a.note,
                    &a.label,
                    &a.score,
                    &a.created_us,
                ],
            )
            .await
            .map_err(|e| db_error(&display, e))?;
            Ok(())
        })
    }

    pub(in crate::store) fn delete_annotation(&self, id: &str) -> Result<bool, StoreError> {
        let display = self.display.clone();
        let id = id.to_owned();
        self.block(|c| async move {
            let n = c
                .execute("DELETE FROM annotations WHERE id = $1", &[&id])
                .await
                .map_err(|e| db_error(&display, e))?;
            Ok(n > 0)
        })
    }

    pub(super) fn read_annotations(
        &self,
        sessions: &[String],
        trajectories: &[String],
    ) -> Result<Vec<Annotation>, StoreError> {
        let display = self.display.clone();
        let (sessions, trajectories) = (sessions.to_vec(), trajectories.to_vec());
        let rows = self.block(|c| async move {
            c.query(
                "SELECT id, target, target_id, session_key, trajectory_id, note, label, score, created_us
                 FROM annotations WHERE session_key = ANY($1) OR trajectory_id = ANY($2)",
                &[&sessions, &trajectories],
            )
            .await
            .map_err(|e| db_error(&display, e))
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let id: String = r.get(0);
            let name: String = r.get(1);
            out.push(Annotation {
                target: crate::store::annotations::target(&id, &name)?,
                id,
                target_id: r.get(2),
                session_id: r.get(3),
                trajectory_id: r.get(4),
                note: r.get(5),
                label: r.get(6),
                score: r.get(7),
                created_us: r.get(8),
            });
        }
        crate::store::annotations::sort_unique(&mut out);
        Ok(out)
    }
}
