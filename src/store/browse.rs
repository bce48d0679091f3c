//! Reads for browsing (the web viewer): small keyset pages, newest sessions first, a trajectory's steps by index,
//! a call's heads without bodies. Nothing here reads more than one page of bodies.

use rusqlite::{OptionalExtension, params_from_iter, types::Value as SqlValue};

use super::StoreError;
use super::read::{StoreReader, TRACE_SELECT, summary_from_row, trace_from_row};
use super::sql::{in_session, rows_of, rows_of_row, session_key};
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
    /// An annotation with this label was made in the session, or on one of its trajectories or steps.
    pub label: Option<String>,
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

/// `StoreReader::replays_of`'s query.
const REPLAYS_OF: &str = "SELECT id, session_id FROM traces WHERE json_extract(metadata, '$.replay_of') = ?1
                          ORDER BY started_us, id";

/// `StoreReader::session_page`'s query and its parameters.
fn session_page_sql(q: &SessionQuery) -> (String, Vec<SqlValue>) {
    // Conditions on one trajectory `m` of the session; a session is kept when one of them meets them all.
    let mut member = Vec::new();
    let mut member_params = Vec::new();
    if let Some(a) = &q.agent {
        member.push("json_extract(m.body, '$.agent') = ?".to_owned());
        member_params.push(SqlValue::Text(a.clone()));
    }
    if let Some(model) = &q.model {
        member.push("EXISTS (SELECT 1 FROM json_each(m.body, '$.models') WHERE value = ?)".into());
        member_params.push(SqlValue::Text(model.clone()));
    }
    if let Some(text) = q.text.as_deref().filter(|t| !t.is_empty()) {
        let like = format!(
            "%{}%",
            text.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_")
        );
        // Searching step bodies scans the trajectory's steps (by index); `step_text` (registered by
        // `StoreReader::open`) reads a compressed step body as its JSON text.
        member.push(format!(
            "(m.body LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM steps s WHERE {} \
             AND step_text(s.body) LIKE ? ESCAPE '\\'))",
            rows_of_row("s", "m")
        ));
        member_params.push(SqlValue::Text(like.clone()));
        member_params.push(SqlValue::Text(like));
    }
    let mut cond = Vec::new();
    let mut params = Vec::new();
    if let Some((started, id)) = &q.before {
        // The first term bounds the index range; the row value breaks ties on the start by session key.
        cond.push(format!(
            "t.started_us <= ? AND (t.started_us, {}) < (?, ?)",
            session_key("t")
        ));
        params.extend([
            SqlValue::Integer(*started),
            SqlValue::Integer(*started),
            SqlValue::Text(id.clone()),
        ]);
    }
    if let Some(t) = q.until_us {
        cond.push("t.started_us <= ?".into());
        params.push(SqlValue::Integer(t));
    }
    // Each probe asks for `t`'s session through `in_session` (by index). `t` is the first of its session: no
    // trajectory of the session sorts before it.
    cond.push(format!(
        "NOT EXISTS (SELECT 1 FROM trajectories f WHERE {} AND f.started_us <= t.started_us
            AND (f.started_us < t.started_us OR f.trajectory_id < t.trajectory_id))",
        in_session("f", &session_key("t"))
    ));
    if let Some(t) = q.since_us {
        // The session ended at or after `since` when one of its trajectories did (`t` first: no probe).
        cond.push(format!(
            "(t.ended_us >= ? OR EXISTS (SELECT 1 FROM trajectories e WHERE {} AND e.ended_us >= ?))",
            in_session("e", &session_key("t"))
        ));
        params.extend([SqlValue::Integer(t), SqlValue::Integer(t)]);
    }
    if !member.is_empty() {
        cond.push(format!(
            "EXISTS (SELECT 1 FROM trajectories m WHERE {} AND {})",
            in_session("m", &session_key("t")),
            member.join(" AND ")
        ));
        params.extend(member_params);
    }
    if let Some(label) = &q.label {
        // Annotations are few: the label's index, then the annotation's session or trajectory against `t`'s.
        cond.push(format!(
            "EXISTS (SELECT 1 FROM annotations a WHERE a.label = ? AND (a.session_key = {key}
                OR EXISTS (SELECT 1 FROM trajectories l WHERE l.trajectory_id = a.trajectory_id AND {})))",
            in_session("l", &session_key("t")),
            key = session_key("t"),
        ));
        params.push(SqlValue::Text(label.clone()));
    }
    params.push(SqlValue::Integer(i64::from(q.limit.clamp(1, 500))));
    let sql = format!(
        "SELECT {} AS session, t.started_us FROM trajectories t INDEXED BY trajectories_started
         WHERE {} ORDER BY t.started_us DESC, session DESC LIMIT ?",
        session_key("t"),
        cond.join(" AND ")
    );
    (sql, params)
}

impl StoreReader {
    /// Sessions (every trajectory with the same session key), newest first by their first trajectory's start,
    /// one page. A session matches the agent, model and text filters when one of its trajectories does.
    ///
    /// A session starts with its first trajectory (smallest `(started_us, trajectory_id)` of its key), so the
    /// page walks trajectories newest first by the `trajectories_started` index and keeps those that are the
    /// first of their session: one probe by session (`sql::in_session`, by index) each, which also answers
    /// `since` (one of the session's trajectories ended at or after it) and the member filters from the
    /// session's own rows. The walk stops once the page is full, so a page costs its rows plus the trajectories
    /// it passes over (later trajectories of sessions that started earlier, and sessions a filter rejects), not
    /// the table: grouping the whole table by session would read every trajectory row on each page load. Two
    /// cases still walk far: a filter few sessions match, and `since` when fewer sessions than a page ran after
    /// it (sessions that started before `since` are found only by walking on).
    pub fn session_page(&self, q: &SessionQuery) -> Result<Vec<SessionHead>, StoreError> {
        let (sql, params) = session_page_sql(q);
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
    /// trajectory's id leads to its whole session). Both by index (`sql::in_session`, the primary key).
    pub fn session_of(&self, id: &str) -> Result<Option<String>, StoreError> {
        let is_session = self
            .conn
            .prepare_cached(&format!(
                "SELECT 1 FROM trajectories t WHERE {} LIMIT 1",
                in_session("t", "?1")
            ))?
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

    /// Every trajectory of a session (by index, `sql::in_session`), oldest first, each with its start in Unix
    /// micros, without system prompts and tool definitions.
    pub fn session_trajectories(&self, session: &str) -> Result<Vec<(i64, TrajectorySummary)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT trajectory_id, body, NULL, NULL, started_us FROM trajectories t
             WHERE {} ORDER BY started_us, trajectory_id",
            in_session("t", "?1")
        ))?;
        let mut rows = stmt.query([session])?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            out.push((row.get(4)?, summary_from_row(row)?));
        }
        Ok(out)
    }

    /// One trajectory's summary without its system prompts and tool definitions (left empty): what lists and
    /// the exporter's agent spans need. An agent's tool definitions can be tens of kilobytes of JSON.
    pub fn trajectory_light(&self, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
        if let Some(t) = self.recent().and_then(|r| r.trajectory_light(id)) {
            return Ok(Some(t));
        }
        self.trajectory_by(
            "SELECT trajectory_id, body, NULL, NULL FROM trajectories WHERE trajectory_id = ?1",
            id,
        )
    }

    /// Every call of a trajectory, oldest first, without bodies (by its number, `sql::rows_of`).
    pub fn call_heads(&self, trajectory_id: &str) -> Result<Vec<CallHead>, StoreError> {
        let mut out = self.heads_where(&rows_of("t", "?1"), trajectory_id)?;
        out.sort_by_key(|c| c.timings.start);
        Ok(out)
    }

    /// One call without bodies.
    pub fn call_head(&self, id: &str) -> Result<Option<CallHead>, StoreError> {
        Ok(self.heads_where("t.id = ?1", id)?.pop())
    }

    /// The calls that re-sent call `id` (their metadata's `replay_of`), oldest first, each with its session; by the
    /// partial index `traces_replay_of` (schema v12).
    pub fn replays_of(&self, id: &str) -> Result<Vec<(String, Option<String>)>, StoreError> {
        let mut stmt = self.conn.prepare_cached(REPLAYS_OF)?;
        let rows = stmt.query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The calls that meet `condition` (on the traces row `t`, with `value` as `?1`).
    fn heads_where(&self, condition: &str, value: &str) -> Result<Vec<CallHead>, StoreError> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT id, trajectory_id, upstream, api, model, status, outcome, error, started_us, first_byte_us,
                    ended_us, usage, cost_usd, cost_input_usd, cost_cache_read_usd, cost_cache_write_usd,
                    cost_output_usd, cost_reasoning_usd
             FROM traces t WHERE {condition}"
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

    /// A page of a trajectory's steps after index `after` (exclusive). The trajectory's steps are one range of
    /// the steps' key (`sql::rows_of`), in step id text order ("/10" before "/2"): the page's keys are sorted by
    /// index without their bodies, then its bodies read by primary key.
    pub fn steps_page(&self, trajectory_id: &str, after: Option<u32>, limit: u32) -> Result<Vec<Step>, StoreError> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT step_id, body FROM steps WHERE seq IN (
                 SELECT s.seq FROM steps s WHERE {} AND s.step_index > ?2 ORDER BY s.step_index, s.seq LIMIT ?3)
             ORDER BY step_index, seq",
            rows_of("s", "?1")
        ))?;
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
            "{TRACE_SELECT} WHERE t.id = (SELECT p.id FROM traces p WHERE {}
                AND (p.started_us < ?2 OR (p.started_us = ?2 AND p.seq < ?3))
                ORDER BY p.started_us DESC, p.seq DESC LIMIT 1)",
            rows_of("p", "?1")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut rows = stmt.query(rusqlite::params![trajectory, trace.timings.start, seq])?;
        match rows.next()? {
            Some(row) => Ok(Some(trace_from_row(&self.conn, row)?)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// A trajectories row: (trajectory id, session id, started, ended, agent, model).
    type Row = (String, Option<String>, i64, i64, String, String);

    /// A few hundred trajectories across sessions of several trajectories each, with many ties on the start
    /// (within a session and across sessions), sessions named by a trajectory id, and sessions of one.
    fn rows() -> Vec<Row> {
        (0..320)
            .map(|i: i64| {
                let session = match i % 5 {
                    0 => None,
                    1 if i % 3 == 0 => Some("tr0010".to_owned()),
                    _ => Some(format!("s{:02}", i % 37)),
                };
                // A session's first two members (i and i + 37) start together: ties within a session too.
                let started = 1_000 * (((i % 37) * 7 + (i / 74) * 3) % 41);
                let ended = started + 700 * (i % 11);
                let agent = if i % 4 == 0 { "claude" } else { "codex" };
                (
                    format!("tr{i:04}"),
                    session,
                    started,
                    ended,
                    agent.to_owned(),
                    format!("m{}", i % 6),
                )
            })
            .collect()
    }

    fn store(rows: &[Row]) -> (tempfile::TempDir, StoreReader) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        for (id, session, started, ended, agent, model) in rows {
            let body = serde_json::to_string(&TrajectorySummary {
                trajectory_id: id.clone(),
                session_id: session.clone(),
                agent: Some(agent.clone()),
                models: vec![model.clone()],
                ..TrajectorySummary::default()
            })
            .unwrap_or_else(|e| panic!("{e}"));
            conn.execute(
                "INSERT INTO trajectories (trajectory_id, session_id, started_us, ended_us, body) VALUES (?1, ?2, ?3, ?4, ?5)",
                rusqlite::params![id, session, started, ended, body],
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
        drop(conn);
        let reader = StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        (dir, reader)
    }

    /// The list computed straight from the rows: group by session key, filter, sort.
    fn reference(rows: &[Row], q: &SessionQuery) -> Vec<SessionHead> {
        let mut sessions: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
        for row in rows {
            let key = row.1.clone().unwrap_or_else(|| row.0.clone());
            sessions.entry(key).or_default().push(row);
        }
        let mut out: Vec<SessionHead> = sessions
            .into_iter()
            .filter(|(_, members)| {
                let ended = members.iter().map(|r| r.3).max().unwrap_or(i64::MIN);
                let started = members.iter().map(|r| r.2).min().unwrap_or(i64::MAX);
                q.since_us.is_none_or(|t| ended >= t)
                    && q.until_us.is_none_or(|t| started <= t)
                    && members.iter().any(|r| {
                        q.agent.as_ref().is_none_or(|a| &r.4 == a) && q.model.as_ref().is_none_or(|m| &r.5 == m)
                    })
            })
            .map(|(session, members)| SessionHead {
                started_us: members.iter().map(|r| r.2).min().unwrap_or(0),
                session,
            })
            .collect();
        out.sort_by(|a, b| (b.started_us, &b.session).cmp(&(a.started_us, &a.session)));
        out
    }

    /// Every page of `q`, following the keyset cursor as the viewer does.
    fn all_pages(reader: &StoreReader, q: &SessionQuery) -> Vec<SessionHead> {
        let mut out: Vec<SessionHead> = Vec::new();
        let mut before = None;
        loop {
            let page = reader
                .session_page(&SessionQuery {
                    before: before.clone(),
                    ..q.clone()
                })
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(page.len() <= q.limit as usize);
            assert!(out.len() <= 1_000, "{q:?}: the cursor does not advance");
            out.extend(page.iter().cloned());
            match page.last() {
                Some(last) if page.len() == q.limit as usize => {
                    before = Some((last.started_us, last.session.clone()));
                }
                _ => return out,
            }
        }
    }

    #[test]
    fn pages_list_each_session_once_in_order_like_grouping_the_table() {
        let rows = rows();
        let (_dir, reader) = store(&rows);
        let queries = [
            SessionQuery::default(),
            SessionQuery {
                since_us: Some(30_000),
                ..SessionQuery::default()
            },
            SessionQuery {
                until_us: Some(20_000),
                ..SessionQuery::default()
            },
            SessionQuery {
                since_us: Some(10_000),
                until_us: Some(40_000),
                ..SessionQuery::default()
            },
            SessionQuery {
                agent: Some("claude".into()),
                ..SessionQuery::default()
            },
            SessionQuery {
                model: Some("m5".into()),
                until_us: Some(45_000),
                ..SessionQuery::default()
            },
        ];
        for q in queries {
            let expected = reference(&rows, &q);
            assert!(
                expected.len() > 5,
                "{q:?}: too few sessions to page: {}",
                expected.len()
            );
            for limit in [1, 3, 7, 50, 500] {
                let q = SessionQuery { limit, ..q.clone() };
                assert_eq!(all_pages(&reader, &q), expected, "{q:?}");
            }
        }
        // Ties: sessions starting at the same time are paged apart, none repeated or skipped.
        let all = reference(&rows, &SessionQuery::default());
        assert!(all.windows(2).any(|w| w[0].started_us == w[1].started_us));
        let first_ties = all.iter().any(|head| {
            let key = |r: &&Row| r.1.as_deref().unwrap_or(&r.0) == head.session;
            rows.iter().filter(key).filter(|r| r.2 == head.started_us).count() > 1
        });
        assert!(first_ties, "no session has two trajectories at its start");
    }

    #[test]
    fn a_page_walks_trajectories_by_start_and_probes_sessions_by_index() {
        let (_dir, reader) = store(&rows());
        let q = SessionQuery {
            agent: Some("claude".into()),
            since_us: Some(1),
            until_us: Some(2),
            before: Some((3, "x".into())),
            limit: 50,
            ..SessionQuery::default()
        };
        let (sql, params) = session_page_sql(&q);
        let plan = super::super::query_plan(&reader.conn, &sql, params_from_iter(params)).join("\n");
        assert!(plan.contains("USING INDEX trajectories_started"), "{plan}");
        // Only ties on the start are sorted, not the whole walk.
        assert!(!plan.contains("TEMP B-TREE FOR ORDER BY"), "{plan}");
        // Each probe is two index searches (`sql::in_session`): the named sessions, and the trajectory that is
        // its own session, by primary key.
        for alias in ["f", "e", "m"] {
            for index in ["trajectories_named_session", "sqlite_autoindex_trajectories_1"] {
                let probe = plan
                    .lines()
                    .any(|l| l.starts_with(&format!("SEARCH {alias} ")) && l.contains(&format!("USING INDEX {index}")));
                assert!(probe, "{alias}, {index}: {plan}");
            }
        }
        assert!(!plan.lines().any(|l| l.starts_with("SCAN ")), "{plan}");
    }

    #[test]
    fn a_session_reads_its_trajectories_by_key() {
        let rows = rows();
        let (_dir, reader) = store(&rows);
        assert_eq!(
            reader.session_of("s03").unwrap_or_else(|e| panic!("{e}")),
            Some("s03".into())
        );
        // A trajectory id leads to its session; a trajectory without one is its own session.
        let member = rows.iter().find(|r| r.1.as_deref() == Some("s03")).map(|r| r.0.clone());
        assert_eq!(
            reader
                .session_of(&member.unwrap_or_default())
                .unwrap_or_else(|e| panic!("{e}")),
            Some("s03".into())
        );
        assert_eq!(
            reader.session_of("tr0005").unwrap_or_else(|e| panic!("{e}")),
            Some("tr0005".into())
        );
        assert_eq!(reader.session_of("nothing").unwrap_or_else(|e| panic!("{e}")), None);
        // "tr0010" is a trajectory without a session id and the session id of others: one session.
        let ids: Vec<String> = reader
            .session_trajectories("tr0010")
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .map(|(_, t)| t.trajectory_id)
            .collect();
        let mut expected: Vec<&Row> = rows
            .iter()
            .filter(|r| r.1.as_deref().unwrap_or(&r.0) == "tr0010")
            .collect();
        expected.sort_by(|a, b| (a.2, &a.0).cmp(&(b.2, &b.0)));
        assert!(expected.len() > 2);
        assert_eq!(ids, expected.iter().map(|r| r.0.clone()).collect::<Vec<_>>());
    }

    /// A trajectory's steps come in index order although their ids sort as text ("/10" before "/2"), page by
    /// page, from the step id index (schema v9 has no index by trajectory), and only that trajectory's.
    #[test]
    fn a_trajectorys_steps_page_in_index_order_by_their_id_range() {
        use crate::derive::testkit::{Harness, assistant, call, text_out, trace, user};
        use crate::model::record::Record;
        let mut h = Harness::new(Api::OpenAiChat);
        let mut records = Vec::new();
        // Two conversations; the first grows to 15 calls (30 steps), the second starts with the first's text.
        for (task, calls) in [("port the parser", 15), ("port the parser to C", 2)] {
            let mut messages = vec![user(task)];
            for i in 0..calls {
                let t = trace(h.api, h.now, h.now + 1_000);
                h.now += 1_000_000;
                records.extend(
                    h.deriver
                        .observe(t, Some(call("agent", messages.clone(), text_out(&format!("ok {i}"))))),
                );
                messages.push(assistant(&format!("ok {i}")));
                messages.push(user(&format!("next {i}")));
            }
        }
        let trajectory = records
            .iter()
            .find_map(|r| match r {
                Record::Trajectory(t) => Some(t.trajectory_id.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no trajectory"));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        super::super::write::write_batch(&mut conn, &records, &mut super::super::chunks::ChunkCache::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let reader = StoreReader::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let mut expected: Vec<(i64, String)> = reader
            .conn
            .prepare("SELECT step_index, step_id FROM steps WHERE trajectory_id = ?1 ORDER BY step_index, seq")
            .unwrap_or_else(|e| panic!("{e}"))
            .query_map([&trajectory], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap_or_else(|e| panic!("{e}"))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(expected.len() >= 20, "{expected:?}");
        let mut read = Vec::new();
        let mut after = None;
        loop {
            let page = reader
                .steps_page(&trajectory, after, 7)
                .unwrap_or_else(|e| panic!("{e}"));
            let Some(last) = page.last() else { break };
            after = Some(last.step_index);
            assert!(page.len() <= 7);
            read.extend(page.into_iter().map(|s| (i64::from(s.step_index), s.step_id)));
        }
        assert_eq!(read, expected);
        expected.sort_by(|a, b| a.1.cmp(&b.1));
        assert_ne!(read, expected, "ids in text order differ from index order");
        let plan = super::super::query_plan(
            &reader.conn,
            &format!("SELECT s.seq FROM steps s WHERE {}", rows_of("s", "?1")),
            [&trajectory],
        );
        assert_eq!(
            plan,
            [
                "SEARCH s USING COVERING INDEX sqlite_autoindex_steps_1 (trajectory_seq=?)",
                "SCALAR SUBQUERY 1",
                "SEARCH n USING INDEX sqlite_autoindex_trajectories_1 (trajectory_id=?)"
            ]
        );
    }

    /// A call's replays are found by the partial index on their metadata's `replay_of`, not by a scan.
    #[test]
    fn replays_are_found_by_their_index() {
        let (_dir, reader) = store(&rows()[..3]);
        let plan = super::super::query_plan(&reader.conn, REPLAYS_OF, ["a-call"]).join("\n");
        assert!(plan.contains("USING INDEX traces_replay_of"), "{plan}");
        assert_eq!(
            reader.replays_of("a-call").unwrap_or_else(|e| panic!("{e}")),
            Vec::new()
        );
    }
}
