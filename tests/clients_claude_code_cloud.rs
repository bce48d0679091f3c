//! Claude Code (npm `@anthropic-ai/claude-code`, pinned in tests/clients/package.json) on its cloud providers,
//! through llmtap to the scripted upstream: Bedrock (`CLAUDE_CODE_USE_BEDROCK=1`, `ANTHROPIC_BEDROCK_BASE_URL`,
//! `CLAUDE_CODE_SKIP_BEDROCK_AUTH=1`: InvokeModelWithResponseStream, answered in AWS event-stream framing) and
//! Vertex AI (`CLAUDE_CODE_USE_VERTEX=1`, `ANTHROPIC_VERTEX_BASE_URL`, `CLAUDE_CODE_SKIP_VERTEX_AUTH=1`:
//! streamRawPredict), and Bedrock Mantle (`CLAUDE_CODE_USE_MANTLE=1`, `ANTHROPIC_BEDROCK_MANTLE_BASE_URL`,
//! `CLAUDE_CODE_SKIP_MANTLE_AUTH=1`: Anthropic Messages with Bedrock model ids). A `claude -p` run with one Bash round: every call captured with its usage, the model from
//! the path, the tool call joined to its result, and the calls priced from the cloud's own table.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::claude::*;
use common::clients::*;
use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use serde_json::Value;

const BEDROCK_MODEL: &str = "us.anthropic.claude-sonnet-4-5-20250929-v1:0";
const VERTEX_MODEL: &str = "claude-sonnet-4-5@20250929";
const MANTLE_MODEL: &str = "anthropic.claude-opus-4-7";

/// `claude -p` isolated from the developer's config and quiet on the network, with `cloud`'s variables.
fn claude(bin: &PathBuf, home: &std::path::Path, project: &std::path::Path, cloud: &[(&str, String)]) -> Command {
    let mut c = Command::new(bin);
    c.current_dir(project)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("CLAUDE_CONFIG_DIR", home.join(".claude"))
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("DISABLE_BUG_COMMAND", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("CLAUDE_CODE_DISABLE_TERMINAL_TITLE", "1");
    for (k, v) in cloud {
        c.env(k, v);
    }
    c.args([
        "-p",
        "Say hi using the shell.",
        "--output-format",
        "json",
        "--allowedTools",
        "Bash",
    ]);
    c
}

/// Run Claude Code against llmtap's `route` (a cloud family routed to the scripted upstream) and check the
/// capture. Returns the provider traces of the main loop.
async fn run_on(
    route: &str,
    api: &str,
    cloud: &str,
    env: impl Fn(&str) -> Vec<(&'static str, String)>,
) -> Option<Vec<Value>> {
    let Some(bin) = claude_binary() else {
        eprintln!("SKIP: no native Claude Code build for this platform");
        return None;
    };
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(
        &up,
        &format!(
            "[upstreams.{route}]\nurl = \"https://127.0.0.1:{}\"\napi = \"{api}\"\nca_file = \"{}\"\n",
            up.addr.port(),
            up.ca_pem_path.display()
        ),
    );
    let tap = Llmtap::start(&config, dir.path());
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let base = format!("http://{}/{route}", tap.addr);
    let run = run_client(claude(&bin, home.path(), project.path(), &env(&base)), 90).await;
    eprintln!("claude -p on {route}: {:.1} s\n{}", run.secs, up.dump());
    let out: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(out["result"], SCRIPTED_TEXT, "{out:#}");

    let main_calls: Vec<_> = up
        .model_calls()
        .into_iter()
        .filter(|s| s.request.to_string().contains("Say hi using the shell."))
        .collect();
    assert_eq!(main_calls.len(), 2, "a Bash round, then the answer: {}", up.dump());
    assert_eq!(main_calls[0].tool.as_deref(), Some("Bash"));
    assert!(main_calls.iter().all(|s| s.streamed), "{}", up.dump());
    // The bytes and usage the upstream sent are what llmtap stored, for every exchange.
    let traces = up.assert_captured(&tap);

    let main_traces: Vec<Value> = traces
        .iter()
        .filter(|t| t["request"].to_string().contains("Say hi using the shell.") && t["api"] == "anthropic.messages")
        .cloned()
        .collect();
    assert_eq!(main_traces.len(), 2, "{main_traces:#?}");
    for t in &main_traces {
        if route != "bedrock-mantle" {
            assert!(t["request"].get("model").is_none(), "the body names no model: {t:#}");
        }
        // Priced from the cloud's rows of the table (Claude on Bedrock's regional profiles costs more than
        // Anthropic's API), for the model the path names.
        let usage: llmtap::model::usage::Usage = serde_json::from_value(t["usage"].clone()).unwrap();
        let model = t["path"].as_str().unwrap().split("/model/").nth(1).map_or_else(
            || t["model"].as_str().unwrap().to_owned(),
            |m| m.split('/').next().unwrap().to_owned(),
        );
        let table = llmtap::cost::CostTable::embedded().unwrap();
        let want = table
            .cost(cloud, &model, llmtap::capture::now_micros(), &usage)
            .unwrap();
        assert_eq!(
            t["cost_usd"]["total"],
            want.usd.total.to_string(),
            "{cloud} {model}: {t:#}"
        );
        let first_party = table
            .cost(
                "anthropic",
                "claude-sonnet-4-5-20250929",
                llmtap::capture::now_micros(),
                &usage,
            )
            .unwrap();
        if model.contains("anthropic.claude-sonnet-4-5") {
            assert!(want.usd.total > first_party.usd.total, "a regional profile costs more");
        }
    }

    // The tool round is derived: the Bash call joined to its result in the next request.
    let by_traj = tap.steps_by_trajectory();
    let steps = by_traj
        .values()
        .find(|steps| {
            steps.iter().any(|s| {
                s["content"]
                    .as_str()
                    .is_some_and(|c| c.contains("Say hi using the shell."))
            })
        })
        .unwrap_or_else(|| panic!("no trajectory with the prompt: {by_traj:#?}"));
    let call = steps
        .iter()
        .flat_map(|s| s["tool_calls"].as_array().cloned().unwrap_or_default())
        .find(|c| c["tool_name"] == "Bash")
        .unwrap_or_else(|| panic!("no Bash call: {steps:#?}"));
    assert_eq!(call["input"]["command"], "echo hi");
    let obs = steps
        .iter()
        .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
        .find(|o| o["source_call_id"] == call["tool_call_id"])
        .unwrap_or_else(|| panic!("the Bash call has no observation: {steps:#?}"));
    assert!(obs["content"].as_str().unwrap_or("").contains("hi"), "{obs:#}");
    assert_eq!(steps.iter().filter(|s| s["role"] == "agent").count(), 2, "{steps:#?}");
    Some(main_traces)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_on_bedrock_through_llmtap_is_captured_derived_and_priced() {
    let Some(traces) = run_on("bedrock", "bedrock", "aws.bedrock", |base| {
        vec![
            ("CLAUDE_CODE_USE_BEDROCK", "1".into()),
            ("CLAUDE_CODE_SKIP_BEDROCK_AUTH", "1".into()),
            ("ANTHROPIC_BEDROCK_BASE_URL", base.to_owned()),
            ("AWS_REGION", "us-east-1".into()),
            ("ANTHROPIC_MODEL", BEDROCK_MODEL.into()),
            ("ANTHROPIC_SMALL_FAST_MODEL", BEDROCK_MODEL.into()),
        ]
    })
    .await
    else {
        return;
    };
    for t in &traces {
        let path = t["path"].as_str().unwrap();
        assert!(
            path.starts_with("/model/") && path.ends_with("/invoke-with-response-stream"),
            "{path}"
        );
        assert_eq!(t["streamed"], true);
        assert!(
            t["response_headers"]
                .to_string()
                .contains("application/vnd.amazon.eventstream")
                || t["headers"].to_string().contains("application/vnd.amazon.eventstream"),
            "{t:#}"
        );
        assert_eq!(t["request"]["anthropic_version"], "bedrock-2023-05-31");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_on_vertex_through_llmtap_is_captured_derived_and_priced() {
    let Some(traces) = run_on("vertex", "vertex", "gcp.vertex_ai", |base| {
        vec![
            ("CLAUDE_CODE_USE_VERTEX", "1".into()),
            ("CLAUDE_CODE_SKIP_VERTEX_AUTH", "1".into()),
            ("ANTHROPIC_VERTEX_BASE_URL", format!("{base}/v1")),
            ("ANTHROPIC_VERTEX_PROJECT_ID", "my-project".into()),
            ("CLOUD_ML_REGION", "us-east5".into()),
            ("ANTHROPIC_MODEL", VERTEX_MODEL.into()),
            ("ANTHROPIC_SMALL_FAST_MODEL", VERTEX_MODEL.into()),
        ]
    })
    .await
    else {
        return;
    };
    for t in &traces {
        let path = t["path"].as_str().unwrap();
        assert_eq!(
            path,
            format!(
                "/v1/projects/my-project/locations/us-east5/publishers/anthropic/models/{VERTEX_MODEL}:streamRawPredict"
            )
        );
        assert_eq!(t["request"]["anthropic_version"], "vertex-2023-10-16");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_on_bedrock_mantle_through_llmtap_is_captured_derived_and_priced() {
    let Some(traces) = run_on("bedrock-mantle", "bedrock-mantle", "aws.bedrock", |base| {
        vec![
            ("CLAUDE_CODE_USE_MANTLE", "1".into()),
            ("CLAUDE_CODE_SKIP_MANTLE_AUTH", "1".into()),
            // Mantle serves Anthropic's API under /anthropic on its host (llmtap's route is the host).
            ("ANTHROPIC_BEDROCK_MANTLE_BASE_URL", format!("{base}/anthropic")),
            ("AWS_REGION", "us-east-1".into()),
            ("ANTHROPIC_MODEL", MANTLE_MODEL.into()),
            ("ANTHROPIC_SMALL_FAST_MODEL", MANTLE_MODEL.into()),
        ]
    })
    .await
    else {
        return;
    };
    for t in &traces {
        assert_eq!(t["path"], "/anthropic/v1/messages?beta=true", "{t:#}");
        assert_eq!(t["request"]["model"], MANTLE_MODEL);
    }
}
