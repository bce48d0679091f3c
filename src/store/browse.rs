//! Reads for browsing (the web viewer): small keyset pages, newest sessions first, a trajectory's steps by index,
//! a call's heads without bodies. Nothing here reads more than one page of bodies.

use rusqlite::{OptionalExtension, params_from_iter, types::Value as SqlValue};

use super::StoreError;
use super::read::{StoreReader, TRACE_SELECT, summary_from_row, trace_from_row};
use crate::model::cost::CostBreakdown;
use crate::model::exchange::{Api, Outcome, Timings};
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use crate::model::usage::Usage;

/// Which sessions to list. All filters are optional; `before` resumes after the last row shown.
#[derive(Debug, Clone, Default)]
pub struct SessionQuery {
    /// One of the session's trajectories has this agent.
    pub agent: Option<String>,
    /// One of the session's trajectories used this model.
    pub model: Option<String>,
    /// Unix micros: sessions still running at or after this time.
    pub since_us: Option<i64>,
    /// Unix micros: sessions started at or before this time.
    pub until_us: Option<i64>,
    /// Substring of one of the session's trajectory summaries (ids, agent, models) or of one of their steps.
    pub text: Option<String>,
    /// Keyset cursor: (started_us, session) of the last row of the previous page.
    pub before: Option<(i64, String)>,
    pub limit: u32,
}

/// A session of the list: its key (`TrajectorySummary::session_key`) and its first trajectory's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHead {
    pub session: String,
    pub started_us: i64,
}

/// A call without its bodies or headers: enough for lists, timelines and cost.
#[derive(Debug, Clone)]
pub struct CallHead {
    pub id: String,
    pub trajectory_id: Option<String>,
    pub upstream: String,
    pub api: Api,
    pub model: Option<String>,
    pub status: Option<u16>,
    pub outcome: Outcome,
    pub error: Option<String>,
    pub timings: Timings,
    pub usage: Option<Usage>,
    /// As priced on the pipeline thread (`None`: unknown).
    pub cost: Option<CostBreakdown>,
}

impl StoreReader {
    /// Sessions (every trajectory with the same session key), newest first by their first trajectory's start,
    /// one page. A session matches the agent, model and text filters when one of its trajectories does.
    pub fn session_page(&self, q: &SessionQuery) -> Result<Vec<SessionHead>, StoreError> {
        // Conditions on one trajectory; a session is kept when any of its trajectories meets them all.
        let mut member = Vec::new();
        let mut member_params = Vec::new();
        if let Some(a) = &q.agent {
            member.push("json_extract(body, '$.agent') = ?".to_owned());
            member_params.push(SqlValue::Text(a.clone()));
        }
        if let Some(m) = &q.model {
            member.push("EXISTS (SELECT 1 FROM json_each(body, '$.models') WHERE value = ?)".into());
            member_params.push(SqlValue::Text(m.clone()));
        }
        if let Some(text) = q.text.as_deref().filter(|t| !t.is_empty()) {
            let like = format!(
                "%{}%",
                text.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_")
            );
            // Searching step bodies scans the trajectory's steps (by index); `step_text` (registered by
            // `StoreReader::open`) reads a compressed step body as its JSON text.
            member.push(
                "(body LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM steps s WHERE s.trajectory_id = \
                 trajectories.trajectory_id AND step_text(s.body) LIKE ? ESCAPE '\\'))"
                    .into(),
            );
            member_params.push(SqlValue::Text(like.clone()));
            member_params.push(SqlValue::Text(like));
        }
        let mut cond = vec!["1=1".to_owned()];
        let mut params = Vec::new();
        if let Some(t) = q.since_us {
            cond.push("ended >= ?".into());
            params.push(SqlValue::Integer(t));
        }
        if let Some(t) = q.until_us {
            cond.push("started <= ?".into());
            params.push(SqlValue::Integer(t));
        }
        if let Some((started, id)) = &q.before {
            cond.push("(started, session) < (?, ?)".into());
            params.push(SqlValue::Integer(*started));
            params.push(SqlValue::Text(id.clone()));
        }
        if !member.is_empty() {
            cond.push(format!(
                "session IN (SELECT COALESCE(session_id, trajectory_id) FROM trajectories WHERE {})",
                member.join(" AND ")
            ));
            params.extend(member_params);
        }
        params.push(SqlValue::Integer(i64::from(q.limit.clamp(1, 500))));
        // One pass over the trajectories table (one small row per trajectory, not per call) grouped by session.
        let sql = format!(
            "SELECT session, started FROM (
                SELECT COALESCE(session_id, trajectory_id) AS session, MIN(started_us) AS started,
                       MAX(ended_us) AS ended
                FROM trajectories GROUP BY 1)
             WHERE {} ORDER BY started DESC, session DESC LIMIT ?",
            cond.join(" AND ")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(params_from_iter(params), |r| {
            Ok(SessionHead {
                session: r.get(0)?,
                started_us: r.get(1)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The session `id` names: a session key, else the session of the trajectory with that id (so that a
    /// trajectory's id leads to its whole session).
    pub fn session_of(&self, id: &str) -> Result<Option<String>, StoreError> {
        let is_session = self
            .conn
            .prepare_cached("SELECT 1 FROM trajectories WHERE session_id = ?1 LIMIT 1")?
            .exists([id])?;
        if is_session {
            return Ok(Some(id.to_owned()));
        }
        Ok(self
            .conn
            .prepare_cached("SELECT COALESCE(session_id, trajectory_id) FROM trajectories WHERE trajectory_id = ?1")?
            .query_row([id], |r| r.get(0))
            .optional()?)
    }

    /// Every trajectory of a session (by the `trajectories_session` index), oldest first, each with its start in
    /// Unix micros, without system prompts and tool definitions.
    pub fn session_trajectories(&self, session: &str) -> Result<Vec<(i64, TrajectorySummary)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT trajectory_id, body, NULL, NULL, started_us FROM trajectories
             WHERE session_id = ?1 OR (session_id IS NULL AND trajectory_id = ?1)
             ORDER BY started_us, trajectory_id",
        )?;
        let mut rows = stmt.query([session])?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            out.push((row.get(4)?, summary_from_row(row)?));
        }
        Ok(out)
    }

    /// One trajectory's summary without its system prompts and tool definitions.
    pub fn trajectory_light(&self, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT trajectory_id, body, NULL, NULL FROM trajectories WHERE trajectory_id = ?1")?;
        let mut rows = stmt.query([id])?;
        match rows.next()? {
            Some(row) => Ok(Some(summary_from_row(row)?)),
            None => Ok(None),
        }
    }

    /// Every call of a trajectory, oldest first, without bodies (by the `traces_trajectory` index).
    pub fn call_heads(&self, trajectory_id: &str) -> Result<Vec<CallHead>, StoreError> {
        let mut out = self.heads_where("trajectory_id", trajectory_id)?;
        out.sort_by_key(|c| c.timings.start);
        Ok(out)
    }

    /// One call without bodies.
    pub fn call_head(&self, id: &str) -> Result<Option<CallHead>, StoreError> {
        Ok(self.heads_where("id", id)?.pop())
    }

    fn heads_where(&self, column: &str, value: &str) -> Result<Vec<CallHead>, StoreError> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT id, trajectory_id, upstream, api, model, status, outcome, error, started_us, first_byte_us,
                    ended_us, usage, cost_usd, cost_input_usd, cost_cache_read_usd, cost_cache_write_usd,
                    cost_output_usd, cost_reasoning_usd
             FROM traces WHERE {column} = ?1"
        ))?;
        let rows = stmt.query_map([value], |r| {
            let usage: Option<String> = r.get(11)?;
            Ok(CallHead {
                id: r.get(0)?,
                trajectory_id: r.get(1)?,
                upstream: r.get(2)?,
                api: Api::parse(&r.get::<_, String>(3)?),
                model: r.get(4)?,
                status: r.get(5)?,
                outcome: Outcome::parse(&r.get::<_, String>(6)?),
                error: r.get(7)?,
                timings: Timings {
                    start: r.get(8)?,
                    first_byte: r.get(9)?,
                    end: r.get(10)?,
                },
                usage: usage.and_then(|u| serde_json::from_str(&u).ok()),
                cost: super::read::cost_from_row(r, 12).map_err(|e| {
                    rusqlite::Error::FromSqlConversionFailure(12, rusqlite::types::Type::Text, e.into())
                })?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// A page of a trajectory's steps after index `after` (exclusive), by the `steps_trajectory` index.
    pub fn steps_page(&self, trajectory_id: &str, after: Option<u32>, limit: u32) -> Result<Vec<Step>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT step_id, body FROM steps WHERE trajectory_id = ?1 AND step_index > ?2
             ORDER BY step_index, seq LIMIT ?3",
        )?;
        let after = after.map_or(-1, i64::from);
        let rows = stmt.query_map(
            rusqlite::params![trajectory_id, after, i64::from(limit.clamp(1, 1000))],
            |r| Ok((r.get::<_, String>(0)?, r.get::<_, SqlValue>(1)?)),
        )?;
        let mut out = Vec::new();
        for row in rows {
            let (id, body) = row?;
            let body = super::read::step_text(&id, body)?;
            out.push(serde_json::from_str(&body).map_err(|e| StoreError::Corrupt {
                id,
                what: e.to_string(),
            })?);
        }
        Ok(out)
    }

    /// The call of the same trajectory just before `trace` (bodies included), if any.
    pub fn previous_call(&self, trace: &ProviderTrace) -> Result<Option<ProviderTrace>, StoreError> {
        let Some(trajectory) = &trace.trajectory_id else {
            return Ok(None);
        };
        let seq: Option<i64> = self
            .conn
            .prepare_cached("SELECT seq FROM traces WHERE id = ?1")?
            .query_row([&trace.id], |r| r.get(0))
            .optional()?;
        let Some(seq) = seq else { return Ok(None) };
        let sql = format!(
            "{TRACE_SELECT} WHERE t.id = (SELECT id FROM traces WHERE trajectory_id = ?1
                AND (started_us < ?2 OR (started_us = ?2 AND seq < ?3)) ORDER BY started_us DESC, seq DESC LIMIT 1)"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut rows = stmt.query(rusqlite::params![trajectory, trace.timings.start, seq])?;
        match rows.next()? {
            Some(row) => Ok(Some(trace_from_row(&self.conn, row)?)),
            None => Ok(None),
        }
    }
}
