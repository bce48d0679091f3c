//! Reading the store: the CLI and the exporters. Readers use their own connection (WAL lets them run while
//! the writer writes) and stream rows through callbacks, so an export never holds the whole dataset. They read in
//! pages and hold no read transaction while a callback runs: an open read blocks WAL checkpoints, and a
//! callback may wait on a slow consumer for as long as it likes.

use std::path::Path;
use std::sync::Arc;

use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, params_from_iter, types::Value as SqlValue};

use super::StoreError;
use super::codec::decompress;
use super::recent::RecentRecords;
use super::sql::{in_session, rows_of, rows_of_row, trajectory_of_step};
use crate::config::StoreConfig;
use crate::model::cost::CostBreakdown;
use crate::model::exchange::{Api, ExchangeMeta, Outcome, Timings};
use crate::model::json::JsonText;
use crate::model::record::{ExportEntry, ExportKind, ExportSeq};
use crate::model::step::{Step, StepSpanFacts, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use crate::telemetry::Metrics;
use rust_decimal::Decimal;

/// Which traces or steps to read. Empty filter = everything, oldest first.
#[derive(Debug, Clone, Default)]
pub struct TraceFilter {
    /// Matches the explicit session id or the derived trajectory id.
    pub session: Option<String>,
    /// Unix micros, inclusive.
    pub since_us: Option<i64>,
    pub until_us: Option<i64>,
    pub limit: Option<u64>,
}

impl TraceFilter {
    /// SQL condition over the `traces` or `steps` row named `row` (its alias), with its parameters.
    ///
    /// A session is the trajectories with that session key (`sql::in_session`), then their rows by trajectory
    /// number (`sql::rows_of`). The id of one trajectory also matches its rows. A trace or step carries its
    /// trajectory's session id, so this is the set their own `session_id` column names, without a session index
    /// on the two tables every exchange writes to. A trace without a trajectory (a call no adapter read) carries
    /// only the session header and is matched by it (through the trajectory index's NULL entries); every step
    /// has a trajectory.
    fn condition(&self, row: &str, rows: Rows) -> (String, Vec<SqlValue>) {
        let session = match rows {
            Rows::Traces => format!(
                "({row}.trajectory_seq IN (SELECT k.seq FROM trajectories k WHERE {})
                 OR {}
                 OR ({row}.trajectory_seq IS NULL AND {row}.trajectory_id IS NULL AND {row}.session_id = ?1))",
                in_session("k", "?1"),
                rows_of(row, "?1"),
            ),
            Rows::Steps => format!(
                "{row}.seq IN (SELECT o.seq FROM steps o WHERE {}
                 UNION ALL SELECT o.seq FROM trajectories k JOIN steps o ON {} WHERE {})",
                rows_of("o", "?1"),
                rows_of_row("o", "k"),
                in_session("k", "?1")
            ),
        };
        self.condition_on(&session, &format!("{row}.started_us"))
    }

    /// The same condition on the `trajectories` table: its rows with the session key, and the trajectory with
    /// that id.
    fn trajectory_condition(&self) -> (String, Vec<SqlValue>) {
        self.condition_on(
            &format!(
                "({} OR trajectories.trajectory_id = ?1)",
                in_session("trajectories", "?1")
            ),
            "started_us",
        )
    }

    /// `session`: the session clause, with the session as `?1`; `started`: the start column.
    fn condition_on(&self, session: &str, started: &str) -> (String, Vec<SqlValue>) {
        // ?1 is always in the text and bound (to NULL without a session filter): the session clause names it
        // several times, and the parameters after it are numbered from ?2 whatever the filter holds.
        let (mut cond, mut params) = match &self.session {
            Some(s) => (vec![session.to_owned()], vec![SqlValue::Text(s.clone())]),
            None => (vec!["?1 IS NULL".to_owned()], vec![SqlValue::Null]),
        };
        if let Some(t) = self.since_us {
            params.push(SqlValue::Integer(t));
            cond.push(format!("{started} >= ?{}", params.len()));
        }
        if let Some(t) = self.until_us {
            params.push(SqlValue::Integer(t));
            cond.push(format!("{started} <= ?{}", params.len()));
        }
        (cond.join(" AND "), params)
    }
}

/// The table a [`TraceFilter::condition`] is over.
#[derive(Debug, Clone, Copy)]
enum Rows {
    Traces,
    Steps,
}

/// The logs a sink can read behind its cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTable {
    /// What span and file sinks export (calls, tool results, closed trajectories).
    Export,
    /// Every record written, when a shared store is configured (`store::postgres`).
    Ship,
}

impl LogTable {
    fn name(self) -> &'static str {
        match self {
            LogTable::Export => "export_log",
            LogTable::Ship => "ship_log",
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionRow {
    pub summary: TrajectorySummary,
}

pub struct StoreReader {
    pub(super) conn: Connection,
    /// The writer's last committed records, for the exporters' lookups (see `recent.rs`).
    recent: Option<Arc<RecentRecords>>,
}

impl StoreReader {
    pub fn open(data_dir: &Path) -> Result<StoreReader, StoreError> {
        let path = super::db_path(data_dir);
        if !path.exists() {
            // Create it (and its schema) so that reading an empty store is not an error.
            drop(super::open(data_dir)?);
        }
        let conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| StoreError::Open { path, source })?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        super::stable_plans(&conn)?;
        register_step_text(&conn)?;
        super::costs::register(&conn)?;
        Ok(StoreReader { conn, recent: None })
    }

    /// Answer `trace_without_bodies`, `step_span_facts_for_trace`, `parent_trajectory` and `trajectory_light` from
    /// `recent` when it holds the record, from the store otherwise.
    pub fn with_recent(mut self, recent: Arc<RecentRecords>) -> StoreReader {
        self.recent = Some(recent);
        self
    }

    /// The exporters' cache this reader asks first, if it was given one (`with_recent`).
    pub(super) fn recent(&self) -> Option<&RecentRecords> {
        self.recent.as_deref()
    }

    /// Run `f`'s reads in one read transaction: they see one snapshot, and SQLite takes its locks and checks
    /// the WAL once instead of once per statement. A connection also drops its page cache when a statement
    /// starts a read after the writer committed, which under a live writer is every statement: an exporter
    /// building a batch of spans (a few lookups per entry) would read its index pages back from the file for
    /// each lookup. Only for bounded work: the open transaction holds back checkpoints until `f` returns.
    pub fn in_snapshot<T>(&self, f: impl FnOnce(&Self) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.conn.execute_batch("BEGIN")?;
        let result = f(self);
        // A read transaction has nothing to keep: ending it cannot lose anything, so its own error is the one
        // reported only when `f` succeeded.
        let end = self.conn.execute_batch("COMMIT");
        let value = result?;
        end?;
        Ok(value)
    }

    /// Call `f` for each matching trace, oldest first, bodies included.
    ///
    /// Read in pages (see `Page`), and `f` runs between them with no read transaction open: a consumer that
    /// blocks (a stalled API client, `llmtap export | less`) cannot hold back WAL checkpoints. Each page resumes
    /// after the last trace handed on, by its (started_us, seq) key.
    pub fn for_each_trace(
        &self,
        filter: &TraceFilter,
        mut f: impl FnMut(ProviderTrace) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let (cond, params) = filter.condition("t", Rows::Traces);
        // `traces_started` is ordered by (started_us, rowid = seq): a page is an index range, not a sort.
        let sql = format!(
            "{TRACE_SELECT} WHERE {cond} AND (t.started_us, t.seq) > (?, ?) ORDER BY t.started_us, t.seq LIMIT ?"
        );
        let mut remaining = filter.limit.unwrap_or(u64::MAX);
        let mut after = (i64::MIN, i64::MIN);
        while remaining > 0 {
            let want = remaining.min(Page::ROWS);
            let mut page = Vec::new();
            {
                let mut stmt = self.conn.prepare_cached(&sql)?;
                let mut args = params.clone();
                args.extend([after.0, after.1, want as i64].map(SqlValue::Integer));
                let mut rows = stmt.query(params_from_iter(args))?;
                let mut bytes = 0;
                while let Some(row) = rows.next()? {
                    let key = (row.get(11)?, row.get(TRACE_SEQ_COLUMN)?);
                    let trace = trace_from_row(&self.conn, row)?;
                    bytes += trace.request.as_str().len()
                        + trace.response.as_str().len()
                        + trace.raw_response.as_ref().map_or(0, |r| r.len());
                    page.push((key, trace));
                    if bytes >= Page::BYTES {
                        break;
                    }
                }
                // Dropping `rows` resets the statement, which ends the read transaction before `f` runs.
            }
            if page.is_empty() {
                break;
            }
            for (key, trace) in page {
                after = key;
                remaining -= 1;
                f(trace)?;
            }
        }
        Ok(())
    }

    pub fn traces(&self, filter: &TraceFilter) -> Result<Vec<ProviderTrace>, StoreError> {
        let mut out = Vec::new();
        self.for_each_trace(filter, |t| {
            out.push(t);
            Ok(())
        })?;
        Ok(out)
    }

    /// Steps in trajectory order (trajectories by start time, steps by index). Paged like `for_each_trace`.
    pub fn for_each_step(
        &self,
        filter: &TraceFilter,
        mut f: impl FnMut(Step) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut remaining = filter.limit.unwrap_or(u64::MAX);
        let mut after = StepKey::FIRST;
        while remaining > 0 {
            let page = self.step_page(filter, &after, remaining.min(Page::ROWS))?;
            if page.is_empty() {
                break;
            }
            for (key, id, body) in page {
                after = key;
                remaining -= 1;
                let step = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
                    id,
                    what: e.to_string(),
                })?;
                f(step)?;
            }
        }
        Ok(())
    }

    /// One page of steps after `after`: (key, step id, body). The order (trajectory start, trajectory, index)
    /// has no index, so the keys are sorted first without the bodies (a sort would otherwise carry every body
    /// of the table), then the page's bodies are read by primary key, in the same short read transaction.
    fn step_page(
        &self,
        filter: &TraceFilter,
        after: &StepKey,
        want: u64,
    ) -> Result<Vec<(StepKey, String, String)>, StoreError> {
        let (cond, mut params) = filter.condition("s", Rows::Steps);
        let sql = format!(
            "SELECT COALESCE(tr.started_us, s.started_us) AS k, s.trajectory_id, s.step_index, s.seq FROM steps s
             LEFT JOIN trajectories tr ON tr.trajectory_id = s.trajectory_id
             WHERE {cond} AND (COALESCE(tr.started_us, s.started_us), s.trajectory_id, s.step_index, s.seq) > (?, ?, ?, ?)
             ORDER BY k, s.trajectory_id, s.step_index, s.seq LIMIT ?"
        );
        params.extend([
            SqlValue::Integer(after.started_us),
            SqlValue::Text(after.trajectory_id.clone()),
            SqlValue::Integer(after.step_index),
            SqlValue::Integer(after.seq),
            SqlValue::Integer(want as i64),
        ]);
        let tx = self.conn.unchecked_transaction()?;
        let keys = {
            let mut stmt = tx.prepare_cached(&sql)?;
            let rows = stmt.query_map(params_from_iter(params), |r| {
                Ok(StepKey {
                    started_us: r.get(0)?,
                    trajectory_id: r.get(1)?,
                    step_index: r.get(2)?,
                    seq: r.get(3)?,
                })
            })?;
            rows.collect::<Result<Vec<_>, _>>()?
        };
        let mut page = Vec::with_capacity(keys.len());
        let mut bytes = 0;
        {
            let mut body = tx.prepare_cached("SELECT step_id, body FROM steps WHERE seq = ?1")?;
            for key in keys {
                let row: Option<(String, SqlValue)> =
                    body.query_row([key.seq], |r| Ok((r.get(0)?, r.get(1)?))).optional()?;
                if let Some((id, stored)) = row {
                    let text = step_text(&id, stored)?;
                    bytes += text.len();
                    page.push((key, id, text));
                }
                if bytes >= Page::BYTES {
                    break;
                }
            }
        }
        tx.commit()?;
        Ok(page)
    }

    pub fn steps(&self, filter: &TraceFilter) -> Result<Vec<Step>, StoreError> {
        let mut out = Vec::new();
        self.for_each_step(filter, |s| {
            out.push(s);
            Ok(())
        })?;
        Ok(out)
    }

    /// Trajectories, oldest first. Read in pages, resumed by (started_us, trajectory_id).
    pub fn sessions(&self, filter: &TraceFilter) -> Result<Vec<SessionRow>, StoreError> {
        let (cond, params) = filter.trajectory_condition();
        let sql = format!(
            "SELECT trajectory_id, body, system_prompts, tool_definitions, started_us FROM trajectories
             WHERE {cond} AND (started_us, trajectory_id) > (?, ?) ORDER BY started_us, trajectory_id LIMIT ?"
        );
        let mut remaining = filter.limit.unwrap_or(u64::MAX);
        let mut after = (i64::MIN, String::new());
        let mut out = Vec::new();
        while remaining > 0 {
            let want = remaining.min(Page::ROWS);
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut args = params.clone();
            args.extend([
                SqlValue::Integer(after.0),
                SqlValue::Text(after.1.clone()),
                SqlValue::Integer(want as i64),
            ]);
            let mut rows = stmt.query(params_from_iter(args))?;
            let before = out.len();
            while let Some(row) = rows.next()? {
                let summary = summary_from_row(row)?;
                after = (row.get(4)?, summary.trajectory_id.clone());
                out.push(SessionRow { summary });
                remaining -= 1;
            }
            if out.len() == before {
                break;
            }
        }
        Ok(out)
    }

    pub fn trace(&self, id: &str) -> Result<Option<ProviderTrace>, StoreError> {
        self.trace_by_id(TRACE_SELECT, id)
    }

    /// The trace with its bodies left out (null): for readers that need only its facts.
    pub fn trace_without_bodies(&self, id: &str) -> Result<Option<ProviderTrace>, StoreError> {
        if let Some(t) = self.recent.as_ref().and_then(|r| r.trace_without_bodies(id)) {
            return Ok(Some(t));
        }
        self.trace_by_id(TRACE_SELECT_WITHOUT_BODIES, id)
    }

    fn trace_by_id(&self, select: &str, id: &str) -> Result<Option<ProviderTrace>, StoreError> {
        let sql = format!("{select} WHERE t.id = ?1");
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut rows = stmt.query([id])?;
        match rows.next()? {
            Some(row) => Ok(Some(trace_from_row(&self.conn, row)?)),
            None => Ok(None),
        }
    }

    /// The first agent step (by `seq`) of the rows on `condition` (over the steps row `s`, with `params`),
    /// deserialized as `T` (a [`Step`], or a part of one).
    fn step_where<T: serde::de::DeserializeOwned>(
        &self,
        condition: &str,
        params: impl rusqlite::Params,
    ) -> Result<Option<T>, StoreError> {
        let sql =
            format!("SELECT step_id, body FROM steps s WHERE {condition} AND s.role = 'agent' ORDER BY s.seq LIMIT 1");
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut rows = stmt.query(params)?;
        match rows.next()? {
            Some(row) => Ok(Some(step_from_row(row)?)),
            None => Ok(None),
        }
    }

    /// The agent step derived from a provider trace.
    pub fn step_for_trace(&self, trace_id: &str) -> Result<Option<Step>, StoreError> {
        self.step_where("s.trace_id = ?1", [trace_id])
    }

    /// What the agent step derived from a provider trace adds to the trace's span (see [`StepSpanFacts`]).
    pub fn step_span_facts_for_trace(&self, trace_id: &str) -> Result<Option<StepSpanFacts>, StoreError> {
        if let Some(facts) = self.recent.as_ref().and_then(|r| r.step_span_facts_for_trace(trace_id)) {
            return Ok(Some(facts));
        }
        self.step_where("s.trace_id = ?1", [trace_id])
    }

    /// The agent step with this id, found under its trajectory (the id's first part, `sql::trajectory_of_step`).
    pub fn step(&self, step_id: &str) -> Result<Option<Step>, StoreError> {
        let Some(trajectory) = trajectory_of_step(step_id) else {
            return Ok(None);
        };
        self.step_where(
            &format!("{} AND s.step_id = ?2", rows_of("s", "?1")),
            [trajectory, step_id],
        )
    }

    /// One trajectory by id, with its system prompts and tool definitions (see also `trajectory_light`).
    pub fn trajectory(&self, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
        self.trajectory_by(
            "SELECT trajectory_id, body, system_prompts, tool_definitions FROM trajectories WHERE trajectory_id = ?1",
            id,
        )
    }

    /// The trajectory `sql` selects for `id`, as (trajectory_id, body, system_prompts, tool_definitions).
    pub(super) fn trajectory_by(&self, sql: &str, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let mut rows = stmt.query([id])?;
        match rows.next()? {
            Some(row) => Ok(Some(summary_from_row(row)?)),
            None => Ok(None),
        }
    }

    /// The trajectory a trajectory hangs under (`parent_trajectory_id`), read from its row alone; None when it
    /// has no parent or there is no such trajectory. The exporter walks this chain once per trajectory to find
    /// the trace a span belongs to.
    pub fn parent_trajectory(&self, id: &str) -> Result<Option<String>, StoreError> {
        if let Some(parent) = self.recent.as_ref().and_then(|r| r.parent_trajectory(id)) {
            return Ok(parent);
        }
        #[derive(serde::Deserialize)]
        struct Parent {
            #[serde(default)]
            parent_trajectory_id: Option<String>,
        }
        let mut stmt = self
            .conn
            .prepare_cached("SELECT body FROM trajectories WHERE trajectory_id = ?1")?;
        let Some(body) = stmt.query_row([id], |r| r.get::<_, String>(0)).optional()? else {
            return Ok(None);
        };
        serde_json::from_str::<Parent>(&body)
            .map(|p| p.parent_trajectory_id)
            .map_err(|e| StoreError::Corrupt {
                id: id.to_owned(),
                what: e.to_string(),
            })
    }

    /// Export log entries after `after`, oldest first, at most `limit` rows read.
    pub fn export_log(&self, after: ExportSeq, limit: usize) -> Result<Vec<ExportEntry>, StoreError> {
        self.log_entries(LogTable::Export, after, limit)
    }

    /// Entries of `table` after `after`, oldest first, at most `limit` rows read.
    pub fn log_entries(&self, table: LogTable, after: ExportSeq, limit: usize) -> Result<Vec<ExportEntry>, StoreError> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT seq, kind, ref FROM {} WHERE seq > ?1 ORDER BY seq LIMIT ?2",
            table.name()
        ))?;
        let rows = stmt.query_map(rusqlite::params![after.0, limit as i64], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?))
        })?;
        let mut entries = Vec::new();
        for row in rows {
            let (seq, kind, reference) = row?;
            let kind = ExportKind::parse(&kind).ok_or_else(|| StoreError::Corrupt {
                id: format!("export_log {seq}"),
                what: format!("unknown kind {kind:?}"),
            })?;
            entries.push(ExportEntry {
                seq: ExportSeq(seq),
                kind,
                reference,
            });
        }
        Ok(entries)
    }

    /// How many export-log entries lie after `after` (a sink's lag): the head's seq minus the cursor's. Seqs
    /// are written dense (AUTOINCREMENT; a rolled-back batch takes its seqs back with it), so this is the count,
    /// except that entries retention deleted before they were exported still count until the cursor passes
    /// them. The exporter asks once per batch; a `COUNT(*)` visited every pending row each time, which during
    /// a large backlog (a spill being drained) was hundreds of thousands of rows per batch.
    pub fn export_pending(&self, after: ExportSeq) -> Result<u64, StoreError> {
        Ok(self.export_head()?.0.saturating_sub(after.0).max(0) as u64)
    }

    pub fn export_head(&self) -> Result<ExportSeq, StoreError> {
        self.log_head(LogTable::Export)
    }

    /// The last entry's position in `table` (0 when empty).
    pub fn log_head(&self, table: LogTable) -> Result<ExportSeq, StoreError> {
        Ok(ExportSeq(
            self.conn
                .prepare_cached(&format!("SELECT COALESCE(MAX(seq), 0) FROM {}", table.name()))?
                .query_row([], |r| r.get(0))?,
        ))
    }

    /// Any step by id, whatever its role (see `step` for agent steps): what the shared store receives.
    pub fn step_by_id(&self, step_id: &str) -> Result<Option<Step>, StoreError> {
        let Some(trajectory) = trajectory_of_step(step_id) else {
            return Ok(None);
        };
        let sql = format!(
            "SELECT step_id, body FROM steps s WHERE {} AND s.step_id = ?2",
            rows_of("s", "?1")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut rows = stmt.query([trajectory, step_id])?;
        match rows.next()? {
            Some(row) => Ok(Some(step_from_row(row)?)),
            None => Ok(None),
        }
    }

    pub fn count_traces(&self) -> Result<u64, StoreError> {
        Ok(self
            .conn
            .query_row("SELECT COUNT(*) FROM traces", [], |r| r.get::<_, i64>(0))? as u64)
    }
}

/// `step_text(body)` in SQL: a step body's JSON text whether stored compressed or as text (NULL if unreadable),
/// so that queries can search step contents.
fn register_step_text(conn: &Connection) -> Result<(), StoreError> {
    use rusqlite::functions::FunctionFlags;
    conn.create_scalar_function(
        "step_text",
        1,
        FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC,
        |ctx| {
            let stored: SqlValue = ctx.get(0)?;
            Ok(step_text("", stored).ok())
        },
    )?;
    Ok(())
}

/// A step's stored JSON: a blob as `codec.rs` stores bodies (see `write::upsert_step`), or text in rows written
/// before.
pub(super) fn step_text(id: &str, stored: SqlValue) -> Result<String, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt {
        id: id.to_owned(),
        what: what.to_owned(),
    };
    match stored {
        SqlValue::Text(t) => Ok(t),
        SqlValue::Blob(b) => decompress(Some(b)).ok_or_else(|| corrupt("unreadable step body")),
        _ => Err(corrupt("step body is neither text nor a compressed blob")),
    }
}

/// A step, or a part of one (`T`), from (step_id, body).
pub(super) fn step_from_row<T: serde::de::DeserializeOwned>(row: &rusqlite::Row<'_>) -> Result<T, StoreError> {
    let id: String = row.get(0)?;
    let body = step_text(&id, row.get(1)?)?;
    serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
        id,
        what: e.to_string(),
    })
}

/// A trajectory summary from (trajectory_id, body, system_prompts, tool_definitions).
pub(super) fn summary_from_row(row: &Row<'_>) -> Result<TrajectorySummary, StoreError> {
    let id: String = row.get(0)?;
    let body: String = row.get(1)?;
    let prompts: Option<String> = row.get(2)?;
    let tools: Option<String> = row.get(3)?;
    let mut summary: TrajectorySummary = serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
        id,
        what: e.to_string(),
    })?;
    summary.system_prompts = prompts.and_then(|p| serde_json::from_str(&p).ok()).unwrap_or_default();
    summary.tool_definitions = tools.and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    Ok(summary)
}

/// How much one read of a paged reader holds before the rows are handed on: a bounded number of rows and, for
/// rows with bodies, of bytes (a page of large prompts stays a few MiB).
struct Page;

impl Page {
    const ROWS: u64 = 256;
    const BYTES: usize = 4 << 20;
}

/// Where a paged step read resumes: the sort key of the last step handed on.
struct StepKey {
    started_us: i64,
    trajectory_id: String,
    step_index: i64,
    seq: i64,
}

impl StepKey {
    /// Sorts before every stored step: the lowest value of each key column.
    const FIRST: StepKey = StepKey {
        started_us: i64::MIN,
        trajectory_id: String::new(),
        step_index: i64::MIN,
        seq: i64::MIN,
    };
}

/// `TRACE_SELECT`'s column holding the row's seq (the paged reader's resume key, after `trace_from_row`'s).
const TRACE_SEQ_COLUMN: usize = 30;

/// The columns `trace_from_row` reads, in its order, then `t.seq`.
pub(super) const TRACE_SELECT: &str =
    "SELECT t.id, t.trajectory_id, t.upstream, t.api, t.method, t.path, t.status, t.outcome,
    t.error, t.streamed, t.model, t.started_us, t.first_byte_us, t.ended_us, t.request_bytes, t.response_bytes, t.usage,
    t.request_headers, t.response_headers, t.metadata, b.request, b.response, b.raw_response, t.facts, t.cost_usd,
    t.cost_input_usd, t.cost_cache_read_usd, t.cost_cache_write_usd, t.cost_output_usd, t.cost_reasoning_usd, t.seq,
    t.session_id
    FROM traces t LEFT JOIN trace_bodies b ON b.trace_id = t.id";

/// `TRACE_SELECT` without the bodies (read as NULL).
const TRACE_SELECT_WITHOUT_BODIES: &str = "SELECT t.id, t.trajectory_id, t.upstream, t.api, t.method, t.path, t.status,
    t.outcome, t.error, t.streamed, t.model, t.started_us, t.first_byte_us, t.ended_us, t.request_bytes,
    t.response_bytes, t.usage, t.request_headers, t.response_headers, t.metadata, NULL, NULL, NULL, t.facts,
    t.cost_usd, t.cost_input_usd, t.cost_cache_read_usd, t.cost_cache_write_usd, t.cost_output_usd,
    t.cost_reasoning_usd, t.seq, t.session_id
    FROM traces t";

pub(super) fn trace_from_row(conn: &Connection, row: &Row<'_>) -> Result<ProviderTrace, StoreError> {
    let id: String = row.get(0)?;
    let corrupt = |what: String| StoreError::Corrupt { id: id.clone(), what };
    let headers = |s: String| -> Result<Vec<(String, String)>, StoreError> {
        serde_json::from_str(&s).map_err(|e| corrupt(e.to_string()))
    };
    let usage: Option<String> = row.get(16)?;
    let facts: Option<String> = row.get(23)?;
    let facts = facts
        .map(|f| serde_json::from_str(&f).map_err(|e| corrupt(e.to_string())))
        .transpose()?;
    let meta: String = row.get(19)?;
    let meta: ExchangeMeta = serde_json::from_str(&meta).map_err(|e| corrupt(e.to_string()))?;
    let cost = cost_from_row(row, 24).map_err(corrupt)?;
    Ok(ProviderTrace {
        trajectory_id: row.get(1)?,
        upstream: row.get(2)?,
        api: Api::parse(&row.get::<_, String>(3)?),
        method: row.get(4)?,
        path: row.get(5)?,
        status: row.get(6)?,
        outcome: Outcome::parse(&row.get::<_, String>(7)?),
        error: row.get(8)?,
        streamed: row.get(9)?,
        model: row.get(10)?,
        timings: Timings {
            start: row.get(11)?,
            first_byte: row.get(12)?,
            end: row.get(13)?,
        },
        request_bytes: row.get::<_, i64>(14)? as u64,
        response_bytes: row.get::<_, i64>(15)? as u64,
        usage: usage.and_then(|u| serde_json::from_str(&u).ok()),
        cost,
        request_headers: headers(row.get(17)?)?,
        response_headers: headers(row.get(18)?)?,
        meta,
        request: JsonText::from_stored(super::chunks::load_request(conn, row.get(20)?)),
        response: JsonText::from_stored(decompress(row.get(21)?)),
        raw_response: decompress(row.get(22)?),
        facts,
        session_id: row.get(31)?,
        id,
    })
}

/// A call's cost from six columns starting at `first` (total, then the parts in `CostBreakdown`'s order); `None`
/// when the total is NULL (unknown, or a row stored before costs were kept).
pub(super) fn cost_from_row(row: &Row<'_>, first: usize) -> Result<Option<CostBreakdown>, String> {
    let mut d = [Decimal::ZERO; 6];
    for (i, slot) in d.iter_mut().enumerate() {
        let text: Option<String> = row.get(first + i).map_err(|e| e.to_string())?;
        match text {
            Some(t) => {
                *slot = t
                    .parse()
                    .map_err(|e| format!("cost column {}: {t:?}: {e}", first + i))?
            }
            None if i == 0 => return Ok(None),
            None => return Err(format!("cost column {} is NULL while the total is not", first + i)),
        }
    }
    let [total, input, cache_read, cache_write, output, reasoning] = d;
    Ok(Some(CostBreakdown {
        input,
        cache_read,
        cache_write,
        output,
        reasoning,
        total,
    }))
}

/// Annotations go with what they are about (retention is also how a team keeps its store free of old
/// conversations, and a note may quote one): a step's with the step, a trajectory's (and its steps') with the
/// trajectory's last step, a session's with the session's last trajectory. Only what this run retired is
/// looked at (`retired_step_rows`, `retired_sessions`): a session of calls no adapter read has no trajectory,
/// and its annotations stay.
const ANNOTATIONS_OF_RETIRED: &str = "
    DELETE FROM annotations WHERE target = 'step' AND target_id IN (SELECT step_id FROM retired_step_rows);
    DELETE FROM annotations WHERE trajectory_id IN (SELECT trajectory_id FROM retired_step_rows)
        AND NOT EXISTS (SELECT 1 FROM trajectories t WHERE t.trajectory_id = annotations.trajectory_id);
    DELETE FROM annotations WHERE target = 'session' AND session_key IN (SELECT key FROM retired_sessions)
        AND NOT EXISTS (SELECT 1 FROM trajectories t WHERE COALESCE(t.session_id, t.trajectory_id) = annotations.session_key);";

/// Delete traces (with their bodies, steps and emptied trajectories) beyond the configured age or count. Counts
/// what went before export.
/// Returns how many body chunks went with them (see `chunks.rs`).
pub(crate) fn apply_retention(conn: &Connection, config: &StoreConfig, metrics: &Metrics) -> Result<u64, StoreError> {
    let mut cutoff_seq: Option<i64> = None;
    if config.retention_days > 0 {
        let cutoff_us = crate::model::exchange::now_micros() - (config.retention_days as i64) * 86_400_000_000;
        let seq: Option<i64> =
            conn.query_row("SELECT MAX(seq) FROM traces WHERE started_us < ?1", [cutoff_us], |r| {
                r.get(0)
            })?;
        cutoff_seq = seq;
    }
    if config.max_traces > 0 {
        let seq: Option<i64> = conn
            .query_row(
                "SELECT seq FROM traces ORDER BY seq DESC LIMIT 1 OFFSET ?1",
                [config.max_traces as i64],
                |r| r.get(0),
            )
            .optional()?;
        cutoff_seq = cutoff_seq.max(seq);
    }
    let Some(cutoff) = cutoff_seq else { return Ok(0) };
    // Cursors are positions in the export log, not in `traces`: a trace is unexported when its call's 'chat'
    // entry lies beyond the slowest sink's cursor. (Comparing trace seqs with cursors mixed two sequences and
    // missed unexported traces as soon as tool and agent entries interleaved with the calls.) No sink, no
    // cursor: nothing is owed to anyone.
    let min_cursor: Option<i64> = conn.query_row("SELECT MIN(seq) FROM cursors", [], |r| r.get(0))?;
    if let Some(c) = min_cursor {
        let unexported: i64 = conn.query_row(
            "SELECT COUNT(DISTINCT e.ref) FROM export_log e JOIN traces t ON t.id = e.ref
             WHERE e.kind = 'chat' AND e.seq > ?1 AND t.seq <= ?2",
            [c, cutoff],
            |r| r.get(0),
        )?;
        metrics.evicted_unexported.add(unexported as u64);
    }
    // What was derived from the removed traces goes with them: their steps, trajectories left without a step,
    // and the export-log entries that point at any of these (otherwise steps and the log grew without bound
    // under a retention limit). One transaction: a reader never sees steps whose trace is gone but not they.
    let tx = conn.unchecked_transaction()?;
    tx.execute_batch(
        "CREATE TEMP TABLE IF NOT EXISTS retired_traces (id TEXT PRIMARY KEY);
         CREATE TEMP TABLE IF NOT EXISTS retired_step_rows (seq INTEGER PRIMARY KEY, step_id TEXT NOT NULL,
             trajectory_id TEXT NOT NULL);
         CREATE TEMP TABLE IF NOT EXISTS retired_sessions (key TEXT PRIMARY KEY);
         DELETE FROM retired_traces; DELETE FROM retired_step_rows; DELETE FROM retired_sessions;",
    )?;
    tx.execute(
        "INSERT INTO retired_traces SELECT id FROM traces WHERE seq <= ?1",
        [cutoff],
    )?;
    let chunks_deleted = super::chunks::release_retired(&tx)?;
    // A trajectory goes when its last step does: only those of the retired steps are looked at, each by its
    // number (`sql::rows_of`).
    let emptied = format!(
        "SELECT DISTINCT r.trajectory_id FROM retired_step_rows r
         WHERE NOT EXISTS (SELECT 1 FROM steps s WHERE {})",
        rows_of("s", "r.trajectory_id")
    );
    tx.execute_batch(&format!(
        "INSERT INTO retired_step_rows SELECT seq, step_id, trajectory_id FROM steps
             WHERE trace_id IN (SELECT id FROM retired_traces);
         DELETE FROM trace_bodies WHERE trace_id IN (SELECT id FROM retired_traces);
         DELETE FROM export_log WHERE kind = 'chat' AND ref IN (SELECT id FROM retired_traces);
         DELETE FROM export_log WHERE kind = 'tools' AND ref IN (SELECT step_id FROM retired_step_rows);
         DELETE FROM steps WHERE seq IN (SELECT seq FROM retired_step_rows);
         DELETE FROM export_log WHERE kind = 'agent' AND ref IN ({emptied});
         INSERT OR IGNORE INTO retired_sessions SELECT COALESCE(session_id, trajectory_id) FROM trajectories
             WHERE trajectory_id IN ({emptied});
         DELETE FROM trajectories WHERE trajectory_id IN ({emptied});
         {ANNOTATIONS_OF_RETIRED}"
    ))?;
    let n = tx.execute("DELETE FROM traces WHERE seq <= ?1", [cutoff])?;
    tx.commit()?;
    metrics.evicted.add(n as u64);
    Ok(chunks_deleted)
}

/// A sink's export position, kept in the store so that a restart resumes where it stopped.
pub struct Cursor {
    conn: Connection,
    sink: String,
}

impl Cursor {
    /// Opens the sink's cursor, registering it at the start of the log if it has none yet: retention counts
    /// what it evicts before every registered sink exported it, including a sink that never delivered a batch.
    pub fn open(data_dir: &Path, sink: &str) -> Result<Cursor, StoreError> {
        // A cursor commit must not run a checkpoint on the exporter's thread.
        let conn = super::open_without_checkpoints(data_dir)?;
        conn.execute("INSERT OR IGNORE INTO cursors (sink, seq) VALUES (?1, 0)", [sink])?;
        Ok(Cursor {
            conn,
            sink: sink.to_owned(),
        })
    }

    pub fn get(&self) -> Result<ExportSeq, StoreError> {
        let v: Option<i64> = self
            .conn
            .prepare_cached("SELECT seq FROM cursors WHERE sink = ?1")?
            .query_row([&self.sink], |r| r.get(0))
            .optional()?;
        Ok(ExportSeq(v.unwrap_or(0)))
    }

    pub fn set(&self, seq: ExportSeq) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO cursors (sink, seq) VALUES (?1, ?2) ON CONFLICT(sink) DO UPDATE SET seq = excluded.seq",
            )?
            .execute(rusqlite::params![self.sink, seq.0])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::StatementStatus;

    use super::*;

    /// Three conversations, the first two put in session "S", and a call no adapter read (no trajectory) that
    /// carries only the session header "S": the rows of each kind, written by the real writer.
    fn sessions_store() -> (tempfile::TempDir, StoreReader, Vec<String>) {
        use crate::derive::testkit::{Harness, call, text_out, trace, user};
        use crate::model::record::Record;
        let mut h = Harness::new(Api::OpenAiChat);
        let mut records = Vec::new();
        let mut trajectories = Vec::new();
        for (i, session) in [Some("S"), Some("S"), None].into_iter().enumerate() {
            let t = trace(h.api, h.now, h.now + 1_000);
            h.now += 1_000_000;
            let mut out = h
                .deriver
                .observe(t, Some(call("agent", vec![user(&format!("task {i}"))], text_out("ok"))));
            for r in &mut out {
                match r {
                    Record::Trace(t) => {
                        trajectories.extend(t.trajectory_id.clone());
                        if session.is_some() {
                            t.session_id = session.map(str::to_owned);
                        }
                    }
                    Record::Step(st) if session.is_some() => st.session_id = session.map(str::to_owned),
                    Record::Trajectory(tr) if session.is_some() => tr.session_id = session.map(str::to_owned),
                    _ => {}
                }
            }
            records.extend(out);
        }
        let mut unread = trace(h.api, h.now, h.now + 1_000);
        unread.meta.session = Some("S".into());
        records.extend(h.deriver.observe(unread, None));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        super::super::write::write_batch(&mut conn, &records, &mut super::super::chunks::ChunkCache::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let reader = StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        (dir, reader, trajectories)
    }

    /// A read's ids, sorted (a failed read fails the test).
    fn sorted<E: std::fmt::Display>(read: Result<impl Iterator<Item = String>, E>) -> Vec<String> {
        let mut ids: Vec<String> = read.unwrap_or_else(|e| panic!("{e}")).collect();
        ids.sort();
        ids
    }

    /// The ids a filter should return, from each table's own `session_id` and `trajectory_id` columns.
    fn expected(reader: &StoreReader, table: &str, id: &str, filter: &TraceFilter) -> Vec<String> {
        let sql = format!(
            "SELECT {id} FROM {table} WHERE (?1 IS NULL OR session_id = ?1 OR trajectory_id = ?1)
             AND started_us >= ?2 AND started_us <= ?3 ORDER BY {id}"
        );
        let mut stmt = reader.conn.prepare(&sql).unwrap_or_else(|e| panic!("{e}"));
        let session = filter.session.clone().map_or(SqlValue::Null, SqlValue::Text);
        let (since, until) = (filter.since_us.unwrap_or(i64::MIN), filter.until_us.unwrap_or(i64::MAX));
        stmt.query_map(
            params_from_iter([session, SqlValue::Integer(since), SqlValue::Integer(until)]),
            |r| r.get(0),
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_session_filter_finds_the_rows_its_session_column_names_without_a_session_index() {
        let (_dir, reader, trajectories) = sessions_store();
        let started: Vec<i64> = reader
            .traces(&TraceFilter::default())
            .unwrap_or_else(|e| panic!("{e}"))
            .iter()
            .map(|t| t.timings.start)
            .collect();
        assert_eq!(started.len(), 4);
        let filters = [
            TraceFilter::default(),
            TraceFilter {
                session: Some("S".into()),
                ..TraceFilter::default()
            },
            TraceFilter {
                session: Some(trajectories[2].clone()),
                ..TraceFilter::default()
            },
            TraceFilter {
                session: Some(trajectories[0].clone()),
                ..TraceFilter::default()
            },
            TraceFilter {
                session: Some("S".into()),
                since_us: Some(started[1]),
                ..TraceFilter::default()
            },
            TraceFilter {
                session: Some("S".into()),
                until_us: Some(started[0]),
                ..TraceFilter::default()
            },
            TraceFilter {
                since_us: Some(started[1]),
                until_us: Some(started[2]),
                ..TraceFilter::default()
            },
            TraceFilter {
                session: Some("nobody".into()),
                ..TraceFilter::default()
            },
        ];
        let mut seen_s = 0;
        for filter in &filters {
            let traces = sorted(reader.traces(filter).map(|ts| ts.into_iter().map(|t| t.id)));
            assert_eq!(traces, expected(&reader, "traces", "id", filter), "{filter:?}");
            let steps = sorted(reader.steps(filter).map(|ss| ss.into_iter().map(|s| s.step_id)));
            assert_eq!(steps, expected(&reader, "steps", "step_id", filter), "{filter:?}");
            if filter.session.as_deref() == Some("S") && filter.since_us.is_none() && filter.until_us.is_none() {
                // Two conversations and the unread call.
                assert_eq!(traces.len(), 3);
                seen_s += 1;
            }
        }
        assert_eq!(seen_s, 1);
        // A session's rows come by index: no scan of any table.
        for (table, alias, rows) in [("traces", "t", Rows::Traces), ("steps", "s", Rows::Steps)] {
            let (cond, params) = filters[1].condition(alias, rows);
            let sql = format!("SELECT {alias}.seq FROM {table} {alias} WHERE {cond}");
            let plan = super::super::query_plan(&reader.conn, &sql, params_from_iter(params)).join("\n");
            assert!(!plan.lines().any(|l| l.contains("SCAN ")), "{plan}");
            assert!(plan.contains("trajectories_named_session"), "{plan}");
        }
    }

    /// The exporter's partial reads give what the whole records hold: the span facts of an agent step with
    /// content, tool calls and every span field set; a trajectory's parent; a trajectory without its prompts and
    /// tool definitions.
    #[test]
    fn the_exporters_partial_reads_agree_with_the_whole_records() {
        use crate::derive::testkit::{Harness, call, calls_out, tool_call, trace, user};
        use crate::model::call::ToolDef;
        use crate::model::record::Record;
        use crate::model::step::{CallType, Purpose, StepRole};
        let mut h = Harness::new(Api::OpenAiChat);
        let c = tool_call("c1", "read", serde_json::json!({ "path": "a \"quoted\" path" }));
        let mut call = call("agent", vec![user("fix the bug")], calls_out(std::slice::from_ref(&c)));
        call.system = Some("You are careful.".into());
        call.tools = vec![ToolDef {
            name: "read".into(),
            description: Some("reads a file".into()),
            parameters: None,
        }];
        let mut records = h.deriver.observe(trace(h.api, h.now, h.now + 1_000), Some(call));
        let mut trace_id = None;
        let mut trajectory_id = None;
        for r in &mut records {
            match r {
                Record::Step(st) if st.role == StepRole::Agent => {
                    trace_id = st.provider_trace_id.clone();
                    st.agent_role = Some("reviewer".into());
                    st.call_type = Some(CallType::Subagent);
                    st.purpose = Some(Purpose::Title);
                    st.token_usage.prefix_reuse_tokens = 1234;
                    st.token_usage.prefix_reuse_estimated = true;
                }
                Record::Trajectory(t) => {
                    trajectory_id = Some(t.trajectory_id.clone());
                    t.parent_trajectory_id = Some("tr_parent".into());
                }
                _ => {}
            }
        }
        let (Some(trace_id), Some(trajectory_id)) = (trace_id, trajectory_id) else {
            panic!("no agent step or trajectory in {records:#?}")
        };
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        super::super::write::write_batch(&mut conn, &records, &mut super::super::chunks::ChunkCache::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let reader = StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        fn ok<T>(r: Result<T, StoreError>) -> T {
            r.unwrap_or_else(|e| panic!("{e}"))
        }

        let whole = ok(reader.step_for_trace(&trace_id)).unwrap_or_else(|| panic!("no step"));
        assert!(whole.content.is_some() || !whole.tool_calls.is_empty(), "{whole:#?}");
        let facts = ok(reader.step_span_facts_for_trace(&trace_id)).unwrap_or_else(|| panic!("no facts"));
        assert_eq!(facts, StepSpanFacts::from(&whole));
        assert_eq!(facts.token_usage.prefix_reuse_tokens, 1234);
        assert_eq!(facts.agent_role.as_deref(), Some("reviewer"));
        assert_eq!(ok(reader.step_span_facts_for_trace("no such trace")), None);

        let full = ok(reader.trajectory(&trajectory_id)).unwrap_or_else(|| panic!("no trajectory"));
        assert!(
            !full.system_prompts.is_empty() && !full.tool_definitions.is_empty(),
            "{full:#?}"
        );
        assert_eq!(
            ok(reader.parent_trajectory(&trajectory_id)).as_deref(),
            Some("tr_parent")
        );
        assert_eq!(ok(reader.parent_trajectory("tr_none")), None);
        let light = ok(reader.trajectory_light(&trajectory_id)).unwrap_or_else(|| panic!("none"));
        assert_eq!(light, full.without_heavy_parts());
    }

    #[test]
    fn export_pending_counts_the_entries_after_each_cursor_position() {
        let (_dir, reader, _) = sessions_store();
        let entries = reader.export_log(ExportSeq(0), 1_000).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            entries.len() >= 3,
            "the store has several export-log entries: {entries:?}"
        );
        for after in [
            0,
            1,
            entries.len() as i64 / 2,
            entries.len() as i64,
            entries.len() as i64 + 5,
        ] {
            let counted = entries.iter().filter(|e| e.seq.0 > after).count() as u64;
            let pending = reader
                .export_pending(ExportSeq(after))
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(pending, counted, "entries after {after}");
        }
    }

    #[test]
    fn a_cursor_leaves_checkpoints_to_the_writer() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let cursor = Cursor::open(dir.path(), "sink").unwrap_or_else(|e| panic!("{e}"));
        let pages: i64 = cursor
            .conn
            .pragma_query_value(None, "wal_autocheckpoint", |r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pages, 0, "a cursor commit never runs a checkpoint");
        cursor.set(ExportSeq(7)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cursor.get().unwrap_or_else(|e| panic!("{e}")), ExportSeq(7));
    }

    #[test]
    fn reads_in_a_snapshot_do_not_see_a_commit_made_meanwhile() {
        let (dir, reader, _) = sessions_store();
        let before = reader.export_head().unwrap_or_else(|e| panic!("{e}"));
        let (inside, later) = reader
            .in_snapshot(|r| {
                let first = r.export_head()?;
                let writer = super::super::open(dir.path())?;
                writer.execute("INSERT INTO export_log (kind, ref) VALUES ('chat', 'x')", [])?;
                Ok((first, r.export_head()?))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((inside, later), (before, before), "one snapshot for the whole closure");
        let after = reader.export_head().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(after.0, before.0 + 1, "the next read sees the commit");
    }

    /// Lookups by id keep their prepared statement from one id to the next (see `store::stable_plans`): without
    /// it, each new bound value made SQLite parse and plan the query again.
    #[test]
    fn lookups_by_id_are_not_prepared_again_for_each_id() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let writer = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let reader = StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let ids: Vec<String> = (0..5).map(|i| format!("trace-{i}")).collect();
        for id in &ids {
            writer
                .execute(
                    "INSERT INTO traces (id, upstream, api, method, path, outcome, streamed, started_us, ended_us,
                         request_bytes, response_bytes, request_headers, response_headers, metadata)
                     VALUES (?1, 'u', 'openai', 'POST', '/v1/chat/completions', 'complete', 0, 1, 2, 0, 0, '[]',
                         '[]', '{}')",
                    [id],
                )
                .unwrap_or_else(|e| panic!("{e}"));
        }
        for id in &ids {
            let trace = reader.trace(id).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(trace.map(|t| t.id).as_deref(), Some(id.as_str()));
            assert!(reader.step_for_trace(id).unwrap_or_else(|e| panic!("{e}")).is_none());
        }
        let reprepared = |sql: &str| {
            reader
                .conn
                .prepare_cached(sql)
                .unwrap_or_else(|e| panic!("{e}"))
                .get_status(StatementStatus::RePrepare)
        };
        assert_eq!(reprepared(&format!("{TRACE_SELECT} WHERE t.id = ?1")), 0);
        assert_eq!(
            reprepared("SELECT step_id, body FROM steps WHERE trace_id = ?1 AND role = 'agent' ORDER BY seq LIMIT 1"),
            0
        );
    }
}
