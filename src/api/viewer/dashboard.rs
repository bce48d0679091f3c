//! The cost page's data (`GET api/costs`): spend and tokens by day, model and agent, cache savings and the most
//! expensive sessions of a time range, summed in SQL by the store (`Query::cost_report`, `store::costs`); this
//! module reads the range from the request and shapes the answer. Amounts are exact decimal strings, null when
//! unknown (no call of the group was priced), never $0 for unknown.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::model::step::session_title;
use crate::model::trace::rfc3339;
use crate::store::{CostGroup, CostQuery, CostTotals, Query, StoreError};

/// The range when the request names none: the last 30 days.
const DEFAULT_DAYS: i64 = 30;
/// Most expensive sessions listed, by default and at most.
const TOP: u32 = 10;
const MAX_TOP: u32 = 100;
/// Offsets from UTC run from −12:00 to +14:00.
const MAX_OFFSET_MINUTES: i64 = 14 * 60;

/// The report's range from `since`, `until` (RFC 3339, or a date `YYYY-MM-DD`: that day's start in the page's
/// offset; `until` then covers the whole day), `tz` (the page's offset east of UTC, minutes) and `top`; Err: a
/// message for a 400.
pub fn cost_query(q: &BTreeMap<String, String>, now_us: i64) -> Result<CostQuery, String> {
    let offset_min: i64 = match q.get("tz").filter(|v| !v.is_empty()) {
        Some(v) => v
            .parse()
            .map_err(|_| format!("tz must be minutes east of UTC, not {v:?}"))?,
        None => 0,
    };
    if offset_min.abs() > MAX_OFFSET_MINUTES {
        return Err("tz must be within ±14 hours".into());
    }
    let offset_s = offset_min * 60;
    let time = |key: &str, whole_day: bool| -> Result<Option<i64>, String> {
        let Some(v) = q.get(key).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        if let Ok(t) = chrono::DateTime::parse_from_rfc3339(v) {
            return Ok(Some(t.timestamp_micros()));
        }
        let day = chrono::NaiveDate::parse_from_str(v, "%Y-%m-%d")
            .map_err(|_| format!("{key} must be RFC 3339 or YYYY-MM-DD, not {v:?}"))?;
        let day = if whole_day { day.succ_opt().unwrap_or(day) } else { day };
        let utc = day.and_hms_opt(0, 0, 0).map(|d| d.and_utc().timestamp() - offset_s);
        Ok(utc.map(|s| s * 1_000_000))
    };
    let until = time("until", true)?.unwrap_or(now_us + 1);
    let since = time("since", false)?.unwrap_or(until - DEFAULT_DAYS * 86_400 * 1_000_000);
    if since >= until {
        return Err("since must be before until".into());
    }
    let top = match q.get("top").filter(|v| !v.is_empty()) {
        Some(v) => v
            .parse::<u32>()
            .map_err(|_| format!("top must be a count, not {v:?}"))?,
        None => TOP,
    };
    Ok(CostQuery {
        since_us: since,
        until_us: until,
        utc_offset_s: offset_s,
        top: top.clamp(1, MAX_TOP),
    })
}

fn usd(d: Option<rust_decimal::Decimal>) -> Value {
    d.map_or(Value::Null, |d| Value::String(d.normalize().to_string()))
}

fn totals_json(t: &CostTotals) -> Value {
    json!({
        "calls": t.calls,
        "priced_calls": t.priced_calls,
        "unpriced_calls": t.unpriced_calls,
        "input_tokens": t.input_tokens,
        "output_tokens": t.output_tokens,
        "cache_read_tokens": t.cache_read_tokens,
        "cache_write_tokens": t.cache_write_tokens,
        "cost_usd": usd(t.cost),
        "cache_read_cost_usd": usd(t.cache_read_cost),
        "cache_savings_usd": usd(t.cache_savings),
        "savings_unknown_calls": t.savings_unknown_calls,
    })
}

fn groups_json(groups: &[CostGroup], name: &str) -> Value {
    Value::Array(
        groups
            .iter()
            .map(|g| json!({ name: g.key, "first_call_at": rfc3339(g.first_us), "totals": totals_json(&g.totals) }))
            .collect(),
    )
}

/// The cost page's data for `q`.
pub fn costs(reader: &dyn Query, q: &CostQuery) -> Result<Value, StoreError> {
    let report = reader.cost_report(q)?;
    let keys: Vec<String> = report.top_sessions.iter().filter_map(|g| g.key.clone()).collect();
    let trajectories = reader.trajectories_of_sessions(&keys)?;
    let titles: BTreeMap<&str, Option<String>> = keys
        .iter()
        .zip(&trajectories)
        .map(|(k, ts)| (k.as_str(), session_title(ts.iter().map(|(_, t)| t)).map(str::to_owned)))
        .collect();
    let top: Vec<Value> = report
        .top_sessions
        .iter()
        .map(|g| {
            let key = g.key.as_deref().unwrap_or("");
            json!({
                "session_id": key,
                "title": titles.get(key).cloned().flatten(),
                "first_call_at": rfc3339(g.first_us),
                "totals": totals_json(&g.totals),
            })
        })
        .collect();
    Ok(json!({
        "since": rfc3339(q.since_us),
        "until": rfc3339(q.until_us),
        "utc_offset_minutes": q.utc_offset_s / 60,
        "totals": totals_json(&report.totals),
        "by_day": groups_json(&report.by_day, "day"),
        "by_model": groups_json(&report.by_model, "model"),
        "by_agent": groups_json(&report.by_agent, "agent"),
        "top_sessions": top,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_range_of_local_days_covers_both_whole_days() {
        let now = 1_800_000_000_000_000;
        let r = cost_query(
            &q(&[("since", "2026-11-01"), ("until", "2026-11-02"), ("tz", "60")]),
            now,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        // 2026-11-01T00:00+01:00 to 2026-11-03T00:00+01:00.
        assert_eq!(r.since_us, 1_793_487_600_000_000);
        assert_eq!(r.until_us - r.since_us, 2 * 86_400 * 1_000_000);
        assert_eq!(r.utc_offset_s, 3600);
        let d = cost_query(&q(&[]), now).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(d.until_us, now + 1);
        assert_eq!(d.until_us - d.since_us, 30 * 86_400 * 1_000_000);
        for bad in [
            q(&[("since", "yesterday")]),
            q(&[("tz", "900")]),
            q(&[("since", "2026-11-02"), ("until", "2026-11-01")]),
            q(&[("top", "-1")]),
        ] {
            assert!(cost_query(&bad, now).is_err(), "{bad:?}");
        }
    }
}
