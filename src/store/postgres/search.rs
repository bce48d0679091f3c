//! Search in the shared store: `search_docs` (one row per step, written with the step by the shipping sink) under
//! a `pg_trgm` GIN index on its folded text (schema v4), each term a `LIKE '%term%'`. Why trigrams and not a
//! `tsvector`: a text-search configuration splits words by language rules (CJK text, without spaces, is one
//! "word"; `simple` does not stem but still needs whole words), while the SQLite store finds any substring; the
//! trigram index answers the same substring question, so both stores return the same steps for a query. The
//! text is folded in Rust before it is stored (`store::search::text`), so the database's locale plays no part
//! in what matches; in a database with the C locale `pg_trgm` skips non-ASCII characters when it builds
//! trigrams, so a query of only such text (CJK) is checked row by row instead of through the index.

use super::{Param, PgStore, StoreError, db_error, param_refs};
use crate::store::search::{DocColumns, SearchHit, SearchQuery, hit};

/// `%term%` with LIKE's special characters escaped (backslash is LIKE's default escape).
fn contains(term: &str) -> String {
    format!(
        "%{}%",
        term.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_")
    )
}

impl PgStore {
    pub(super) fn search_steps(&self, q: &SearchQuery) -> Result<Vec<SearchHit>, StoreError> {
        let display = self.display.clone();
        let terms = q.terms.clone();
        let q = q.clone();
        let rows = self.block(|c| async move {
            let mut cond: Vec<String> = Vec::new();
            let mut params: Vec<Param> = Vec::new();
            let mut param = |p: Param| {
                params.push(p);
                format!("${}", params.len())
            };
            for t in q.terms.as_slice() {
                cond.push(format!("d.text LIKE {}", param(Box::new(contains(t)))));
            }
            if let Some(m) = &q.model {
                cond.push(format!("strpos(d.model, {}) > 0", param(Box::new(m.clone()))));
            }
            if let Some(a) = &q.agent {
                cond.push(format!("d.agent = {}", param(Box::new(a.clone()))));
            }
            if q.errors_only {
                cond.push("d.error".into());
            }
            if let Some(v) = q.min_cost {
                cond.push(format!("d.cost_usd >= {}", param(Box::new(v))));
            }
            if let Some(v) = q.max_cost {
                cond.push(format!("d.cost_usd <= {}", param(Box::new(v))));
            }
            if let Some(t) = q.since_us {
                cond.push(format!("d.started_us >= {}", param(Box::new(t))));
            }
            if let Some(t) = q.until_us {
                cond.push(format!("d.started_us <= {}", param(Box::new(t))));
            }
            let limit = param(Box::new(i64::from(q.limit)));
            let sql = format!(
                "SELECT s.step_id, s.body, d.session_key, d.model, d.agent, d.error, d.cost_usd, d.started_us
                 FROM search_docs d JOIN steps s ON s.step_id = d.step_id
                 WHERE {} ORDER BY d.started_us DESC, d.step_id DESC LIMIT {limit}",
                cond.join(" AND ")
            );
            let rows = c
                .query(&sql, &param_refs(&params))
                .await
                .map_err(|e| db_error(&display, e))?;
            Ok(rows
                .iter()
                .map(|r| {
                    let doc = DocColumns {
                        session_key: r.get(2),
                        model: r.get(3),
                        agent: r.get(4),
                        error: r.get(5),
                        cost_usd: r.get(6),
                        started_us: r.get(7),
                    };
                    (r.get::<_, String>(0), r.get::<_, String>(1), doc)
                })
                .collect::<Vec<_>>())
        })?;
        let mut hits = Vec::new();
        for (id, body, doc) in rows {
            let step = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
                id,
                what: e.to_string(),
            })?;
            hits.extend(hit(step, doc, &terms));
        }
        Ok(hits)
    }
}
