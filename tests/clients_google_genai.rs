//! google-genai (PyPI `google-genai`, pinned in tests/sdk/requirements.txt) run for real against llmtap and the
//! scripted upstream (tests/sdk/google_genai.py): automatic function calling with generateContent and
//! streamGenerateContent (SSE). Asserts every call captured with the bytes and usage the upstream sent, the
//! function call joined to its result although Gemini sends no call ids, one trajectory per run, and no API key
//! stored; and that the same script run twice gives two trajectories per prompt, not one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::clients::*;
use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use serde_json::Value;

const KEY: &str = "AIzaCLIENTSECRET-google-genai";

fn script(tap: &Llmtap) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/google_genai.py"))
        .env("GEMINI_BASE_URL", format!("http://{}/gemini", tap.addr))
        .env("GEMINI_API_KEY", KEY);
    cmd
}

/// Trajectories holding a user step with `text`, each with its steps.
fn trajectories_with(tap: &Llmtap, text: &str) -> Vec<(String, Vec<Value>)> {
    let by_traj = tap.steps_by_trajectory();
    by_traj
        .into_iter()
        .filter(|(_, steps)| {
            steps
                .iter()
                .any(|s| s["role"] == "user" && s["content"].as_str().is_some_and(|c| c.contains(text)))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn google_genai_function_calling_generate_and_stream() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let run = run_client(script(&tap), 60).await;
    eprintln!("google-genai: {:.1} s\n{}", run.secs, up.dump());
    let out: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(out["generate"], SCRIPTED_TEXT);
    assert_eq!(out["stream"], SCRIPTED_TEXT);
    let calls = up.model_calls();
    let tools: Vec<Option<&str>> = calls.iter().map(|s| s.tool.as_deref()).collect();
    assert_eq!(
        tools,
        [Some("get_weather"), None, Some("get_weather"), None],
        "{}",
        up.dump()
    );
    assert_eq!(
        calls.iter().map(|s| s.streamed).collect::<Vec<_>>(),
        [false, false, true, true]
    );
    up.assert_captured(&tap);
    assert!(
        up.received()
            .iter()
            .all(|r| r.headers.get("x-goog-api-key").is_some_and(|v| v == KEY)),
        "the client's key reaches the upstream"
    );
    assert_eq!(files_containing(&tap.data_dir, "CLIENTSECRET"), Vec::<PathBuf>::new());

    let sessions = tap.sessions_json();
    for marker in ["Gemini generate", "Gemini stream"] {
        let found = trajectories_with(&tap, marker);
        assert_eq!(found.len(), 1, "{marker}: {found:#?}");
        let (id, steps) = &found[0];
        let call = steps
            .iter()
            .flat_map(|s| s["tool_calls"].as_array().cloned().unwrap_or_default())
            .find(|c| c["tool_name"] == "get_weather")
            .unwrap_or_else(|| panic!("{marker}: {steps:#?}"));
        assert_eq!(call["input"]["city"], "Paris");
        let obs = steps
            .iter()
            .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
            .find(|o| o["source_call_id"] == call["tool_call_id"])
            .unwrap_or_else(|| panic!("{marker}: the call has no observation: {steps:#?}"));
        assert!(obs.to_string().contains("Sunny in Paris"), "{obs:#}");
        let row = sessions.iter().find(|r| r["trajectory_id"] == id.as_str()).unwrap();
        assert_eq!(row["llm_calls"], 2, "{marker}: {row:#}");
        assert_eq!(row["call_types"], serde_json::json!(["main"]), "{row:#}");
    }
}

// two separate runs that start alike are two trajectories (issue 15, item 2; Gemini has no
// call ids to tell them apart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn google_genai_run_twice_is_two_trajectories_per_prompt() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    run_client(script(&tap), 60).await;
    run_client(script(&tap), 60).await;
    assert_eq!(up.model_calls().len(), 8);
    up.assert_captured(&tap);
    let sessions = tap.sessions_json();
    for marker in ["Gemini generate", "Gemini stream"] {
        let found = trajectories_with(&tap, marker);
        assert_eq!(found.len(), 2, "{marker}: one trajectory per run: {found:#?}");
        for (id, _) in &found {
            let row = sessions.iter().find(|r| r["trajectory_id"] == id.as_str()).unwrap();
            assert_eq!(row["llm_calls"], 2, "{marker}: {row:#}");
        }
    }
}
