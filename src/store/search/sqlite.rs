//! Search in the SQLite store: `search_fts` (FTS5, trigram) narrows to the steps holding each term of three
//! characters or more; shorter terms (a two-character CJK word) are matched with `instr` over the folded text.

use rusqlite::types::Value as SqlValue;

use super::{SearchHit, SearchQuery};
use crate::store::read::step_from_row;
use crate::store::{StoreError, StoreReader};

/// A GLOB pattern matching text that contains `term` (GLOB is case-sensitive; the text and terms are folded
/// already). With the trigram tokenizer FTS5 answers it from the index and checks the candidates' text.
fn glob_containing(term: &str) -> String {
    let mut p = String::from("*");
    for c in term.chars() {
        match c {
            '*' | '?' | '[' => {
                p.push('[');
                p.push(c);
                p.push(']');
            }
            c => p.push(c),
        }
    }
    p.push('*');
    p
}

impl StoreReader {
    /// Steps matching `q`, newest first (see [`crate::store::Query::search`]).
    pub fn search(&self, q: &SearchQuery) -> Result<Vec<SearchHit>, StoreError> {
        let mut cond = Vec::new();
        let mut params: Vec<SqlValue> = Vec::new();
        let param = |v: SqlValue, params: &mut Vec<SqlValue>| {
            params.push(v);
            format!("?{}", params.len())
        };
        let (long, short): (Vec<&String>, Vec<&String>) =
            q.terms.as_slice().iter().partition(|t| t.chars().count() >= 3);
        let from = if long.is_empty() {
            "search_docs d".to_owned()
        } else {
            let globs: Vec<String> = long
                .iter()
                .map(|t| format!("text GLOB {}", param(SqlValue::Text(glob_containing(t)), &mut params)))
                .collect();
            format!(
                "(SELECT rowid AS seq FROM search_fts WHERE {}) f JOIN search_docs d ON d.seq = f.seq",
                globs.join(" AND ")
            )
        };
        for t in short {
            let p = param(SqlValue::Text(t.clone()), &mut params);
            cond.push(format!("instr(d.text, {p}) > 0"));
        }
        if let Some(m) = &q.model {
            let p = param(SqlValue::Text(m.clone()), &mut params);
            cond.push(format!("instr(d.model, {p}) > 0"));
        }
        if let Some(a) = &q.agent {
            let p = param(SqlValue::Text(a.clone()), &mut params);
            cond.push(format!("d.agent = {p}"));
        }
        if q.errors_only {
            cond.push("d.error = 1".into());
        }
        if let Some(c) = q.min_cost {
            let p = param(SqlValue::Real(c), &mut params);
            cond.push(format!("d.cost_usd >= {p}"));
        }
        if let Some(c) = q.max_cost {
            let p = param(SqlValue::Real(c), &mut params);
            cond.push(format!("d.cost_usd <= {p}"));
        }
        if let Some(t) = q.since_us {
            let p = param(SqlValue::Integer(t), &mut params);
            cond.push(format!("d.started_us >= {p}"));
        }
        if let Some(t) = q.until_us {
            let p = param(SqlValue::Integer(t), &mut params);
            cond.push(format!("d.started_us <= {p}"));
        }
        let limit = param(SqlValue::Integer(i64::from(q.limit)), &mut params);
        let filter = if cond.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", cond.join(" AND "))
        };
        let sql = format!(
            "SELECT s.step_id, s.body, d.session_key, d.model, d.agent, d.error, d.cost_usd, d.started_us FROM {from} JOIN steps s ON s.seq = d.seq {filter}
             ORDER BY d.started_us DESC, d.step_id DESC LIMIT {limit}"
        );
        let mut stmt = self.conn.prepare(&sql)?;
        let mut rows = stmt.query(rusqlite::params_from_iter(params))?;
        let mut hits = Vec::new();
        while let Some(row) = rows.next()? {
            let step = step_from_row(row)?;
            let doc = super::DocColumns {
                session_key: row.get(2)?,
                model: row.get(3)?,
                agent: row.get(4)?,
                error: row.get(5)?,
                cost_usd: row.get(6)?,
                started_us: row.get(7)?,
            };
            if let Some(h) = super::hit(step, doc, &q.terms) {
                hits.push(h);
            }
        }
        Ok(hits)
    }
}
