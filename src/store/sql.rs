//! SQL fragments for the two questions the schema answers by key layout rather than by an index of their own
//! (schema v9): a session's trajectories and a trajectory's steps. Every query asks them through here, so the
//! layout is spelled out once.

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

/// True when the steps row `alias` belongs to the trajectory `trajectory` (an SQL expression, evaluated three
/// times). A step id is its trajectory's id, `/`, its index and an optional `#attempt` (`derive::steps`), so a
/// trajectory's steps are one range of the step id's unique index; `/` sorts just before `0`. The trajectory
/// column is checked as well, so a step id of any other form is never taken for another trajectory's.
pub fn steps_of(alias: &str, trajectory: &str) -> String {
    format!(
        "({alias}.step_id >= {trajectory} || '/' AND {alias}.step_id < {trajectory} || '0' \
         AND {alias}.trajectory_id = {trajectory})"
    )
}
