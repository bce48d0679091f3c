//! The Claude Code CLI (npm `@anthropic-ai/claude-code`, pinned in tests/clients/package.json) run for real
//! against llmtap and the scripted upstream: `claude -p` (plain: a Bash tool round, then text), a run whose model
//! delegates with the Task tool (a sub-agent), and `claude -p --continue` in the same directory. Asserts through
//! llmtap's CLI and store: every call captured with the bytes the upstream sent and its usage, tool calls joined
//! to their results, the sub-agent linked to the step that started it, call types, the resumed conversation,
//! and no API key anywhere in the store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::claude::*;
use common::clients::*;
use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use serde_json::Value;

const KEY: &str = "sk-ant-api03-CLIENTSECRET-claude-code";

struct Env {
    home: tempfile::TempDir,
    project: tempfile::TempDir,
    base: String,
}

impl Env {
    fn new(tap: &Llmtap) -> Env {
        Env {
            home: tempfile::tempdir().unwrap(),
            project: tempfile::tempdir().unwrap(),
            base: format!("http://{}/anthropic", tap.addr),
        }
    }

    /// `claude -p <args>` in the project directory, isolated from the developer's config, quiet on the network.
    fn claude(&self, bin: &PathBuf, args: &[&str]) -> Command {
        let mut c = Command::new(bin);
        c.current_dir(self.project.path())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", self.home.path())
            .env("CLAUDE_CONFIG_DIR", self.home.path().join(".claude"))
            .env("ANTHROPIC_BASE_URL", &self.base)
            .env("ANTHROPIC_API_KEY", KEY)
            .env("DISABLE_AUTOUPDATER", "1")
            .env("DISABLE_TELEMETRY", "1")
            .env("DISABLE_ERROR_REPORTING", "1")
            .env("DISABLE_BUG_COMMAND", "1")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("CLAUDE_CODE_DISABLE_TERMINAL_TITLE", "1")
            .arg("-p")
            .args(args)
            // Last: `--allowedTools` takes every following argument as a tool name.
            .args(["--output-format", "json", "--allowedTools", "Bash"]);
        c
    }
}

async fn setup() -> Option<(Scripted, tempfile::TempDir, Llmtap, PathBuf)> {
    let Some(bin) = claude_binary() else {
        eprintln!(
            "SKIP: @anthropic-ai/claude-code ships no native build for {}-{}",
            std::env::consts::OS,
            std::env::consts::ARCH
        );
        return None;
    };
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    Some((up, dir, tap, bin))
}

/// `claude -p --output-format json` printed one result object.
fn result_of(run: &Run) -> Value {
    serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout))
}

/// The API key reached the upstream (the client authenticated) and is nowhere in llmtap's data directory.
fn assert_key_not_stored(up: &Scripted, tap: &Llmtap) {
    assert!(
        up.received()
            .iter()
            .any(|r| r.headers.get("x-api-key").is_some_and(|v| v == KEY)),
        "the client's key reaches the upstream"
    );
    assert_eq!(files_containing(&tap.data_dir, "CLIENTSECRET"), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_plain_run_is_captured_with_its_tool_round() {
    let Some((up, _dir, tap, bin)) = setup().await else {
        return;
    };
    let env = Env::new(&tap);
    let run = run_client(env.claude(&bin, &["Say hi using the shell."]), 60).await;
    eprintln!("claude -p: {:.1} s\n{}", run.secs, up.dump());
    let out = result_of(&run);
    assert_eq!(out["result"], SCRIPTED_TEXT, "{out:#}");
    assert_eq!(out["num_turns"], 2);

    let main_calls: Vec<_> = up
        .model_calls()
        .into_iter()
        .filter(|s| s.request.to_string().contains("Say hi using the shell."))
        .collect();
    assert_eq!(main_calls.len(), 2, "{}", up.dump());
    assert_eq!(main_calls[0].tool.as_deref(), Some("Bash"));
    assert_eq!(main_calls[1].tool, None);
    // The usage Claude Code reports is the sum of what the upstream sent through llmtap.
    let sum = |k: &str| {
        up.model_calls()
            .iter()
            .map(|s| s.usage.as_ref().unwrap()[k].as_u64().unwrap())
            .sum::<u64>()
    };
    for k in [
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ] {
        assert_eq!(out["usage"][k], sum(k), "{k}: {out:#}");
    }
    up.assert_captured(&tap);

    let by_traj = steps_by_trajectory(&tap);
    let (main_id, steps) = by_traj
        .iter()
        .find(|(_, steps)| {
            steps.iter().any(|s| {
                s["content"]
                    .as_str()
                    .is_some_and(|c| c.contains("Say hi using the shell."))
            })
        })
        .unwrap_or_else(|| panic!("no trajectory with the prompt: {by_traj:#?}"));
    let (_, call, obs) = tool_call_and_result(steps, "Bash");
    assert_eq!(call["input"]["command"], "echo hi");
    assert!(obs["content"].as_str().unwrap_or("").contains("hi"), "{obs:#}");
    let agent_steps = steps.iter().filter(|s| s["role"] == "agent").count();
    assert_eq!(agent_steps, 2, "one agent step per main-loop call: {steps:#?}");
    assert!(
        steps.iter().all(|s| s["call_type"] == "main" || s["role"] != "agent"),
        "{steps:#?}"
    );
    let sessions = tap.sessions_json();
    let row = sessions
        .iter()
        .find(|r| r["trajectory_id"] == main_id.as_str())
        .unwrap();
    assert_eq!(row["llm_calls"], 2, "{row:#}");
    assert_eq!(row["call_types"], serde_json::json!(["main"]));
    assert_key_not_stored(&up, &tap);
}

/// A run whose model delegates with the Task (`Agent` in 2.x) tool, checked up to the links between the main
/// and the sub-agent trajectory. Returns llmtap (with its store), the main and the sub-agent trajectory ids.
async fn task_subagent_run() -> Option<(Scripted, tempfile::TempDir, Llmtap, String, String)> {
    let (up, dir, tap, bin) = setup().await?;
    let env = Env::new(&tap);
    let run = run_client(env.claude(&bin, &["[[tool:Task]] Delegate saying hi to a helper."]), 60).await;
    eprintln!("claude -p (Task): {:.1} s\n{}", run.secs, up.dump());
    let out = result_of(&run);
    assert_eq!(out["result"], SCRIPTED_TEXT, "{out:#}");
    let delegated: Vec<_> = up
        .model_calls()
        .into_iter()
        .filter(|s| s.tool.as_deref() == Some("Agent") || s.tool.as_deref() == Some("Task"))
        .collect();
    assert_eq!(delegated.len(), 1, "{}", up.dump());
    let sub_calls: Vec<_> = up
        .model_calls()
        .into_iter()
        .filter(|s| {
            s.request["messages"][0]
                .to_string()
                .contains("Run the shell command `echo hi`")
        })
        .collect();
    assert_eq!(
        sub_calls.len(),
        2,
        "the sub-agent's Bash round and its answer: {}",
        up.dump()
    );
    up.assert_captured(&tap);

    eprintln!("{}", tap.cli(&["sessions", "--json"]));
    let (main_id, sub_id) = assert_task_subagent_linked(&tap, delegated[0].tool.as_deref().unwrap());
    assert_key_not_stored(&up, &tap);
    Some((up, dir, tap, main_id, sub_id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_task_subagent_is_linked_to_the_step_that_started_it() {
    let Some((_up, _dir, tap, main_id, sub_id)) = task_subagent_run().await else {
        return;
    };
    // ATIF embeds the sub-agent in its parent and references it from the delegating call's result.
    let atif = tap.export("atif", &[]);
    let main = atif
        .iter()
        .find(|t| t["session_id"] == main_id.as_str() || t.to_string().contains(&main_id))
        .unwrap_or_else(|| panic!("{atif:#?}"));
    let subs = main["subagent_trajectories"].as_array().unwrap();
    assert_eq!(subs.len(), 1, "{main:#}");
    assert!(subs[0].to_string().contains(&sub_id), "{:#}", subs[0]);
    assert!(
        main["steps"].to_string().contains(&format!(
            "\"subagent_trajectory_ref\":[{{\"trajectory_id\":\"{sub_id}\"}}]"
        )),
        "{main:#}"
    );
}

// the opentraces export references sub-agents (issue 15, item 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_task_subagent_is_referenced_in_opentraces() {
    let Some((_up, _dir, tap, main_id, sub_id)) = task_subagent_run().await else {
        return;
    };
    let records = tap.export("opentraces", &[]);
    let main = records
        .iter()
        .find(|r| r.to_string().contains(&main_id) && r["steps"].to_string().contains("Delegate saying hi"))
        .unwrap_or_else(|| panic!("{records:#?}"));
    let delegating = main["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| !s["subagent_trajectory_ref"].is_null())
        .unwrap_or_else(|| panic!("no step references the sub-agent: {main:#}"));
    assert!(
        delegating["subagent_trajectory_ref"].to_string().contains(&sub_id),
        "{delegating:#}"
    );
}

// on main the resumed run (same history, changed system prompt) starts a new trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_continue_resumes_the_conversation() {
    let Some((up, _dir, tap, bin)) = setup().await else {
        return;
    };
    let env = Env::new(&tap);
    let first = run_client(env.claude(&bin, &["First question: say hi using the shell."]), 60).await;
    let second = run_client(env.claude(&bin, &["--continue", "Second question: once more."]), 60).await;
    eprintln!(
        "claude -p: {:.1} s, --continue: {:.1} s\n{}",
        first.secs,
        second.secs,
        up.dump()
    );
    let (a, b) = (result_of(&first), result_of(&second));
    assert_eq!(
        a["session_id"], b["session_id"],
        "--continue resumes the same Claude Code session"
    );
    let resumed: Vec<_> = up
        .model_calls()
        .into_iter()
        .filter(|s| {
            let m = s.request["messages"].to_string();
            m.contains("First question") && m.contains("Second question")
        })
        .collect();
    assert_eq!(
        resumed.len(),
        2,
        "the resumed run sends the first run's history: {}",
        up.dump()
    );
    up.assert_captured(&tap);

    let by_traj = steps_by_trajectory(&tap);
    eprintln!("{}", tap.cli(&["sessions", "--json"]));
    let with = |text: &str| {
        by_traj
            .iter()
            .filter(|(_, steps)| {
                steps
                    .iter()
                    .any(|s| s["role"] == "user" && s["content"].as_str().is_some_and(|c| c.contains(text)))
            })
            .map(|(id, _)| id.clone())
            .collect::<Vec<_>>()
    };
    // Claude Code's own session id (its session header or `metadata.user_id`) is the
    // session llmtap shows.
    let session = a["session_id"].as_str().unwrap();
    assert!(
        up.received()
            .iter()
            .any(|r| format!("{:?}{}", r.headers, String::from_utf8_lossy(&r.body)).contains(session)),
        "Claude Code sends its session id"
    );
    assert!(
        tap.cli(&["sessions", "--json"]).contains(session),
        "llmtap shows Claude Code's session {session}"
    );
    let (firsts, seconds) = (with("First question"), with("Second question"));
    assert_eq!(seconds.len(), 1, "{by_traj:#?}");
    // a resumed conversation (same history, changed system prompt) continues its
    // trajectory with a new user step.
    assert_eq!(firsts, seconds, "the resumed run continues the first run's trajectory");
    let steps = &by_traj[&seconds[0]];
    let users: Vec<_> = steps.iter().filter(|s| s["role"] == "user").collect();
    assert_eq!(users.len(), 2, "{steps:#?}");
    assert_key_not_stored(&up, &tap);
}
