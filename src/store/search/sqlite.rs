//! Search in the SQLite store. `search_fts` (FTS5, trigram tokens, `detail='none'`) narrows to the rows holding
//! every trigram of every term of three characters or more; `instr` over the folded text confirms each term
//! (and alone matches shorter ones, such as a two-character CJK word, by a scan).
//!
//! Newest first without reading every match: when the trigrams narrow to few rows, those rows are read by key
//! and sorted; when they leave many (a common word), the rows are walked newest first along
//! `search_docs_started` and only rows in the trigram set are read, until the page is full.

use rusqlite::types::Value as SqlValue;

use super::{SearchHit, SearchQuery};
use crate::store::read::step_from_row;
use crate::store::{StoreError, StoreReader};

/// Trigram-matching rows up to which the rows are read by key and sorted.
const FEW: usize = 2_000;
/// Trigrams of one term used to narrow (spread over it); `instr` checks the whole term.
const TRIGRAMS_PER_TERM: usize = 12;

/// The FTS5 query for the terms' trigrams (each a quoted one-token string: `detail='none'` has no phrases).
fn trigram_query(terms: &[&String]) -> String {
    let mut all: Vec<String> = Vec::new();
    for term in terms {
        let chars: Vec<char> = term.chars().collect();
        let grams: Vec<String> = chars.windows(3).map(|w| w.iter().collect()).collect();
        let step = grams.len().div_ceil(TRIGRAMS_PER_TERM).max(1);
        for (i, g) in grams.iter().enumerate() {
            if (i % step == 0 || i + 1 == grams.len()) && !all.contains(g) {
                all.push(g.clone());
            }
        }
    }
    all.iter()
        .map(|g| format!("\"{}\"", g.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The page of hits: the docs rows first (by the docs alone), then their steps.
fn page_sql(cond: &[String], limit: &str) -> String {
    format!(
        "SELECT s.step_id, s.body, d.session_key, d.model, d.agent, d.error, d.cost_usd, d.started_us
         FROM (SELECT d.* FROM search_docs d WHERE {} ORDER BY d.started_us DESC, d.step_id DESC LIMIT {limit}) d
         JOIN steps s ON s.seq = d.seq
         ORDER BY d.started_us DESC, d.step_id DESC",
        cond.join(" AND ")
    )
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
        let long: Vec<&String> = q.terms.as_slice().iter().filter(|t| t.chars().count() >= 3).collect();
        if !long.is_empty() {
            let matching = trigram_query(&long);
            let mut stmt = self
                .conn
                .prepare_cached("SELECT rowid FROM search_fts WHERE search_fts MATCH ?1 LIMIT ?2")?;
            let rows: Vec<i64> = stmt
                .query_map(rusqlite::params![matching, FEW as i64 + 1], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            if rows.len() <= FEW {
                let list: Vec<String> = rows.iter().map(i64::to_string).collect();
                cond.push(format!("d.seq IN ({})", list.join(",")));
            } else {
                // `+`: not by key (that would read every match), but checked as the index walk meets each row.
                let p = param(SqlValue::Text(matching), &mut params);
                cond.push(format!(
                    "+d.seq IN (SELECT rowid FROM search_fts WHERE search_fts MATCH {p})"
                ));
            }
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
        // The terms last: SQLite tests a row's conditions in this order, and the text (up to 8 KiB, on overflow
        // pages) is read only for rows the cheap filters kept.
        for t in q.terms.as_slice() {
            let p = param(SqlValue::Text(t.clone()), &mut params);
            cond.push(format!("instr(d.text, {p}) > 0"));
        }
        let limit = param(SqlValue::Integer(i64::from(q.limit)), &mut params);
        let mut stmt = self.conn.prepare(&page_sql(&cond, &limit))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_term_narrows_by_its_trigrams_spread_over_it() {
        let t = |s: &str| s.to_owned();
        assert_eq!(trigram_query(&[&t("abcd")]), "\"abc\" AND \"bcd\"");
        assert_eq!(
            trigram_query(&[&t("a\"bc"), &t("abc")]),
            "\"a\"\"b\" AND \"\"\"bc\" AND \"abc\""
        );
        let long = "x".repeat(5) + &"東京タワー".repeat(20);
        let q = trigram_query(&[&long]);
        assert!(q.split(" AND ").count() <= TRIGRAMS_PER_TERM + 1, "{q}");
    }

    /// Many trigram matches: the docs are walked newest first along their index and only matching rows read,
    /// never all matches read and sorted.
    #[test]
    fn a_common_term_walks_the_time_index_instead_of_sorting_every_match() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let conn = crate::store::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let cond = [
            "+d.seq IN (SELECT rowid FROM search_fts WHERE search_fts MATCH ?1)".to_owned(),
            "instr(d.text, ?2) > 0".to_owned(),
        ];
        let plan = crate::store::query_plan(&conn, &page_sql(&cond, "?3"), rusqlite::params!["\"abc\"", "abc", 50]);
        let plan = plan.join("\n");
        assert!(plan.contains("USING INDEX search_docs_started"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }
}
