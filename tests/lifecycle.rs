//! Trajectory lifecycle through the real binary: idle close with dangling calls, warmup calls, compaction; and
//! the process's own: the proxy's threads, shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

fn sessions(tap: &Llmtap) -> Vec<Value> {
    tap.sessions_json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_trajectories_close_and_dangling_calls_get_no_result() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, "[derive]\nidle_timeout_secs = 1\n"), dir.path());
    let f = fixture("anthropic_messages/pydantic-ai__parallel_tool_use/00");
    assert_eq!(send_fixture(&client(), &tap, &f, &[]).await.status, 200);
    tap.wait_for_traces(1);
    assert_eq!(sessions(&tap)[0]["closed"], false);
    let mut closed = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if sessions(&tap)[0]["closed"] == true {
            closed = true;
            break;
        }
    }
    assert!(closed, "trajectory not closed after the idle timeout");
    let steps = tap.export("steps", &[]);
    let agent = steps.iter().find(|s| s["role"] == "agent").unwrap();
    let obs = agent["observations"].as_array().unwrap();
    assert_eq!(obs.len(), 4);
    assert!(obs.iter().all(|o| o["error"] == "no_result"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_token_calls_are_warmup() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let f = fixture("anthropic_messages/pydantic-ai__parallel_tool_use/00");
    let mut body: Value = serde_json::from_slice(&f.request).unwrap();
    body["max_tokens"] = json!(1);
    let client = client();
    let r = send_body(&client, &tap, &f, body.to_string().into_bytes()).await;
    assert_eq!(r.status, 200);
    // The same conversation with a real budget is a main call.
    assert_eq!(send_fixture(&client, &tap, &f, &[]).await.status, 200);
    tap.wait_for_traces(2);
    let steps = tap.export("steps", &[]);
    let agents: Vec<&Value> = steps.iter().filter(|s| s["role"] == "agent").collect();
    let types: Vec<&str> = agents.iter().map(|s| s["call_type"].as_str().unwrap()).collect();
    assert!(types.contains(&"warmup") && types.contains(&"main"), "{types:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_restart_is_linked_as_a_continuation() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
    let client = client();
    let system = "You are a coding agent.";
    let first = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing parser test."}]});
    let summary = format!(
        "This session is being continued from a previous conversation that ran out of context. The conversation is summarized below: {}",
        "the user asked to fix the parser test; the agent found the off-by-one in parseToken and edited src/parser.ts. ".repeat(3)
    );
    let second = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": summary}]});
    let unrelated = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You write titles."},
        {"role": "user", "content": summary}]});
    for body in [&first, &second, &unrelated] {
        let r = send_body(&client, &tap, &f, body.to_string().into_bytes()).await;
        assert_eq!(r.status, 200);
    }
    let traces = tap.wait_for_traces(3);
    let ids: Vec<&str> = traces.iter().map(|t| t["trajectory_id"].as_str().unwrap()).collect();
    assert_ne!(ids[0], ids[1]);
    let s = sessions(&tap);
    let by_id = |id: &str| s.iter().find(|x| x["trajectory_id"] == id).unwrap().clone();
    assert_eq!(by_id(ids[1])["continues"], ids[0]);
    assert!(
        by_id(ids[2]).get("continues").is_none(),
        "a different system prompt is not a continuation"
    );
}

/// An older Claude Code (no session header) auto-compacting inside a tool loop, on recorded Anthropic traffic:
/// the run's first call (its first user message led by the context Claude Code injects), then the summarizing
/// call: its own system prompt, the history rebuilt without the injected context, the run's tool results, and a
/// final request for a summary. The summarizing call is its own trajectory, linked to the run and in the run's
/// session (one row in `llmtap sessions`, under the run in its tree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_call_without_a_session_header_is_linked_to_the_run_it_summarizes() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let first = fixture("anthropic_messages/pydantic-ai__parallel_tool_use/00");
    let next = fixture("anthropic_messages/pydantic-ai__parallel_tool_use/01");
    let mut run: Value = serde_json::from_slice(&first.request).unwrap();
    run["messages"][0]["content"].as_array_mut().unwrap().insert(
        0,
        json!({"type": "text", "text": "<system-reminder>\n# claudeMd\nContents of /repo/CLAUDE.md: be brief\n</system-reminder>"}),
    );
    let r = send_body(&client, &tap, &first, run.to_string().into_bytes()).await;
    assert_eq!(r.status, 200);
    // The recorded next request holds the echoed answer and the four tool results; the summary request joins
    // the results' user turn, as the API wants turns to alternate.
    let mut compact: Value = serde_json::from_slice(&next.request).unwrap();
    compact["system"] = json!("You are a helpful AI assistant tasked with summarizing conversations.");
    compact.as_object_mut().unwrap().remove("tools");
    compact.as_object_mut().unwrap().remove("tool_choice");
    compact["messages"][2]["content"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "text",
        "text": "Your task is to create a detailed summary of the conversation so far, paying close attention to \
                 the user's explicit requests and your previous actions."}));
    let r = send_body(&client, &tap, &next, compact.to_string().into_bytes()).await;
    assert_eq!(r.status, 200);
    let traces = tap.wait_for_traces(2);
    let (run_id, compaction_id) = (
        traces[0]["trajectory_id"].as_str().unwrap(),
        traces[1]["trajectory_id"].as_str().unwrap(),
    );
    assert_ne!(run_id, compaction_id);
    let s = sessions(&tap);
    let by_id = |id: &str| s.iter().find(|x| x["trajectory_id"] == id).unwrap().clone();
    let compaction = by_id(compaction_id);
    assert_eq!(compaction["purpose"], "compaction", "{compaction:#}");
    assert_eq!(compaction["parent_trajectory_id"], run_id, "{s:#?}");
    // The run has no session of its own making: its id is the session, and the summary joins it.
    assert_eq!(compaction["session_id"], run_id);
    let groups = tap.session_groups();
    assert_eq!(groups.len(), 1, "{groups:#?}");
    assert_eq!(groups[0]["trajectories"].as_array().unwrap().len(), 2);
}

/// `[server] workers`: the data path runs on that many threads of its own (`llmtap-proxy`), one by default,
/// and captures through them. (Name resolution would add blocking threads of the same name: the upstream is an
/// IP address.)
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_path_runs_on_server_workers_threads_of_its_own() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let f = fixture("anthropic_messages/pydantic-ai__parallel_tool_use/00");
    for (extra, workers) in [("", 1), ("[server]\nworkers = 3\n", 3)] {
        let dir = tempfile::tempdir().unwrap();
        let tap = Llmtap::start(&upstream_config(&up, extra), dir.path());
        assert_eq!(send_fixture(&client(), &tap, &f, &[]).await.status, 200);
        tap.wait_for_traces(1);
        assert_eq!(tap.threads_named("llmtap-proxy"), workers, "config {extra:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_streams_finish_and_keeps_their_traces() {
    use http_body_util::BodyExt;
    let up = Upstream::start(ReplayOptions {
        event_delay: Duration::from_millis(50),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let req = http::Request::post(tap.url("/openai/v1/chat/completions"))
        .header("x-replay-scenario", "slow-stream")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"count"}]}"#,
        )))
        .unwrap();
    let c = client();
    let resp = c.request(req).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));
    // Shut down while the stream is in flight (it has ~2 s to go).
    let pid = tap.pid();
    std::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .unwrap();
    let rest = body.collect().await.expect("stream completes after SIGTERM").to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("tok39") && text.ends_with("data: [DONE]\n\n"), "{text}");
    let status = tap.terminate();
    assert!(status.success());
    // New connections are refused once shutdown started; the finished exchange is in the store.
    let out = common::llmtap_command()
        .args(["export", "--format", "provider-traces", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let traces: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0]["outcome"], "complete");
    assert!(
        traces[0]["response"]["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("tok39")
    );
}
