//! The Vercel AI SDK (npm `ai` with `@ai-sdk/openai` and `@ai-sdk/anthropic`, pinned in tests/clients) run for
//! real against llmtap and the scripted upstream (tests/clients/vercel_ai.mjs): multi-step tool loops
//! (`stopWhen: stepCountIs(5)`) with generateText and streamText on OpenAI Responses, OpenAI Chat Completions
//! and Anthropic Messages. Asserts every call captured with the bytes and usage the upstream sent, the step
//! counts the SDK saw, each tool call joined to its result, one trajectory per loop, and no API key stored; and
//! that running the same script twice gives two trajectories per prompt.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::clients::*;
use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use serde_json::{Value, json};

const KEY: &str = "sk-CLIENTSECRET-vercel-ai";

fn vercel_ai(tap: &Llmtap) -> Command {
    let mut cmd = Command::new("node");
    cmd.current_dir(node_clients_dir())
        .arg("vercel_ai.mjs")
        .env("OPENAI_BASE_URL", format!("http://{}/openai/v1", tap.addr))
        .env("ANTHROPIC_BASE_URL", format!("http://{}/anthropic/v1", tap.addr))
        .env("OPENAI_API_KEY", KEY)
        .env("ANTHROPIC_API_KEY", KEY);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vercel_ai_multi_step_tool_loops() {
    node_package("ai");
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let cmd = vercel_ai(&tap);
    let run = run_client(cmd, 60).await;
    eprintln!("vercel ai: {:.1} s\n{}", run.secs, up.dump());
    let out: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));

    // (run, prompt marker, tool rounds)
    let runs = [
        ("responses_generate", "Responses generate", 1),
        ("chat_stream", "Chat stream", 2),
        ("anthropic_stream", "Anthropic stream", 1),
        ("anthropic_generate", "Anthropic generate", 1),
    ];
    for (name, _, rounds) in runs {
        let r = &out[name];
        assert_eq!(r["text"], SCRIPTED_TEXT, "{name}: {r:#}");
        assert_eq!(r["steps"], rounds + 1, "{name}: a step per model call: {r:#}");
        assert_eq!(r["tool_calls"], json!(vec!["weather"; rounds]), "{name}");
    }
    let calls = up.model_calls();
    assert_eq!(calls.len(), 2 + 3 + 2 + 2, "{}", up.dump());
    let traces = up.assert_captured(&tap);
    // What the SDK summed over the loop is what the upstream reported, call by call.
    for (name, marker, _) in runs {
        let (mut input, mut output) = (0, 0);
        for s in calls.iter().filter(|s| s.request.to_string().contains(marker)) {
            let (i, o, _) = s.expected_usage().unwrap();
            (input, output) = (input + i, output + o);
        }
        assert!(input > 0, "{name}");
        assert_eq!(out[name]["input_tokens"], input, "{name}");
        assert_eq!(out[name]["output_tokens"], output, "{name}");
    }
    assert!(traces.iter().all(|t| t["error"].is_null()));
    assert!(
        up.received().iter().all(|r| {
            r.headers
                .get("authorization")
                .is_some_and(|v| v == format!("Bearer {KEY}").as_str())
                || r.headers.get("x-api-key").is_some_and(|v| v == KEY)
        }),
        "the client's key reaches the upstream"
    );
    assert_eq!(files_containing(&tap.data_dir, "CLIENTSECRET"), Vec::<PathBuf>::new());

    let by_traj = tap.steps_by_trajectory();
    let sessions = tap.sessions_json();
    eprintln!("{}", tap.cli(&["sessions"]));
    for (name, marker, rounds) in runs {
        let (id, steps) = by_traj
            .iter()
            .find(|(_, steps)| {
                steps
                    .iter()
                    .any(|s| s["role"] == "user" && s["content"].as_str().is_some_and(|c| c.contains(marker)))
            })
            .unwrap_or_else(|| panic!("{name}: no trajectory: {by_traj:#?}"));
        let agent: Vec<&Value> = steps.iter().filter(|s| s["role"] == "agent").collect();
        assert_eq!(agent.len(), rounds + 1, "{name}: {steps:#?}");
        for c in agent
            .iter()
            .flat_map(|s| s["tool_calls"].as_array().cloned().unwrap_or_default())
        {
            assert_eq!(c["tool_name"], "weather");
            assert_eq!(c["input"]["city"], "Paris");
            let obs = steps
                .iter()
                .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
                .find(|o| o["source_call_id"] == c["tool_call_id"])
                .unwrap_or_else(|| panic!("{name}: a call without its result: {steps:#?}"));
            assert!(
                obs["content"].as_str().unwrap_or("").contains("Sunny in Paris"),
                "{obs:#}"
            );
        }
        let row = sessions.iter().find(|r| r["trajectory_id"] == id.as_str()).unwrap();
        assert_eq!(row["llm_calls"], rounds + 1, "{name}: {row:#}");
        assert_eq!(row["call_types"], json!(["main"]), "{name}: {row:#}");
    }
}

/// Two separate runs with identical prompts are two trajectories each (issue 15, item 2), not one merged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vercel_ai_identical_runs_are_separate_trajectories() {
    node_package("ai");
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    run_client(vercel_ai(&tap), 60).await;
    run_client(vercel_ai(&tap), 60).await;
    assert_eq!(up.model_calls().len(), 18, "{}", up.dump());
    up.assert_captured(&tap);
    let steps = tap.export("steps", &[]);
    let sessions = tap.sessions_json();
    for (marker, calls) in [
        ("Responses generate", 2),
        ("Chat stream", 3),
        ("Anthropic stream", 2),
        ("Anthropic generate", 2),
    ] {
        let mut ids: Vec<&str> = steps
            .iter()
            .filter(|s| s["role"] == "user" && s["content"].as_str().is_some_and(|c| c.contains(marker)))
            .map(|s| s["trajectory_id"].as_str().unwrap())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 2, "{marker}: one trajectory per run");
        for id in ids {
            let row = sessions.iter().find(|r| r["trajectory_id"] == id).unwrap();
            assert_eq!(row["llm_calls"], calls, "{marker}: {row:#}");
        }
    }
}
