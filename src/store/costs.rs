//! Spend over time: the calls of a time range added up in SQL, in total, by day, by model, by agent, and the most
//! expensive sessions ([`Query::cost_report`]; PostgreSQL's in `postgres::costs`). Amounts stay exact decimals:
//! SQLite adds the stored decimal text with `dec_sum` (registered on every reader, `rust_decimal`), PostgreSQL
//! with `numeric`.
//!
//! Cache savings: what a call's cache reads would have cost at its uncached input price, less what they cost.
//! The uncached price is the one the call was priced with (its tier and date): the call's input cost divided by
//! its uncached input tokens (`input − cache_read − cache_write`), so no price is looked up again here. A call
//! that read from the cache but had no uncached input token has no such price: its savings are not known and it
//! is counted in `savings_unknown_calls`, never taken as 0.
//!
//! [`Query::cost_report`]: super::Query::cost_report

use std::str::FromStr;

use rusqlite::functions::{Aggregate, Context, FunctionFlags};
use rusqlite::{Connection, Row};
use rust_decimal::{Decimal, RoundingStrategy};

use super::StoreError;
use super::read::StoreReader;

/// Per-call savings are rounded to this many decimals before they are added up (both backends alike).
pub const SAVINGS_DECIMALS: u32 = 12;

/// Which calls a report covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostQuery {
    /// Unix micros, inclusive.
    pub since_us: i64,
    /// Unix micros, exclusive.
    pub until_us: i64,
    /// Days are counted in this offset from UTC (seconds east): the viewer's local days.
    pub utc_offset_s: i64,
    /// How many of the most expensive sessions.
    pub top: u32,
}

/// Sums over a set of calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CostTotals {
    /// Every exchange, LLM call or not.
    pub calls: u64,
    /// Calls with usage and a known cost.
    pub priced_calls: u64,
    /// Calls with usage whose cost is unknown (no price for the model and date).
    pub unpriced_calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    /// The sum of the known costs; None when no call was priced.
    pub cost: Option<Decimal>,
    /// Of which cache reads.
    pub cache_read_cost: Option<Decimal>,
    /// What the cache reads saved (module docs); None when no call was priced.
    pub cache_savings: Option<Decimal>,
    /// Priced calls that read from the cache with no uncached input to take the price from.
    pub savings_unknown_calls: u64,
}

/// A group of calls: a day (`YYYY-MM-DD`), a model, an agent or a session (None: calls without one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostGroup {
    pub key: Option<String>,
    /// The group's first call, Unix micros.
    pub first_us: i64,
    pub totals: CostTotals,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CostReport {
    pub totals: CostTotals,
    /// Oldest first; days without calls are left out.
    pub by_day: Vec<CostGroup>,
    /// Most expensive first.
    pub by_model: Vec<CostGroup>,
    pub by_agent: Vec<CostGroup>,
    pub top_sessions: Vec<CostGroup>,
}

/// A group from the raw column values after the key: calls, priced, unpriced, four token sums, cost,
/// cache-read cost, savings (decimal text or NULL), savings unknown, first start.
pub(super) struct RawTotals {
    pub ints: [i64; 7],
    pub decimals: [Option<String>; 3],
    pub savings_unknown: i64,
    pub first_us: i64,
}

impl RawTotals {
    pub(super) fn totals(&self) -> Result<CostTotals, StoreError> {
        let dec = |s: &Option<String>| -> Result<Option<Decimal>, StoreError> {
            s.as_deref()
                .map(|t| {
                    Decimal::from_str(t).map_err(|e| StoreError::Corrupt {
                        id: "cost report".into(),
                        what: format!("{t:?}: {e}"),
                    })
                })
                .transpose()
        };
        let n = |i: usize| u64::try_from(self.ints[i]).unwrap_or(0);
        let priced = n(1);
        // With a priced call every sum is known (a sum over no cache read is 0).
        let known = |d: Option<Decimal>| {
            if priced > 0 {
                Some(d.unwrap_or_default().normalize())
            } else {
                None
            }
        };
        Ok(CostTotals {
            calls: n(0),
            priced_calls: priced,
            unpriced_calls: n(2),
            input_tokens: n(3),
            output_tokens: n(4),
            cache_read_tokens: n(5),
            cache_write_tokens: n(6),
            cost: known(dec(&self.decimals[0])?),
            cache_read_cost: known(dec(&self.decimals[1])?),
            cache_savings: known(dec(&self.decimals[2])?),
            savings_unknown_calls: u64::try_from(self.savings_unknown).unwrap_or(0),
        })
    }
}

/// One call's cache savings (module docs), rounded to [`SAVINGS_DECIMALS`]; None when it read nothing from the
/// cache, was not priced, had no uncached input, or the arithmetic overflows.
pub fn call_savings(
    input: u64,
    cache_read: u64,
    cache_write: u64,
    input_cost: Decimal,
    cache_read_cost: Decimal,
) -> Option<Decimal> {
    let uncached = input.checked_sub(cache_read)?.checked_sub(cache_write)?;
    if cache_read == 0 || uncached == 0 {
        return None;
    }
    let would_cost = Decimal::from(cache_read)
        .checked_mul(input_cost)?
        .checked_div(Decimal::from(uncached))?
        .round_dp_with_strategy(SAVINGS_DECIMALS, RoundingStrategy::MidpointAwayFromZero);
    would_cost.checked_sub(cache_read_cost)
}

/// `dec_sum(text)`: the exact sum of decimal text (NULLs skipped; NULL when there was none).
struct DecSum;

impl Aggregate<Option<Decimal>, Option<String>> for DecSum {
    fn init(&self, _: &mut Context<'_>) -> rusqlite::Result<Option<Decimal>> {
        Ok(None)
    }

    fn step(&self, ctx: &mut Context<'_>, acc: &mut Option<Decimal>) -> rusqlite::Result<()> {
        let Some(text) = ctx.get::<Option<String>>(0)? else {
            return Ok(());
        };
        let d = Decimal::from_str(&text).map_err(|e| rusqlite::Error::UserFunctionError(e.into()))?;
        let sum = acc
            .unwrap_or_default()
            .checked_add(d)
            .ok_or_else(|| rusqlite::Error::UserFunctionError("decimal sum overflows".into()))?;
        *acc = Some(sum);
        Ok(())
    }

    fn finalize(&self, _: &mut Context<'_>, acc: Option<Option<Decimal>>) -> rusqlite::Result<Option<String>> {
        Ok(acc.flatten().map(|d| d.to_string()))
    }
}

/// Registers `dec_sum` and `dec_savings(input, cache_read, cache_write, input_cost, cache_read_cost)` (one
/// call's savings as decimal text, [`call_savings`]) on a reader's connection.
pub(super) fn register(conn: &Connection) -> Result<(), StoreError> {
    let flags = FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC;
    conn.create_aggregate_function("dec_sum", 1, flags, DecSum)?;
    conn.create_scalar_function("dec_savings", 5, flags, |ctx| {
        let int = |i: usize| -> rusqlite::Result<u64> {
            Ok(u64::try_from(ctx.get::<Option<i64>>(i)?.unwrap_or(0)).unwrap_or(0))
        };
        let dec = |i: usize| -> rusqlite::Result<Option<Decimal>> {
            Ok(ctx.get::<Option<String>>(i)?.and_then(|t| Decimal::from_str(&t).ok()))
        };
        let (Some(input_cost), Some(read_cost)) = (dec(3)?, dec(4)?) else {
            return Ok(None);
        };
        Ok(call_savings(int(0)?, int(1)?, int(2)?, input_cost, read_cost).map(|d| d.to_string()))
    })?;
    Ok(())
}

/// Every call of the range with what the report groups by (SQLite): its day number, model, agent (its
/// trajectory's) and session key, usage and cost.
const CALLS: &str = "SELECT t.started_us AS started_us,
        (t.started_us / 1000000 + ?3) / 86400 AS day,
        t.model AS model,
        json_extract(k.body, '$.agent') AS agent,
        COALESCE(k.session_id, k.trajectory_id) AS session,
        t.usage IS NOT NULL AS has_usage,
        COALESCE(json_extract(t.usage, '$.input'), 0) AS input,
        COALESCE(json_extract(t.usage, '$.output'), 0) AS output,
        COALESCE(json_extract(t.usage, '$.cache_read'), 0) AS cache_read,
        COALESCE(json_extract(t.usage, '$.cache_write'), 0) AS cache_write,
        t.cost_usd AS cost, t.cost_input_usd AS cost_input, t.cost_cache_read_usd AS cost_cache_read
    FROM traces t INDEXED BY traces_started LEFT JOIN trajectories k ON k.seq = t.trajectory_seq
    WHERE t.started_us >= ?1 AND t.started_us < ?2";

/// The aggregates after the key, in [`RawTotals`]' order.
const AGGREGATES: &str = "count(*),
        count(*) FILTER (WHERE has_usage AND cost IS NOT NULL),
        count(*) FILTER (WHERE has_usage AND cost IS NULL),
        COALESCE(sum(input), 0), COALESCE(sum(output), 0), COALESCE(sum(cache_read), 0), COALESCE(sum(cache_write), 0),
        dec_sum(cost), dec_sum(cost_cache_read),
        dec_sum(savings),
        count(*) FILTER (WHERE cost IS NOT NULL AND cache_read > 0 AND input - cache_read - cache_write <= 0),
        COALESCE(min(started_us), 0)";

/// The columns of a report row from `first` on.
pub(super) fn raw_from_sqlite(r: &Row<'_>, first: usize) -> rusqlite::Result<RawTotals> {
    let mut ints = [0i64; 7];
    for (i, v) in ints.iter_mut().enumerate() {
        *v = r.get(first + i)?;
    }
    Ok(RawTotals {
        ints,
        decimals: [r.get(first + 7)?, r.get(first + 8)?, r.get(first + 9)?],
        savings_unknown: r.get(first + 10)?,
        first_us: r.get(first + 11)?,
    })
}

/// The group key as the report shows it: a day number becomes its date.
pub(super) fn day_key(day: i64) -> Option<String> {
    chrono::DateTime::from_timestamp(day.checked_mul(86_400)?, 0).map(|d| d.format("%Y-%m-%d").to_string())
}

/// Order groups most expensive first (unknown cost last), then by key.
pub(super) fn by_cost(groups: &mut [CostGroup]) {
    groups.sort_by(|a, b| b.totals.cost.cmp(&a.totals.cost).then_with(|| a.key.cmp(&b.key)));
}

impl StoreReader {
    /// See [`Query::cost_report`](super::Query::cost_report). One statement: the range's calls are read once
    /// (a materialized CTE, each call's savings computed there) and grouped five ways, each group's rows tagged
    /// with its grouping (0 total, 1 day, 2 model, 3 agent, 4 session).
    pub fn cost_report(&self, q: &CostQuery) -> Result<CostReport, StoreError> {
        let sql = format!(
            "WITH c AS MATERIALIZED (SELECT *, dec_savings(input, cache_read, cache_write, cost_input, cost_cache_read)
                 AS savings FROM ({CALLS}))
             SELECT 0, NULL, {AGGREGATES} FROM c
             UNION ALL SELECT 1, day, {AGGREGATES} FROM c GROUP BY day
             UNION ALL SELECT 2, model, {AGGREGATES} FROM c GROUP BY model
             UNION ALL SELECT 3, agent, {AGGREGATES} FROM c GROUP BY agent
             UNION ALL SELECT * FROM (SELECT 4, session, {AGGREGATES} FROM c WHERE session IS NOT NULL
                 GROUP BY session ORDER BY CAST(dec_sum(cost) AS REAL) DESC NULLS LAST, session LIMIT ?4)"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let params = rusqlite::params![q.since_us, q.until_us, q.utc_offset_s, i64::from(q.top)];
        let mut rows = stmt.query(params)?;
        let mut report = CostReport::default();
        while let Some(r) = rows.next()? {
            let kind: i64 = r.get(0)?;
            let key: rusqlite::types::Value = r.get(1)?;
            let raw = raw_from_sqlite(r, 2)?;
            let key = match key {
                rusqlite::types::Value::Integer(d) if kind == 1 => day_key(d),
                rusqlite::types::Value::Text(t) if !t.is_empty() => Some(t),
                _ => None,
            };
            let group = CostGroup {
                key,
                first_us: raw.first_us,
                totals: raw.totals()?,
            };
            match kind {
                0 => report.totals = group.totals,
                1 => report.by_day.push(group),
                2 => report.by_model.push(group),
                3 => report.by_agent.push(group),
                _ => report.top_sessions.push(group),
            }
        }
        report.by_day.sort_by(|a, b| a.key.cmp(&b.key));
        by_cost(&mut report.by_model);
        by_cost(&mut report.by_agent);
        // Ranked in SQL by the sum as a float (exact enough to rank), then again exactly.
        by_cost(&mut report.top_sessions);
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn savings_price_cache_reads_at_the_calls_own_uncached_input_price() {
        let d = |s: &str| Decimal::from_str(s).unwrap_or_else(|e| panic!("{e}"));
        // 100 uncached tokens cost $0.0003 ($3/M): 800 cache reads would have cost $0.0024; they cost $0.00024.
        assert_eq!(
            call_savings(1_000, 800, 100, d("0.0003"), d("0.00024")),
            Some(d("0.00216"))
        );
        // A cache read priced as input saved nothing.
        assert_eq!(call_savings(10, 5, 0, d("0.00005"), d("0.00005")), Some(d("0")));
        // Nothing read from the cache, no uncached token to take a price from, inconsistent usage: unknown.
        assert_eq!(call_savings(1_000, 0, 0, d("0.003"), d("0")), None);
        assert_eq!(call_savings(900, 800, 100, d("0"), d("0.00024")), None);
        assert_eq!(call_savings(10, 800, 100, d("0"), d("0.00024")), None);
        // Rounded to 12 decimals, half away from zero: 1 × $0.000000000001 / 3 tokens.
        assert_eq!(
            call_savings(4, 1, 0, d("0.0000000000015"), d("0")),
            Some(d("0.000000000001"))
        );
    }
}
