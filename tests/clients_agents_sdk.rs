//! The OpenAI Agents SDK (PyPI `openai-agents`, pinned in tests/sdk/requirements.txt) run for real against llmtap
//! and the scripted upstream (tests/sdk/agents_sdk.py): a triage agent with a function tool and a handoff, on the
//! Responses and the Chat Completions model, streamed and not. Asserts every call captured with the bytes and
//! usage the upstream sent, the function call joined to its result, the handoff target's calls linked to the
//! triage step that handed off, and no API key stored.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::clients::*;
use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use serde_json::Value;

const KEY: &str = "sk-proj-CLIENTSECRET-agents-sdk";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sdk_tool_and_handoff_on_responses_and_chat() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/agents_sdk.py");
    let mut cmd = Command::new(python());
    cmd.arg(script)
        .env("OPENAI_BASE_URL", format!("http://{}/openai/v1", tap.addr))
        .env("OPENAI_API_KEY", KEY)
        .env("OPENAI_AGENTS_DISABLE_TRACING", "1");
    let run = run_client(cmd, 60).await;
    eprintln!("agents sdk: {:.1} s\n{}", run.secs, up.dump());
    let out: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    for name in ["responses_tool", "responses_handoff", "chat_tool", "chat_handoff"] {
        assert_eq!(out[name]["final_output"], SCRIPTED_TEXT, "{name}: {out:#}");
    }
    assert_eq!(out["responses_tool"]["last_agent"], "Triage");
    assert_eq!(out["responses_handoff"]["last_agent"], "Specialist");
    assert_eq!(out["chat_handoff"]["last_agent"], "Specialist");

    // Per run: a tool call then text; a handoff call then the specialist's text.
    let calls = up.model_calls();
    assert_eq!(calls.len(), 8, "{}", up.dump());
    let tools: Vec<Option<&str>> = calls.iter().map(|s| s.tool.as_deref()).collect();
    assert_eq!(
        tools,
        [
            Some("get_weather"),
            None,
            Some("transfer_to_specialist"),
            None,
            Some("get_weather"),
            None,
            Some("transfer_to_specialist"),
            None
        ]
    );
    assert_eq!(
        calls.iter().map(|s| s.streamed).collect::<Vec<_>>(),
        [false, false, true, true, true, true, false, false]
    );
    up.assert_captured(&tap);
    assert!(
        up.received().iter().all(|r| r
            .headers
            .get("authorization")
            .is_some_and(|v| v == format!("Bearer {KEY}").as_str())),
        "the client's key reaches the upstream"
    );
    assert_eq!(files_containing(&tap.data_dir, "CLIENTSECRET"), Vec::<PathBuf>::new());

    let by_traj = tap.steps_by_trajectory();
    let sessions = tap.sessions_json();
    eprintln!("{}", tap.cli(&["sessions"]));
    let trajectory_with = |text: &str| {
        by_traj
            .iter()
            // The top-level one: a handoff target's trajectory carries the same history.
            .find(|(_, steps)| {
                steps.iter().all(|s| s["parent_trajectory_id"].is_null())
                    && steps
                        .iter()
                        .any(|s| s["role"] == "user" && s["content"].as_str().is_some_and(|c| c.contains(text)))
            })
            .unwrap_or_else(|| panic!("no trajectory with {text:?}: {by_traj:#?}"))
    };
    for api in ["Responses run", "Chat run"] {
        // The function call is joined to its output, and the run is one trajectory of two calls.
        let (id, steps) = trajectory_with(&format!("{api}: what is the weather"));
        let call = steps
            .iter()
            .flat_map(|s| s["tool_calls"].as_array().cloned().unwrap_or_default())
            .find(|c| c["tool_name"] == "get_weather")
            .unwrap_or_else(|| panic!("{api}: no get_weather call: {steps:#?}"));
        assert_eq!(call["input"]["city"], "Paris");
        let obs = steps
            .iter()
            .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
            .find(|o| o["source_call_id"] == call["tool_call_id"])
            .unwrap_or_else(|| panic!("{api}: the call has no observation: {steps:#?}"));
        assert!(
            obs["content"].as_str().unwrap_or("").contains("Sunny in Paris"),
            "{obs:#}"
        );
        let row = sessions.iter().find(|r| r["trajectory_id"] == id.as_str()).unwrap();
        assert_eq!(row["llm_calls"], 2, "{row:#}");
        assert_eq!(
            steps.iter().filter(|s| s["role"] == "agent").count(),
            2,
            "{api}: {steps:#?}"
        );

        // The handoff: the specialist's call is linked to the triage step that handed off.
        let (triage_id, triage_steps) = trajectory_with(&format!("{api}: [[tool:transfer_to_specialist]]"));
        let handoff = triage_steps
            .iter()
            .find(|s| {
                s["tool_calls"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c["tool_name"] == "transfer_to_specialist"))
            })
            .unwrap_or_else(|| panic!("{api}: no handoff step: {triage_steps:#?}"));
        let specialist: Vec<&Value> = by_traj
            .values()
            .flatten()
            .filter(|s| s["parent_trajectory_id"] == triage_id.as_str() && s["role"] == "agent")
            .collect();
        assert_eq!(
            specialist.len(),
            1,
            "{api}: the specialist's answer, linked: {by_traj:#?}"
        );
        let answer = specialist[0];
        assert!(
            answer["content"].as_str().unwrap_or("").contains(SCRIPTED_TEXT),
            "{answer:#}"
        );
        assert_eq!(answer["parent_step"], handoff["step_index"], "{answer:#}");
        assert_eq!(answer["call_type"], "subagent", "{answer:#}");
        let handoff_call = handoff["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["tool_name"] == "transfer_to_specialist")
            .unwrap();
        assert_eq!(
            answer["parent_tool_call_id"], handoff_call["tool_call_id"],
            "{answer:#}"
        );
        let row = sessions
            .iter()
            .find(|r| r["trajectory_id"] == answer["trajectory_id"])
            .unwrap();
        assert_eq!(row["call_types"], serde_json::json!(["subagent"]), "{row:#}");
    }
}
