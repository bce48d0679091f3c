//! Late facts: tool results in a later request joined to the calls that asked for them (observations, tool
//! durations, file snippets), and calls that never got a result when their trajectory closes.

use crate::model::call::{Message, Part, Role};
use crate::model::exchange::UnixMicros;
use crate::model::step::{Observation, Step};

use super::snippets;
use super::state::{State, Trajectory};

const OUTPUT_SUMMARY_CHARS: usize = 200;

/// One tool result as the request carries it.
pub struct ToolResult<'a> {
    pub call_id: &'a str,
    /// The function name, where results carry one (Gemini), for joining when ids are the client's own.
    pub name: Option<&'a str>,
    pub content: &'a str,
    pub is_error: bool,
}

/// Where the turns this request adds begin: after the last assistant turn (earlier results were seen with
/// earlier requests).
pub fn new_turns_start(messages: &[Message]) -> usize {
    messages
        .iter()
        .rposition(|m| m.role == Role::Assistant)
        .map_or(0, |i| i + 1)
}

/// The call ids the request's tool results answer.
pub fn answered_call_ids(messages: &[Message]) -> Vec<&str> {
    tool_results(messages).map(|r| r.call_id).collect()
}

fn tool_results(messages: &[Message]) -> impl Iterator<Item = ToolResult<'_>> {
    messages.iter().flat_map(|m| &m.parts).filter_map(|p| match p {
        Part::ToolResult {
            call_id,
            name,
            content,
            is_error,
        } => Some(ToolResult {
            call_id,
            name: name.as_deref(),
            content,
            is_error: *is_error,
        }),
        _ => None,
    })
}

impl State {
    /// Join the tool results in `new_turns` (of a request of trajectory `traj_id` that arrived `at`) to their
    /// calls. Returns the updated steps to re-emit, each once in its final state (parallel results update the
    /// same step).
    pub fn attach_results(&mut self, traj_id: &str, new_turns: &[Message], at: UnixMicros) -> Vec<Step> {
        let mut updated: Vec<Step> = Vec::new();
        for result in tool_results(new_turns) {
            let Some(step) = self.attach_observation(traj_id, &result, at) else {
                continue;
            };
            match updated.iter_mut().find(|s| s.step_id == step.step_id) {
                Some(existing) => *existing = step,
                None => updated.push(step),
            }
        }
        updated
    }

    fn attach_observation(&mut self, traj_id: &str, result: &ToolResult<'_>, at: UnixMicros) -> Option<Step> {
        let (owner, call_id) = self.answered_call(traj_id, result)?;
        self.forget_call(&call_id);
        self.trajectories.get_mut(&owner)?.observe_result(&call_id, result, at)
    }

    /// The call a result answers: by id, anywhere; else (for client-assigned ids) by tool name, the earliest
    /// open call of that name in the result's own trajectory (Gemini answers calls in order).
    fn answered_call(&self, traj_id: &str, result: &ToolResult<'_>) -> Option<(String, String)> {
        if let Some(owner) = self.call_owner.get(result.call_id) {
            return Some((owner.clone(), result.call_id.to_owned()));
        }
        let t = self.trajectories.get(traj_id)?;
        let call_id = t.earliest_open_call_named(result.name?)?;
        Some((traj_id.to_owned(), call_id))
    }
}

impl Trajectory {
    /// The open call named `name` that was made first: lowest step index, then position in that step.
    fn earliest_open_call_named(&self, name: &str) -> Option<String> {
        self.open_calls
            .iter()
            .filter_map(|(id, idx)| {
                let pos = self
                    .steps
                    .get(idx)?
                    .tool_calls
                    .iter()
                    .position(|c| &c.tool_call_id == id && c.tool_name == name)?;
                Some((*idx, pos, id))
            })
            .min()
            .map(|(_, _, id)| id.clone())
    }

    /// Record `result` on the step that made `call_id`. The tool's duration is an upper bound: from the end of
    /// that step's response to the arrival of the request carrying the result.
    fn observe_result(&mut self, call_id: &str, result: &ToolResult<'_>, at: UnixMicros) -> Option<Step> {
        let idx = self.open_calls.remove(call_id)?;
        let last_end = self.last_end_us;
        let step = self.steps.get_mut(&idx)?;
        let ended = step_end(step).unwrap_or(last_end);
        let mut read_snippet = None;
        if let Some(tc) = step.tool_calls.iter_mut().find(|c| c.tool_call_id == call_id) {
            tc.duration_ms = Some(((at - ended).max(0) / 1000) as u64);
            if snippets::is_read_tool(&tc.tool_name) {
                read_snippet = snippets::from_read_tool(&tc.input, result.content, idx);
            }
        }
        step.snippets.extend(read_snippet);
        step.observations.push(Observation {
            source_call_id: call_id.to_owned(),
            content: Some(result.content.to_owned()),
            output_summary: Some(summarize(result.content)),
            error: result.is_error.then(|| "tool_error".to_owned()),
        });
        let updated = (**step).clone();
        // A step with no open calls that is not the latest can no longer change.
        if !self.open_calls.values().any(|i| *i == idx) && self.newest_step() != Some(idx) {
            self.steps.remove(&idx);
        }
        Some(updated)
    }

    /// At close: every call still open gets a `no_result` observation, in the order the calls were made.
    /// Returns the ids of those calls.
    pub fn mark_unanswered(&mut self) -> Vec<String> {
        let mut open: Vec<(u32, usize, String)> = self
            .open_calls
            .drain()
            .map(|(id, idx)| {
                let pos = self
                    .steps
                    .get(&idx)
                    .and_then(|s| s.tool_calls.iter().position(|c| c.tool_call_id == id));
                (idx, pos.unwrap_or(usize::MAX), id)
            })
            .collect();
        open.sort();
        for (idx, _, call_id) in &open {
            if let Some(step) = self.steps.get_mut(idx) {
                step.observations.push(Observation {
                    source_call_id: call_id.clone(),
                    content: None,
                    output_summary: None,
                    error: Some("no_result".into()),
                });
            }
        }
        open.into_iter().map(|(_, _, id)| id).collect()
    }
}

/// When the step's response ended, from its own timings.
fn step_end(step: &Step) -> Option<UnixMicros> {
    let ended = &step.timings.as_ref()?.ended_at;
    chrono::DateTime::parse_from_rfc3339(ended)
        .ok()
        .map(|d| d.timestamp_micros())
}

/// The first `OUTPUT_SUMMARY_CHARS` characters of a result, trimmed, with `…` when cut.
fn summarize(content: &str) -> String {
    let line = content.trim();
    if line.chars().count() <= OUTPUT_SUMMARY_CHARS {
        return line.to_owned();
    }
    let cut: String = line.chars().take(OUTPUT_SUMMARY_CHARS).collect();
    format!("{cut}…")
}

#[cfg(test)]
mod tests {
    use crate::derive::testkit::*;
    use crate::model::call::Part;
    use crate::model::exchange::Api;
    use serde_json::json;

    #[test]
    fn results_join_their_call_by_id_with_the_time_in_between_as_duration() {
        let mut h = Harness::new(Api::OpenAiChat);
        let read = tool_call("call_1", "read_file", json!({"path": "src/a.py"}));
        let first = h.send_after(
            call("", vec![user("fix a.py")], calls_out(std::slice::from_ref(&read))),
            2_500_000,
        );
        let second = h.send(call(
            "",
            vec![user("fix a.py"), calls(&[read]), result("call_1", "x = 1\ny = 2\n")],
            text_out("done"),
        ));
        assert_eq!(second.trajectory_id, first.trajectory_id);
        // Records: the updated step 1, then the new agent step 2.
        let updated = &second.steps[0];
        assert_eq!(updated.step_id, format!("{}/1", first.trajectory_id));
        assert_eq!(updated.observations.len(), 1);
        assert_eq!(updated.observations[0].source_call_id, "call_1");
        assert_eq!(updated.observations[0].content.as_deref(), Some("x = 1\ny = 2\n"));
        assert_eq!(updated.observations[0].output_summary.as_deref(), Some("x = 1\ny = 2"));
        assert_eq!(updated.observations[0].error, None);
        // Response 1 ended at 1 s, request 2 arrived at 3.5 s.
        assert_eq!(updated.tool_calls[0].duration_ms, Some(2500));
        // A file-reading tool's result is a snippet with the path and line range from the arguments.
        let sn = &updated.snippets[0];
        assert_eq!(
            (sn.file_path.as_deref(), sn.start_line, sn.end_line),
            (Some("src/a.py"), Some(1), Some(2))
        );
        assert_eq!(second.agent().step_index, 2);
    }

    #[test]
    fn parallel_results_re_emit_their_step_once_with_all_observations() {
        let mut h = Harness::new(Api::AnthropicMessages);
        let a = tool_call("toolu_a", "weather", json!({"city": "Paris"}));
        let b = tool_call("toolu_b", "weather", json!({"city": "Rome"}));
        h.send(call("", vec![user("weather?")], calls_out(&[a.clone(), b.clone()])));
        let mut res = results(&[("toolu_b", None, "rain"), ("toolu_a", None, "sun")]);
        if let Part::ToolResult { is_error, .. } = &mut res.parts[0] {
            *is_error = true;
        }
        let out = h.send(call("", vec![user("weather?"), calls(&[a, b]), res], text_out("ok")));
        assert_eq!(out.steps.len(), 2, "one updated step, one new agent step");
        let obs = &out.steps[0].observations;
        let got: Vec<(&str, Option<&str>)> = obs
            .iter()
            .map(|o| (o.source_call_id.as_str(), o.error.as_deref()))
            .collect();
        assert_eq!(got, [("toolu_b", Some("tool_error")), ("toolu_a", None)]);
    }

    #[test]
    fn gemini_results_without_provider_ids_match_open_calls_by_name_and_order() {
        let mut h = Harness::new(Api::GeminiGenerateContent);
        // The adapter numbers Gemini's calls; the client echoes them with ids of its own.
        let out = calls_out(&[
            tool_call("gemini:1:0", "get_weather", json!({"city": "Paris"})),
            tool_call("gemini:1:1", "get_weather", json!({"city": "Rome"})),
        ]);
        let first = h.send(call("", vec![user("weather?")], out));
        let echo = calls(&[
            tool_call("pyd_1", "get_weather", json!({"city": "Paris"})),
            tool_call("pyd_2", "get_weather", json!({"city": "Rome"})),
        ]);
        let res = results(&[
            ("pyd_1", Some("get_weather"), "sunny"),
            ("pyd_2", Some("get_weather"), "rainy"),
        ]);
        let second = h.send(call("", vec![user("weather?"), echo, res], text_out("ok")));
        assert_eq!(second.trajectory_id, first.trajectory_id);
        let got: Vec<(&str, Option<&str>)> = second.steps[0]
            .observations
            .iter()
            .map(|o| (o.source_call_id.as_str(), o.content.as_deref()))
            .collect();
        assert_eq!(got, [("gemini:1:0", Some("sunny")), ("gemini:1:1", Some("rainy"))]);
    }

    #[test]
    fn a_result_for_no_open_call_changes_nothing() {
        let mut h = Harness::new(Api::OpenAiChat);
        let out = h.send(call(
            "",
            vec![
                user("x"),
                calls(&[tool_call("call_9", "f", json!({}))]),
                result("call_9", "r"),
            ],
            text_out("ok"),
        ));
        assert_eq!(out.steps.len(), 1);
        assert!(out.agent().observations.is_empty());
    }

    #[test]
    fn long_results_are_summarized() {
        let long = "a".repeat(250);
        let s = super::summarize(&format!("  {long} "));
        assert_eq!(s.chars().count(), 201);
        assert!(s.ends_with('…'));
        assert_eq!(super::summarize(" short "), "short");
    }
}
