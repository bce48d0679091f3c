//! SQL fragments for the questions the schema answers by key layout rather than by an index of their own: a
//! session's trajectories (schema v9) and a trajectory's traces and steps (v10). Every query asks them through
//! here, so the layout is spelled out once.

/// The session key of the trajectories row `alias` (`TrajectorySummary::session_key`): its session id, else its
/// own id.
pub fn session_key(alias: &str) -> String {
    format!("COALESCE({alias}.session_id, {alias}.trajectory_id)")
}

/// True when the trajectories row `alias` has the session key `key` (an SQL expression, evaluated twice). The
/// same rows as `session_key(alias) = key`, by index: the column holds a session only when it is not the
/// trajectory's own id, so the first arm is the partial index `trajectories_named_session` and the second the
/// primary key.
pub fn in_session(alias: &str, key: &str) -> String {
    format!("({alias}.session_id = {key} OR ({alias}.session_id IS NULL AND {alias}.trajectory_id = {key}))")
}

/// The number (`trajectories.seq`, schema v10) of the trajectory with the id `trajectory` (an SQL expression).
/// A trajectory's traces and steps carry it as `trajectory_seq`: their indexes are led by it, not by the id.
fn trajectory_seq(trajectory: &str) -> String {
    format!("(SELECT n.seq FROM trajectories n WHERE n.trajectory_id = {trajectory})")
}

/// True when the `traces` or `steps` row `alias` belongs to the trajectory with the id `trajectory` (an SQL
/// expression): one range of `traces_trajectory_seq` or of the steps' key.
pub fn rows_of(alias: &str, trajectory: &str) -> String {
    format!("{alias}.trajectory_seq = {}", trajectory_seq(trajectory))
}

/// True when the `traces` or `steps` row `alias` belongs to the trajectories row `trajectories`.
pub fn rows_of_row(alias: &str, trajectories: &str) -> String {
    format!("{alias}.trajectory_seq = {trajectories}.seq")
}

/// The trajectory id a step id begins with: a step id is its trajectory's id, `/`, its index and an optional
/// `#attempt` (`derive::steps`). None for an id of any other form.
pub fn trajectory_of_step(step_id: &str) -> Option<&str> {
    step_id.rsplit_once('/').map(|(trajectory, _)| trajectory)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trajectory's traces and steps come by their trajectory number's index, whether the id is a parameter or
    /// another row's column, and the trajectories row by its id: no query that asks through here scans a table.
    #[test]
    fn a_trajectorys_rows_are_found_by_index() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let conn = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch("CREATE TEMP TABLE r (trajectory_id TEXT)")
            .unwrap_or_else(|e| panic!("{e}"));
        for (sql, index) in [
            (
                format!("SELECT t.id FROM traces t WHERE {}", rows_of("t", "?1")),
                "traces_trajectory_seq",
            ),
            (
                format!("SELECT s.seq FROM steps s WHERE {}", rows_of("s", "?1")),
                "sqlite_autoindex_steps_1",
            ),
            (
                format!(
                    "SELECT 1 FROM r WHERE EXISTS (SELECT 1 FROM steps s WHERE {})",
                    rows_of("s", "r.trajectory_id")
                ),
                "sqlite_autoindex_steps_1",
            ),
            (
                format!(
                    "SELECT s.seq FROM trajectories k JOIN steps s ON {} WHERE k.trajectory_id = ?1",
                    rows_of_row("s", "k")
                ),
                "sqlite_autoindex_steps_1",
            ),
        ] {
            let plan = super::super::query_plan(
                &conn,
                &sql,
                rusqlite::params_from_iter(sql.contains("?1").then_some("tr_1")),
            )
            .join("\n");
            assert!(plan.contains(index), "{sql}\n{plan}");
            assert!(
                !plan.lines().any(|l| l.contains("SCAN ") && !l.contains("SCAN r")),
                "{sql}\n{plan}"
            );
        }
    }

    #[test]
    fn a_step_id_names_its_trajectory() {
        assert_eq!(trajectory_of_step("tr_ab12/3"), Some("tr_ab12"));
        assert_eq!(trajectory_of_step("tr_ab12/3#2"), Some("tr_ab12"));
        assert_eq!(trajectory_of_step("step-3"), None);
    }
}
