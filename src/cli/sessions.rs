//! `llmtap sessions`: trajectories grouped by session, each session printed as a tree (sub-agents, side calls
//! and continuations under the trajectory they belong to).

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;

use crate::model::step::{TrajectorySummary, session_title};

/// One session and its trajectories, oldest first.
#[derive(Debug, Serialize)]
pub struct SessionView {
    pub session_id: String,
    pub started_at: String,
    pub ended_at: String,
    pub llm_calls: u32,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The sum of the calls' known costs (JSON: `cost_usd`, null when no call's
    /// cost was known; each trajectory says how many calls had none).
    #[serde(serialize_with = "cost_fields", rename = "cost_usd")]
    pub cost: crate::model::cost::CostSum,
    /// What the session is about (`model::step::session_title`): the title the client's title call answered,
    /// else its run's first user text without injected context.
    pub title: Option<String>,
    pub trajectories: Vec<TrajectorySummary>,
}

/// Group trajectories (oldest first) by session; a trajectory without one is its own session.
pub fn group(rows: Vec<TrajectorySummary>) -> Vec<SessionView> {
    let mut order: Vec<String> = Vec::new();
    let mut by_session: BTreeMap<String, Vec<TrajectorySummary>> = BTreeMap::new();
    for t in rows {
        let id = t.session_key().to_owned();
        if !by_session.contains_key(&id) {
            order.push(id.clone());
        }
        by_session.entry(id).or_default().push(t);
    }
    order
        .into_iter()
        .filter_map(|id| {
            let trajectories = by_session.remove(&id)?;
            Some(SessionView {
                started_at: trajectories
                    .iter()
                    .map(|t| t.started_at.clone())
                    .min()
                    .unwrap_or_default(),
                ended_at: trajectories
                    .iter()
                    .map(|t| t.ended_at.clone())
                    .max()
                    .unwrap_or_default(),
                llm_calls: trajectories.iter().map(|t| t.llm_calls).sum(),
                input_tokens: trajectories.iter().map(|t| t.input_tokens).sum(),
                output_tokens: trajectories.iter().map(|t| t.output_tokens).sum(),
                cost: trajectories
                    .iter()
                    .fold(Default::default(), |mut sum: crate::model::cost::CostSum, t| {
                        sum.merge(&t.cost());
                        sum
                    }),
                title: session_title(&trajectories).map(str::to_owned),
                session_id: id,
                trajectories,
            })
        })
        .collect()
}

fn cost_fields<S: serde::Serializer>(cost: &crate::model::cost::CostSum, s: S) -> Result<S::Ok, S::Error> {
    cost.usd.serialize(s)
}

fn duration(t: &TrajectorySummary) -> String {
    match (
        chrono::DateTime::parse_from_rfc3339(&t.started_at),
        chrono::DateTime::parse_from_rfc3339(&t.ended_at),
    ) {
        (Ok(a), Ok(b)) => format!("{:.1}s", (b - a).num_milliseconds() as f64 / 1000.0),
        _ => "-".into(),
    }
}

/// The table: a line per session, then its trajectory tree; side calls, titles, warmups and quota probes are
/// folded into a count per session unless `all`.
pub fn write_table(out: &mut impl Write, sessions: &[SessionView], all: bool) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<40} {:<14} {:<28} {:>5} {:>5} {:<12} {:>9} {:>9} {:>12} {:>9}",
        "SESSION / TRAJECTORY", "AGENT", "MODELS", "STEPS", "CALLS", "PURPOSE", "IN TOK", "OUT TOK", "COST", "DURATION"
    )?;
    for s in sessions {
        writeln!(
            out,
            "{:<40} {:<14} {:<28} {:>5} {:>5} {:<12} {:>9} {:>9} {:>12}{}",
            format!("session {}", s.session_id),
            "",
            "",
            "",
            s.llm_calls,
            "",
            s.input_tokens,
            s.output_tokens,
            s.cost.display(),
            // Last on the line: a title is as long as it is (cut at `derive::context::TITLE_CHARS`).
            s.title.as_deref().map(|t| format!("  {t}")).unwrap_or_default()
        )?;
        let ids: Vec<&str> = s.trajectories.iter().map(|t| t.trajectory_id.as_str()).collect();
        let shown = |t: &TrajectorySummary| all || !t.is_auxiliary();
        let roots = s
            .trajectories
            .iter()
            .filter(|t| shown(t) && t.tree_parent().is_none_or(|p| !ids.contains(&p)));
        for t in roots {
            write_subtree(out, s, t, 1, all)?;
        }
        let folded: Vec<&TrajectorySummary> = s.trajectories.iter().filter(|t| !shown(t)).collect();
        if !folded.is_empty() {
            let calls: u32 = folded.iter().map(|t| t.llm_calls).sum();
            writeln!(
                out,
                "  + {} side/title/warmup/quota trajectories ({calls} calls; --all shows them)",
                folded.len()
            )?;
        }
    }
    Ok(())
}

fn write_subtree(
    out: &mut impl Write,
    s: &SessionView,
    t: &TrajectorySummary,
    depth: usize,
    all: bool,
) -> std::io::Result<()> {
    let link = match (&t.parent_trajectory_id, t.parent_step, &t.continues) {
        (Some(_), Some(step), _) => format!(" @{step}"),
        (None, _, Some(_)) => " (continues)".into(),
        _ => String::new(),
    };
    let name = format!("{}{}{link}", "  ".repeat(depth), t.trajectory_id);
    writeln!(
        out,
        "{:<40} {:<14} {:<28} {:>5} {:>5} {:<12} {:>9} {:>9} {:>12} {:>9}",
        name,
        t.agent.as_deref().unwrap_or("-"),
        t.models.join(","),
        t.steps,
        t.llm_calls,
        t.purpose.map_or("-", |p| p.as_str()),
        t.input_tokens,
        t.output_tokens,
        t.cost().display(),
        duration(t)
    )?;
    for child in s
        .trajectories
        .iter()
        .filter(|c| c.tree_parent() == Some(t.trajectory_id.as_str()) && (all || !c.is_auxiliary()))
    {
        write_subtree(out, s, child, depth + 1, all)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::step::Purpose;

    fn traj(id: &str, session: &str, parent: Option<&str>, purpose: Purpose) -> TrajectorySummary {
        TrajectorySummary {
            trajectory_id: id.into(),
            session_id: Some(session.into()),
            parent_trajectory_id: parent.map(str::to_owned),
            parent_step: parent.map(|_| 1),
            purpose: Some(purpose),
            llm_calls: 1,
            steps: 2,
            started_at: "2026-01-01T00:00:00Z".into(),
            ended_at: "2026-01-01T00:00:01Z".into(),
            ..TrajectorySummary::default()
        }
    }

    #[test]
    fn sessions_group_their_trajectories_into_a_tree_with_helpers_folded() {
        let mut titled = traj("tr_title", "s1", None, Purpose::Title);
        titled.title = Some("Fix the parser".into());
        let rows = vec![
            traj("tr_main", "s1", None, Purpose::Main),
            titled,
            traj("tr_sub", "s1", Some("tr_main"), Purpose::Subagent),
            traj("tr_other", "tr_other", None, Purpose::Main),
        ];
        let sessions = group(rows);
        assert_eq!(sessions.len(), 2);
        assert_eq!(sessions[0].trajectories.len(), 3);
        assert_eq!(sessions[0].llm_calls, 3);
        let mut out = Vec::new();
        write_table(&mut out, &sessions, false).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("\n  tr_main"), "{text}");
        assert_eq!(sessions[0].title.as_deref(), Some("Fix the parser"));
        assert!(
            text.lines()
                .any(|l| l.starts_with("session s1 ") && l.ends_with("  Fix the parser")),
            "{text}"
        );
        assert_eq!(sessions[1].title, None);
        assert!(text.contains("\n    tr_sub @1"), "{text}");
        assert!(!text.contains("tr_title"), "{text}");
        assert!(
            text.contains("+ 1 side/title/warmup/quota trajectories (1 calls"),
            "{text}"
        );
        let mut out = Vec::new();
        write_table(&mut out, &sessions, true).unwrap();
        assert!(String::from_utf8(out).unwrap().contains("\n  tr_title"));
    }
}
