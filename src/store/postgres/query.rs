//! The shared store's answers to the query layer ([`Query`]). Trajectories are read as the parts the replicas
//! wrote and added up here (`TrajectorySummary::absorb`); everything else is one indexed query per call.

use std::collections::BTreeMap;

use tokio_postgres::Row;

use super::{Param, PgStore, StoreError, db_error, doc, param_refs};
use crate::model::annotation::Annotation;
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;
use crate::store::browse::{CallHead, SessionHead, SessionQuery};
use crate::store::costs::{CostQuery, CostReport};
use crate::store::query::Query;
use crate::store::read::{SessionRow, TraceFilter};

/// Rows per page of the paged readers (`for_each_trace`, `for_each_step`).
const PAGE: i64 = 200;

fn corrupt(id: &str, e: serde_json::Error) -> StoreError {
    StoreError::Corrupt {
        id: id.to_owned(),
        what: e.to_string(),
    }
}

fn step_of(id: &str, body: &str) -> Result<Step, StoreError> {
    serde_json::from_str(body).map_err(|e| corrupt(id, e))
}

/// The trajectories in `rows` (trajectory_id, body, system_prompts, tool_definitions, started_us), one per id
/// with its replicas' parts added up, oldest first.
fn merged(rows: Vec<Row>) -> Result<Vec<(i64, TrajectorySummary)>, StoreError> {
    let mut by_id: BTreeMap<String, (i64, TrajectorySummary)> = BTreeMap::new();
    for row in rows {
        let id: String = row.get(0);
        let body: String = row.get(1);
        let prompts: Option<String> = row.get(2);
        let tools: Option<String> = row.get(3);
        let started: i64 = row.get(4);
        let mut part: TrajectorySummary = serde_json::from_str(&body).map_err(|e| corrupt(&id, e))?;
        part.system_prompts = prompts.and_then(|p| serde_json::from_str(&p).ok()).unwrap_or_default();
        part.tool_definitions = tools.and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
        match by_id.get_mut(&id) {
            Some((start, whole)) => {
                *start = (*start).min(started);
                whole.absorb(part);
            }
            None => {
                by_id.insert(id, (started, part));
            }
        }
    }
    let mut out: Vec<_> = by_id.into_values().collect();
    out.sort_by(|a, b| (a.0, &a.1.trajectory_id).cmp(&(b.0, &b.1.trajectory_id)));
    Ok(out)
}

const TRAJECTORY_COLUMNS: &str = "trajectory_id, body, system_prompts, tool_definitions, started_us";

impl PgStore {
    fn trace_where(&self, condition: &'static str, id: String) -> Result<Option<ProviderTrace>, StoreError> {
        let display = self.display.clone();
        self.block(|c| async move {
            let sql = format!("SELECT id, head, bodies FROM traces WHERE {condition}");
            let row = c.query_opt(&sql, &[&id]).await.map_err(|e| db_error(&display, e))?;
            row.map(|r| doc::decode(r.get(0), r.get(1), r.get(2))).transpose()
        })
    }

    fn heads_where(&self, condition: &'static str, id: String) -> Result<Vec<CallHead>, StoreError> {
        let display = self.display.clone();
        self.block(|c| async move {
            let sql = format!("SELECT id, head FROM traces WHERE {condition} ORDER BY started_us, id");
            let rows = c.query(&sql, &[&id]).await.map_err(|e| db_error(&display, e))?;
            rows.iter()
                .map(|r| doc::head(r.get(0), r.get(1)).map(doc::TraceHead::call_head))
                .collect()
        })
    }
}

impl Query for PgStore {
    fn annotations(&self, sessions: &[String], trajectories: &[String]) -> Result<Vec<Annotation>, StoreError> {
        self.read_annotations(sessions, trajectories)
    }

    fn cost_report(&self, q: &CostQuery) -> Result<CostReport, StoreError> {
        self.read_cost_report(q)
    }

    fn search(
        &self,
        q: &crate::store::search::SearchQuery,
    ) -> Result<Vec<crate::store::search::SearchHit>, StoreError> {
        self.search_steps(q)
    }

    fn trajectories_of_sessions(&self, sessions: &[String]) -> Result<Vec<Vec<(i64, TrajectorySummary)>>, StoreError> {
        let display = self.display.clone();
        let keys = sessions.to_vec();
        let rows = self.block(|c| async move {
            c.query(
                "SELECT p.trajectory_id, p.body, NULL::text, NULL::text, p.started_us, s.session_key
                 FROM trajectory_parts p
                 JOIN (SELECT DISTINCT trajectory_id, session_key FROM trajectory_parts
                       WHERE session_key = ANY($1)) s ON s.trajectory_id = p.trajectory_id",
                &[&keys],
            )
            .await
            .map_err(|e| db_error(&display, e))
        })?;
        let mut by_session: BTreeMap<String, Vec<Row>> = BTreeMap::new();
        for row in rows {
            by_session.entry(row.get(5)).or_default().push(row);
        }
        sessions
            .iter()
            .map(|s| merged(by_session.remove(s).unwrap_or_default()))
            .collect()
    }

    fn call_heads_of(&self, trajectory_ids: &[String]) -> Result<Vec<Vec<CallHead>>, StoreError> {
        let display = self.display.clone();
        let ids = trajectory_ids.to_vec();
        let rows = self.block(|c| async move {
            c.query(
                "SELECT id, head, trajectory_id FROM traces WHERE trajectory_id = ANY($1) ORDER BY started_us, id",
                &[&ids],
            )
            .await
            .map_err(|e| db_error(&display, e))
        })?;
        let mut by_trajectory: BTreeMap<String, Vec<CallHead>> = BTreeMap::new();
        for r in rows {
            let head = doc::head(r.get(0), r.get(1))?.call_head();
            by_trajectory.entry(r.get(2)).or_default().push(head);
        }
        Ok(trajectory_ids
            .iter()
            .map(|t| by_trajectory.remove(t).unwrap_or_default())
            .collect())
    }

    fn session_page(&self, q: &SessionQuery) -> Result<Vec<SessionHead>, StoreError> {
        let display = self.display.clone();
        let q = q.clone();
        self.block(|c| async move {
            // Only the filters asked for are in the text: `$n IS NULL OR ...` terms keep the planner from
            // walking `sessions_started` (a page of the last hour took 58 ms on 100,000 sessions, 4 ms without).
            let mut cond: Vec<String> = Vec::new();
            let mut params: Vec<Param> = Vec::new();
            let mut param = |p: Box<dyn tokio_postgres::types::ToSql + Sync + Send>| {
                params.push(p);
                format!("${}", params.len())
            };
            if let Some((us, key)) = &q.before {
                let (a, b) = (param(Box::new(*us)), param(Box::new(key.clone())));
                cond.push(format!("(s.started_us, s.session_key) < ({a}, {b})"));
            }
            if let Some(t) = q.until_us {
                cond.push(format!("s.started_us <= {}", param(Box::new(t))));
            }
            if let Some(t) = q.since_us {
                cond.push(format!("s.ended_us >= {}", param(Box::new(t))));
            }
            if let Some(a) = &q.agent {
                cond.push(format!("{} = ANY(s.agents)", param(Box::new(a.clone()))));
            }
            if let Some(m) = &q.model {
                cond.push(format!("{} = ANY(s.models)", param(Box::new(m.clone()))));
            }
            if let Some(l) = &q.label {
                let l = param(Box::new(l.clone()));
                cond.push(format!(
                    "EXISTS (SELECT 1 FROM annotations a WHERE a.label = {l} AND (a.session_key = s.session_key
                        OR a.trajectory_id IN (SELECT l.trajectory_id FROM trajectory_parts l
                                               WHERE l.session_key = s.session_key)))"
                ));
            }
            // A session row is kept while one of its trajectories has it as key (a trajectory later linked into
            // another session leaves its old key's row behind).
            let text = match q.text.as_deref().filter(|t| !t.is_empty()) {
                Some(t) => {
                    let like = param(Box::new(format!(
                        "%{}%",
                        t.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_")
                    )));
                    format!(
                        " AND (p.body ILIKE {like} OR EXISTS (SELECT 1 FROM steps st
                            WHERE st.trajectory_id = p.trajectory_id AND st.body ILIKE {like}))"
                    )
                }
                None => String::new(),
            };
            cond.push(format!(
                "EXISTS (SELECT 1 FROM trajectory_parts p WHERE p.session_key = s.session_key{text})"
            ));
            let limit = param(Box::new(i64::from(q.limit.clamp(1, 500))));
            let sql = format!(
                "SELECT s.session_key, s.started_us FROM sessions s WHERE {}
                 ORDER BY s.started_us DESC, s.session_key DESC LIMIT {limit}",
                cond.join(" AND ")
            );
            let rows = c
                .query(&sql, &param_refs(&params))
                .await
                .map_err(|e| db_error(&display, e))?;
            Ok(rows
                .iter()
                .map(|r| SessionHead {
                    session: r.get(0),
                    started_us: r.get(1),
                })
                .collect())
        })
    }

    fn session_of(&self, id: &str) -> Result<Option<String>, StoreError> {
        let display = self.display.clone();
        let id = id.to_owned();
        self.block(|c| async move {
            let err = |e| db_error(&display, e);
            let is_session = c
                .query_opt("SELECT 1 FROM trajectory_parts WHERE session_key = $1 LIMIT 1", &[&id])
                .await
                .map_err(err)?
                .is_some();
            if is_session {
                return Ok(Some(id));
            }
            // A part that names a session other than the trajectory itself wins (a replica that saw the link).
            Ok(c.query_opt(
                "SELECT session_key FROM trajectory_parts WHERE trajectory_id = $1
                 ORDER BY (session_key = trajectory_id), replica LIMIT 1",
                &[&id],
            )
            .await
            .map_err(err)?
            .map(|r| r.get(0)))
        })
    }

    fn session_trajectories(&self, session: &str) -> Result<Vec<(i64, TrajectorySummary)>, StoreError> {
        let display = self.display.clone();
        let session = session.to_owned();
        self.block(|c| async move {
            let rows = c
                .query(
                    "SELECT trajectory_id, body, NULL::text, NULL::text, started_us FROM trajectory_parts
                     WHERE trajectory_id IN (SELECT trajectory_id FROM trajectory_parts WHERE session_key = $1)",
                    &[&session],
                )
                .await
                .map_err(|e| db_error(&display, e))?;
            merged(rows)
        })
    }

    fn trajectory(&self, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
        let display = self.display.clone();
        let id = id.to_owned();
        let rows = self.block(|c| async move {
            c.query(
                &format!("SELECT {TRAJECTORY_COLUMNS} FROM trajectory_parts WHERE trajectory_id = $1"),
                &[&id],
            )
            .await
            .map_err(|e| db_error(&display, e))
        })?;
        Ok(merged(rows)?.pop().map(|(_, t)| t))
    }

    fn call_heads(&self, trajectory_id: &str) -> Result<Vec<CallHead>, StoreError> {
        self.heads_where("trajectory_id = $1", trajectory_id.to_owned())
    }

    fn call_head(&self, id: &str) -> Result<Option<CallHead>, StoreError> {
        Ok(self.heads_where("id = $1", id.to_owned())?.pop())
    }

    fn steps_page(&self, trajectory_id: &str, after: Option<u32>, limit: u32) -> Result<Vec<Step>, StoreError> {
        let display = self.display.clone();
        let trajectory_id = trajectory_id.to_owned();
        let after = after.map_or(-1, i64::from);
        let limit = i64::from(limit.clamp(1, 1000));
        self.block(|c| async move {
            let rows = c
                .query(
                    "SELECT step_id, body FROM steps WHERE trajectory_id = $1 AND step_index > $2::bigint
                     ORDER BY step_index, step_id LIMIT $3",
                    &[&trajectory_id, &after, &limit],
                )
                .await
                .map_err(|e| db_error(&display, e))?;
            rows.iter().map(|r| step_of(r.get(0), r.get(1))).collect()
        })
    }

    fn trace(&self, id: &str) -> Result<Option<ProviderTrace>, StoreError> {
        self.trace_where("id = $1", id.to_owned())
    }

    fn previous_call(&self, trace: &ProviderTrace) -> Result<Option<ProviderTrace>, StoreError> {
        let Some(trajectory) = trace.trajectory_id.clone() else {
            return Ok(None);
        };
        let display = self.display.clone();
        let (start, id) = (trace.timings.start, trace.id.clone());
        self.block(|c| async move {
            let row = c
                .query_opt(
                    "SELECT id, head, bodies FROM traces WHERE trajectory_id = $1 AND (started_us, id) < ($2, $3)
                     ORDER BY started_us DESC, id DESC LIMIT 1",
                    &[&trajectory, &start, &id],
                )
                .await
                .map_err(|e| db_error(&display, e))?;
            row.map(|r| doc::decode(r.get(0), r.get(1), r.get(2))).transpose()
        })
    }

    fn replays_of(&self, id: &str) -> Result<Vec<(String, Option<String>)>, StoreError> {
        let display = self.display.clone();
        let id = id.to_owned();
        self.block(|c| async move {
            // By the partial expression index `traces_replay_of` (schema v2).
            let rows = c
                .query(
                    "SELECT id, session_key FROM traces WHERE (head::jsonb -> 'meta' ->> 'replay_of') = $1
                     ORDER BY started_us, id",
                    &[&id],
                )
                .await
                .map_err(|e| db_error(&display, e))?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    fn step_for_trace(&self, trace_id: &str) -> Result<Option<Step>, StoreError> {
        let display = self.display.clone();
        let trace_id = trace_id.to_owned();
        self.block(|c| async move {
            let row = c
                .query_opt(
                    "SELECT step_id, body FROM steps WHERE trace_id = $1 AND role = 'agent' LIMIT 1",
                    &[&trace_id],
                )
                .await
                .map_err(|e| db_error(&display, e))?;
            row.map(|r| step_of(r.get(0), r.get(1))).transpose()
        })
    }

    fn sessions(&self, filter: &TraceFilter) -> Result<Vec<SessionRow>, StoreError> {
        let mut rows = self.trajectories(filter)?;
        if let Some(limit) = filter.limit {
            rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        }
        Ok(rows.into_iter().map(|(_, summary)| SessionRow { summary }).collect())
    }

    fn for_each_trace(
        &self,
        filter: &TraceFilter,
        f: &mut dyn FnMut(ProviderTrace) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut remaining = filter.limit.unwrap_or(u64::MAX);
        let mut after = (i64::MIN, String::new());
        while remaining > 0 {
            let display = self.display.clone();
            let (session, since, until) = (filter.session.clone(), filter.since_us, filter.until_us);
            let want = i64::try_from(remaining).unwrap_or(i64::MAX).min(PAGE);
            let (after_us, after_id) = after.clone();
            let page = self.block(|c| async move {
                let rows = c
                    .query(
                        "SELECT id, head, bodies, started_us FROM traces
                         WHERE ($1::text IS NULL OR session_key = $1 OR trajectory_id = $1)
                           AND ($2::bigint IS NULL OR started_us >= $2)
                           AND ($3::bigint IS NULL OR started_us <= $3)
                           AND (started_us, id) > ($4, $5)
                         ORDER BY started_us, id LIMIT $6",
                        &[&session, &since, &until, &after_us, &after_id, &want],
                    )
                    .await
                    .map_err(|e| db_error(&display, e))?;
                rows.iter()
                    .map(|r| Ok(((r.get(3), r.get(0)), doc::decode(r.get(0), r.get(1), r.get(2))?)))
                    .collect::<Result<Vec<((i64, String), ProviderTrace)>, StoreError>>()
            })?;
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

    fn for_each_step(
        &self,
        filter: &TraceFilter,
        f: &mut dyn FnMut(Step) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut remaining = filter.limit.unwrap_or(u64::MAX);
        let unbounded = TraceFilter {
            limit: None,
            ..filter.clone()
        };
        // Trajectories by start, then each one's steps by index in pages.
        for (_, t) in self.trajectories(&TraceFilter {
            since_us: None,
            until_us: None,
            ..unbounded
        })? {
            let mut after: Option<u32> = None;
            loop {
                if remaining == 0 {
                    return Ok(());
                }
                let page = self.steps_page(&t.trajectory_id, after, PAGE as u32)?;
                let Some(last) = page.last() else { break };
                after = Some(last.step_index);
                let full = page.len() as i64 >= PAGE;
                for s in page {
                    let started = s
                        .timings
                        .as_ref()
                        .map(|t| t.started_at.as_str())
                        .unwrap_or(s.timestamp.as_str());
                    let us = chrono::DateTime::parse_from_rfc3339(started)
                        .map(|d| d.timestamp_micros())
                        .unwrap_or(0);
                    if filter.since_us.is_some_and(|t| us < t) || filter.until_us.is_some_and(|t| us > t) {
                        continue;
                    }
                    remaining -= 1;
                    f(s)?;
                    if remaining == 0 {
                        return Ok(());
                    }
                }
                if !full {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl PgStore {
    /// Trajectories matching `filter` (session key or trajectory id, start within since/until), merged,
    /// oldest first.
    fn trajectories(&self, filter: &TraceFilter) -> Result<Vec<(i64, TrajectorySummary)>, StoreError> {
        let display = self.display.clone();
        let (session, since, until) = (filter.session.clone(), filter.since_us, filter.until_us);
        let rows = self.block(|c| async move {
            c.query(
                &format!(
                    "SELECT {TRAJECTORY_COLUMNS} FROM trajectory_parts WHERE trajectory_id IN (
                         SELECT trajectory_id FROM trajectory_parts
                         WHERE ($1::text IS NULL OR session_key = $1 OR trajectory_id = $1))"
                ),
                &[&session],
            )
            .await
            .map_err(|e| db_error(&display, e))
        })?;
        let mut out = merged(rows)?;
        out.retain(|(start, _)| since.is_none_or(|s| *start >= s) && until.is_none_or(|u| *start <= u));
        Ok(out)
    }
}
