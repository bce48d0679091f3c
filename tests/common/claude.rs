//! Claude Code as a test client: its pinned native binary, and the assertions every Task sub-agent scenario makes
//! on the exported steps, whichever way Claude Code reached llmtap (base URL, forward proxy, cloud routes).

use super::clients::{node_clients_dir, node_package};
use super::*;

/// The native binary of the pinned version; None (the test skips) on a platform the package has no build for.
pub fn claude_binary() -> Option<PathBuf> {
    let platform = match (std::env::consts::OS, std::env::consts::ARCH) {
        ("linux", "x86_64") => "linux-x64",
        ("linux", "aarch64") => "linux-arm64",
        ("macos", "x86_64") => "darwin-x64",
        ("macos", "aarch64") => "darwin-arm64",
        _ => return None,
    };
    // The wrapper's postinstall copies the platform binary over bin/claude.exe; the platform package holds it
    // either way (npm may skip install scripts).
    let native = node_clients_dir()
        .join("node_modules/@anthropic-ai")
        .join(format!("claude-code-{platform}"))
        .join("claude");
    if native.exists() {
        return Some(native);
    }
    let wrapper = node_package("@anthropic-ai/claude-code").join("bin/claude.exe");
    wrapper.exists().then_some(wrapper)
}

/// Steps of the exported trajectories, by trajectory id.
pub fn steps_by_trajectory(tap: &Llmtap) -> std::collections::BTreeMap<String, Vec<Value>> {
    let mut out: std::collections::BTreeMap<String, Vec<Value>> = Default::default();
    for s in tap.export("steps", &[]) {
        out.entry(s["trajectory_id"].as_str().unwrap().to_owned())
            .or_default()
            .push(s);
    }
    out
}

/// The agent step that called `tool`, and the observation joined to that call.
pub fn tool_call_and_result<'a>(steps: &'a [Value], tool: &str) -> (&'a Value, Value, Value) {
    for s in steps {
        for c in s["tool_calls"].as_array().into_iter().flatten() {
            if c["tool_name"] == tool {
                let obs = steps
                    .iter()
                    .flat_map(|o| o["observations"].as_array().cloned().unwrap_or_default())
                    .find(|o| o["source_call_id"] == c["tool_call_id"])
                    .unwrap_or_else(|| panic!("the {tool} call has no observation: {steps:#?}"));
                return (s, c.clone(), obs);
            }
        }
    }
    panic!("no {tool} call in {steps:#?}")
}

/// The scripted Task scenario ("Delegate saying hi", the sub-agent runs `echo hi` with Bash) as derived: the
/// main trajectory's `delegate_tool` call is answered by the sub-agent's result, the sub-agent's trajectory is
/// linked to that call and step, its agent steps are `subagent`, and it made two calls. Returns the main and
/// sub-agent trajectory ids.
pub fn assert_task_subagent_linked(tap: &Llmtap, delegate_tool: &str) -> (String, String) {
    let by_traj = steps_by_trajectory(tap);
    let (main_id, main_steps) = by_traj
        .iter()
        .find(|(_, steps)| {
            steps
                .iter()
                .any(|s| s["content"].as_str().is_some_and(|c| c.contains("Delegate saying hi")))
        })
        .unwrap_or_else(|| panic!("no main trajectory: {by_traj:#?}"));
    let (spawning, call, obs) = tool_call_and_result(main_steps, delegate_tool);
    assert!(
        obs["content"].as_str().unwrap_or("").contains(scripted::SCRIPTED_TEXT),
        "the sub-agent's answer is the observation: {obs:#}"
    );
    let (sub_id, sub_steps) = by_traj
        .iter()
        .find(|(id, steps)| *id != main_id && steps.iter().any(|s| s["parent_trajectory_id"] == main_id.as_str()))
        .unwrap_or_else(|| panic!("no sub-agent trajectory under {main_id}: {by_traj:#?}"));
    let first = &sub_steps[0];
    assert_eq!(first["parent_tool_call_id"], call["tool_call_id"], "{first:#}");
    assert_eq!(first["parent_step"], spawning["step_index"], "{first:#}");
    assert!(
        sub_steps
            .iter()
            .filter(|s| s["role"] == "agent")
            .all(|s| s["call_type"] == "subagent"),
        "{sub_steps:#?}"
    );
    let (_, bash, bash_obs) = tool_call_and_result(sub_steps, "Bash");
    assert_eq!(bash["input"]["command"], "echo hi");
    assert!(bash_obs["content"].as_str().unwrap_or("").contains("hi"));
    let sessions = tap.sessions_json();
    let row = sessions.iter().find(|r| r["trajectory_id"] == sub_id.as_str()).unwrap();
    assert_eq!(row["llm_calls"], 2, "{row:#}");
    (main_id.clone(), sub_id.clone())
}
