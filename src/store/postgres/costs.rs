//! The cost report from the shared store (`store::costs` has the definitions): the same groups in SQL over the
//! traces' heads, sums in `numeric` (exact, as SQLite's `dec_sum`).

use tokio_postgres::Row;

use super::{PgStore, StoreError, db_error};
use crate::store::costs::{CostGroup, CostQuery, CostReport, RawTotals, SAVINGS_DECIMALS, by_cost, day_key};

/// Every call of the range with its day number, model, agent and session key (those of its trajectory's part
/// that names a session, as `session_of` reads it), usage and cost.
const CALLS: &str = "SELECT t.started_us, (t.started_us / 1000000 + $3) / 86400 AS day,
        t.h->>'model' AS model, p.agent, p.session_key AS session,
        COALESCE(jsonb_typeof(t.h->'usage') = 'object', false) AS has_usage,
        COALESCE((t.h->'usage'->>'input')::bigint, 0) AS input,
        COALESCE((t.h->'usage'->>'output')::bigint, 0) AS output,
        COALESCE((t.h->'usage'->>'cache_read')::bigint, 0) AS cache_read,
        COALESCE((t.h->'usage'->>'cache_write')::bigint, 0) AS cache_write,
        (t.h->'cost'->>'total')::numeric AS cost, (t.h->'cost'->>'input')::numeric AS cost_input,
        (t.h->'cost'->>'cache_read')::numeric AS cost_cache_read
    FROM (SELECT started_us, trajectory_id, head::jsonb AS h FROM traces
          WHERE started_us >= $1 AND started_us < $2) t
    LEFT JOIN LATERAL (SELECT q.session_key, q.body::jsonb->>'agent' AS agent FROM trajectory_parts q
          WHERE q.trajectory_id = t.trajectory_id ORDER BY (q.session_key = q.trajectory_id), q.replica LIMIT 1) p
        ON true";

/// `store::costs::RawTotals`' columns; savings as `store::costs::call_savings` computes them.
fn aggregates() -> String {
    format!(
        "count(*),
        count(*) FILTER (WHERE has_usage AND cost IS NOT NULL),
        count(*) FILTER (WHERE has_usage AND cost IS NULL),
        COALESCE(sum(input), 0)::bigint, COALESCE(sum(output), 0)::bigint,
        COALESCE(sum(cache_read), 0)::bigint, COALESCE(sum(cache_write), 0)::bigint,
        sum(cost)::text, sum(cost_cache_read)::text,
        sum(CASE WHEN cache_read > 0 AND input - cache_read - cache_write > 0
            THEN round(cache_read * cost_input / (input - cache_read - cache_write), {SAVINGS_DECIMALS})
                 - cost_cache_read END)::text,
        count(*) FILTER (WHERE cost IS NOT NULL AND cache_read > 0 AND input - cache_read - cache_write <= 0),
        COALESCE(min(started_us), 0)"
    )
}

fn raw(r: &Row, first: usize) -> RawTotals {
    let mut ints = [0i64; 7];
    for (i, v) in ints.iter_mut().enumerate() {
        *v = r.get(first + i);
    }
    RawTotals {
        ints,
        decimals: [r.get(first + 7), r.get(first + 8), r.get(first + 9)],
        savings_unknown: r.get(first + 10),
        first_us: r.get(first + 11),
    }
}

impl PgStore {
    pub(super) fn read_cost_report(&self, q: &CostQuery) -> Result<CostReport, StoreError> {
        let display = self.display.clone();
        let q = q.clone();
        self.block(|c| async move {
            let err = |e| db_error(&display, e);
            let aggregates = aggregates();
            let (since, until, offset, top) = (q.since_us, q.until_us, q.utc_offset_s, i64::from(q.top));
            let run = |key: &'static str, extra: &'static str| {
                let sql = format!("WITH c AS ({CALLS}) SELECT {key}, {aggregates} FROM c {extra}");
                let c = &c;
                async move {
                    if extra.contains("$4") {
                        c.query(&sql, &[&since, &until, &offset, &top]).await
                    } else {
                        c.query(&sql, &[&since, &until, &offset]).await
                    }
                }
            };
            let text_groups = |rows: Vec<Row>| -> Result<Vec<CostGroup>, StoreError> {
                rows.iter()
                    .map(|r| {
                        let raw = raw(r, 1);
                        Ok(CostGroup {
                            key: r.get::<_, Option<String>>(0).filter(|k| !k.is_empty()),
                            first_us: raw.first_us,
                            totals: raw.totals()?,
                        })
                    })
                    .collect()
            };
            let totals = run("NULL::text", "").await.map_err(err)?;
            let totals = match totals.first() {
                Some(r) => raw(r, 1).totals()?,
                None => Default::default(),
            };
            let by_day = run("day", "GROUP BY day ORDER BY day")
                .await
                .map_err(err)?
                .iter()
                .map(|r| {
                    let raw = raw(r, 1);
                    Ok(CostGroup {
                        key: day_key(r.get(0)),
                        first_us: raw.first_us,
                        totals: raw.totals()?,
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            let mut by_model = text_groups(run("model", "GROUP BY model").await.map_err(err)?)?;
            let mut by_agent = text_groups(run("agent", "GROUP BY agent").await.map_err(err)?)?;
            let mut top_sessions = text_groups(
                run(
                    "session",
                    "WHERE session IS NOT NULL GROUP BY session
                     ORDER BY sum(cost) DESC NULLS LAST, session LIMIT $4",
                )
                .await
                .map_err(err)?,
            )?;
            by_cost(&mut by_model);
            by_cost(&mut by_agent);
            by_cost(&mut top_sessions);
            Ok(CostReport {
                totals,
                by_day,
                by_model,
                by_agent,
                top_sessions,
            })
        })
    }
}
