//! The official OpenAI and Anthropic Python SDKs, pointed at llmtap through their base-URL variables only,
//! streaming and not, get the provider's answers unchanged, and every call is captured.
//!
//! The SDKs live in the virtualenv that `scripts/test.sh` creates (`.venv`); `LLMTAP_TEST_PYTHON` overrides.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use serde_json::Value;

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMTAP_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "the SDK tests need the openai and anthropic Python packages: run scripts/test.sh (creates .venv) or set LLMTAP_TEST_PYTHON"
    );
    venv
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_work_through_llmtap_and_are_captured() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/clients.py");
    let base = format!("http://{}", tap.addr);
    let py = python();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(py)
            .arg(script)
            .env("OPENAI_BASE_URL", format!("{base}/openai/v1"))
            .env("ANTHROPIC_BASE_URL", format!("{base}/anthropic"))
            .env("OPENAI_API_KEY", "sk-test-SDKSECRET-openai")
            .env("ANTHROPIC_API_KEY", "sk-ant-SDKSECRET-anthropic")
            .env("OPENAI_MAX_RETRIES", "0")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "SDK script failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    // Each SDK parsed exactly what the provider recorded.
    let fx = |name: &str| all_fixtures().into_iter().find(|f| f.name == name).unwrap();
    let chat = fx("openai_chat/openllmetry__chat_basic_gzip");
    let chat_json = chat.response_json.unwrap();
    assert_eq!(
        r["openai_chat_nonstream"]["content"],
        chat_json["choices"][0]["message"]["content"]
    );
    assert_eq!(
        r["openai_chat_nonstream"]["total_tokens"],
        chat_json["usage"]["total_tokens"]
    );
    assert_eq!(r["openai_chat_stream"]["tool"], "get_current_weather");
    assert!(
        r["openai_chat_stream"]["arguments"]["location"]
            .as_str()
            .unwrap()
            .contains("San Francisco")
    );
    assert!(r["openai_chat_stream"]["chunks"].as_u64().unwrap() > 3);
    assert!(!r["openai_responses_stream"]["text"].as_str().unwrap().is_empty());
    assert_eq!(
        r["openai_responses_stream"]["text"],
        r["openai_responses_stream"]["final_text"]
    );
    let anth = fx("anthropic_messages/pydantic-ai__parallel_tool_use/00")
        .response_json
        .unwrap();
    assert_eq!(r["anthropic_nonstream"]["stop_reason"], "tool_use");
    assert_eq!(
        r["anthropic_nonstream"]["tools"].as_array().unwrap().len(),
        anth["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .count()
    );
    assert!(r["anthropic_stream"]["text"].as_str().unwrap().contains("cross"));
    assert!(!r["anthropic_stream"]["thinking"].as_str().unwrap().is_empty());

    // Every call was captured, with the SDK's own request and the reassembled response.
    let traces = tap.wait_for_traces(5);
    assert_eq!(traces.len(), 5, "{traces:#?}");
    let by_api = |api: &str| traces.iter().filter(|t| t["api"] == api).collect::<Vec<_>>();
    assert_eq!(by_api("openai.chat").len(), 2);
    assert_eq!(by_api("openai.responses").len(), 1);
    assert_eq!(by_api("anthropic.messages").len(), 2);
    for t in &traces {
        assert_eq!(t["outcome"], "complete", "{}", t["id"]);
        assert!(t["request"]["model"].is_string());
        let ua = t["headers"]["request"]["user-agent"].as_str().unwrap_or("");
        assert!(ua.contains("OpenAI/Python") || ua.contains("Anthropic/Python"), "{ua}");
    }
    let stream = by_api("anthropic.messages")
        .into_iter()
        .find(|t| t["streamed"] == true)
        .unwrap();
    assert_eq!(stream["response"]["id"], r["anthropic_stream"]["id"]);
    assert_eq!(
        stream["response"]["usage"]["output_tokens"],
        r["anthropic_stream"]["output_tokens"]
    );
    let resp = by_api("openai.responses")[0];
    assert_eq!(resp["response"]["id"], r["openai_responses_stream"]["id"]);

    let mut tap = tap;
    tap.terminate();
    // Every file of the data directory, the capture spill's included.
    for file in common::files_under(dir.path()) {
        let hay = String::from_utf8_lossy(&std::fs::read(&file).unwrap()).into_owned();
        assert!(!hay.contains("SDKSECRET"), "API key stored in {}", file.display());
    }
}
