//! `GET /api/search`: full-text search over the store's steps (`store::search`) with the viewer's filters.
//!
//! Parameters: `q` (words, or "quoted phrases"; every one must occur), `model` (part of it), `agent`, `errors=1`,
//! `since` / `until` (RFC 3339), `min_cost` / `max_cost` (USD), `limit`. Each hit names its session, trajectory
//! and step (what the page opens) and carries a snippet as text pieces, the matches marked: the page renders
//! them as text nodes, never as markup.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::store::search::{SearchQuery, Terms};
use crate::store::{Query, StoreError};

/// A parameter the search cannot use: answered 400 with this text.
#[derive(Debug, thiserror::Error)]
pub enum SearchParamError {
    #[error("q: {0}")]
    Terms(#[from] crate::store::search::TermsError),
    #[error("{name}: not an RFC 3339 time: {value:?}")]
    Time { name: &'static str, value: String },
    #[error("{name}: not a number: {value:?}")]
    Number { name: &'static str, value: String },
}

/// The query the request's parameters ask for.
pub fn query(params: &BTreeMap<String, String>) -> Result<SearchQuery, SearchParamError> {
    let given = |k: &str| params.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    let time = |name: &'static str| {
        given(name)
            .map(|v| {
                chrono::DateTime::parse_from_rfc3339(v)
                    .map(|t| t.timestamp_micros())
                    .map_err(|_| SearchParamError::Time {
                        name,
                        value: v.to_owned(),
                    })
            })
            .transpose()
    };
    let number = |name: &'static str| {
        given(name)
            .map(|v| {
                v.parse::<f64>()
                    .ok()
                    .filter(|n| n.is_finite())
                    .ok_or_else(|| SearchParamError::Number {
                        name,
                        value: v.to_owned(),
                    })
            })
            .transpose()
    };
    let mut q = SearchQuery::new(Terms::parse(params.get("q").map_or("", String::as_str))?);
    q.model = given("model").map(str::to_owned);
    q.agent = given("agent").map(str::to_owned);
    q.errors_only = matches!(given("errors"), Some("1" | "true" | "on"));
    q.since_us = time("since")?;
    q.until_us = time("until")?;
    q.min_cost = number("min_cost")?;
    q.max_cost = number("max_cost")?;
    if let Some(limit) = number("limit")? {
        q.limit = (limit as u32).clamp(1, SearchQuery::MAX_LIMIT);
    }
    Ok(q)
}

/// The hits of `q`, newest first.
pub fn answer(r: &dyn Query, q: &SearchQuery) -> Result<Value, StoreError> {
    let hits = r.search(q)?;
    Ok(json!({
        "terms": q.terms.as_slice(),
        "limit": q.limit,
        "hits": hits,
    }))
}
