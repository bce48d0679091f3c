//! The scripted upstream (tests/common/scripted.rs) through llmtap, with a plain HTTP client: every API shape,
//! streamed and not, answers a tool call and then text, and llmtap captures it as sent. Also the proxy's
//! transparency for what real clients hit: an upstream error status (529 overloaded, streamed request or not)
//! is the trace's top-level `error` and its outcome `upstream_error`; a call whose upstream cannot be reached
//! keeps its request; llmtap adds no `accept-encoding` the client did not send; a `HEAD`
//! answer keeps the upstream's headers (its `content-length` is not replaced by the empty body's 0).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use serde_json::{Value, json};

async fn post(client: &Client, tap: &Llmtap, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    send(client, "POST", &tap.url(path), &h, serde_json::to_vec(body).unwrap()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_error_status_is_the_traces_error_streamed_or_not() {
    for tls in [true, false] {
        error_status_is_the_traces_error(tls).await;
    }
}

async fn error_status_is_the_traces_error(tls: bool) {
    let up = if tls {
        Scripted::start().await
    } else {
        Scripted::start_plain().await
    };
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let ask = |stream: bool| {
        json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]})
    };
    for stream in [false, true] {
        let r = post(
            &client,
            &tap,
            "/anthropic/v1/messages",
            &[("x-scripted-status", "529"), ("anthropic-version", "2023-06-01")],
            &ask(stream),
        )
        .await;
        assert_eq!(r.status, 529);
        let sent = up.sent().last().unwrap().body.clone();
        assert_eq!(
            r.body.as_ref(),
            sent.as_slice(),
            "the error body reaches the client unchanged"
        );
    }
    let r = post(
        &client,
        &tap,
        "/openai/v1/chat/completions",
        &[("x-scripted-status", "503")],
        &json!({"model": "gpt-4o-mini", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 503);

    let traces = tap.wait_for_traces(3);
    assert_eq!(traces.len(), 3, "{traces:#?}");
    for t in &traces {
        let error = t["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no top-level error: {t:#}"));
        let status = t["status"].as_u64().unwrap();
        assert!(status >= 500, "{t:#}");
        if status == 529 {
            assert!(error.contains("overloaded"), "{error}");
        }
        assert_eq!(
            t["outcome"], "upstream_error",
            "an error status is not a complete call: {t:#}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_headers_reach_the_upstream_as_the_client_sent_them() {
    for tls in [true, false] {
        headers_as_sent(tls).await;
    }
}

async fn headers_as_sent(tls: bool) {
    let up = if tls {
        Scripted::start().await
    } else {
        Scripted::start_plain().await
    };
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
    post(&client, &tap, "/openai/v1/chat/completions", &[], &body).await;
    post(
        &client,
        &tap,
        "/openai/v1/chat/completions",
        &[("accept-encoding", "gzip, br")],
        &body,
    )
    .await;
    let got = up.received();
    assert_eq!(got.len(), 2);
    assert!(
        got[0].headers.get("accept-encoding").is_none(),
        "no accept-encoding the client did not send (tls {tls}): {:?}",
        got[0].headers
    );
    assert_eq!(got[1].headers.get("accept-encoding").unwrap(), "gzip, br");
    let names = |h: &http::HeaderMap| {
        let mut n: Vec<String> = h.keys().map(|k| k.as_str().to_owned()).collect();
        n.sort();
        n
    };
    // The client's own headers, and nothing more (`host` becomes HTTP/2's `:authority` upstream).
    let mut sent = names(&got[0].headers);
    sent.retain(|n| n != "host");
    assert_eq!(sent, ["content-length", "content-type"], "tls {tls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_answer_keeps_the_upstreams_headers() {
    for tls in [true, false] {
        head_without_length(tls).await;
    }
}

async fn head_without_length(tls: bool) {
    let up = if tls {
        Scripted::start().await
    } else {
        Scripted::start_plain().await
    };
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let get = send(&client, "GET", &tap.url("/openai/v1/models"), &[], vec![]).await;
    assert_eq!(get.status, 200);
    let r = send(&client, "HEAD", &tap.url("/openai/v1/models"), &[], vec![]).await;
    assert_eq!(r.status, 200);
    assert!(r.body.is_empty());
    assert_eq!(
        r.headers.get("content-length"),
        get.headers.get("content-length"),
        "a HEAD answer keeps the upstream's length (tls {tls}): {:?}",
        r.headers
    );
    assert_eq!(r.headers.get("content-length").unwrap(), &get.body.len().to_string());
    assert_eq!(r.headers.get("request-id").unwrap(), "req_scripted000000000002");
    // An upstream HEAD answer without a length gets none added (hyper would announce the empty body's 0).
    let r = send(
        &client,
        "HEAD",
        &tap.url("/openai/v1/models"),
        &[("x-scripted-no-length", "1")],
        vec![],
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(
        r.headers.get("content-length").is_none(),
        "llmtap added a content-length (tls {tls}): {:?}",
        r.headers
    );
}

/// One tool round then text, for every API shape, streamed and not: what the client got is what the upstream
/// sent, and llmtap's trace has the upstream's usage and the tool call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripted_upstream_answers_every_api_shape_and_llmtap_captures_it() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let schema = json!({"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]});
    let mut calls: Vec<(String, Value)> = Vec::new();
    for stream in [false, true] {
        calls.push((
            "/anthropic/v1/messages".into(),
            json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "stream": stream,
                "tools": [{"name": "bash", "description": "run", "input_schema": schema}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "list", "cache_control": {"type": "ephemeral"}}]}]}),
        ));
        calls.push((
            "/anthropic/v1/messages".into(),
            json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "stream": stream,
                "tools": [{"name": "bash", "description": "run", "input_schema": schema}],
                "messages": [{"role": "user", "content": "list"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "echo hi"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "hi"}]}]}),
        ));
        let mut chat = json!({"model": "gpt-4o-mini", "stream": stream,
            "tools": [{"type": "function", "function": {"name": "shell", "parameters": schema}}],
            "messages": [{"role": "user", "content": "list"}]});
        if stream {
            chat["stream_options"] = json!({"include_usage": true});
        }
        calls.push(("/openai/v1/chat/completions".into(), chat));
        calls.push((
            "/openai/v1/responses".into(),
            json!({"model": "gpt-4o-mini", "stream": stream,
                "tools": [{"type": "function", "name": "shell", "parameters": schema}],
                "input": [{"role": "user", "content": "list"},
                    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "hi"}]}),
        ));
        let method = if stream {
            "streamGenerateContent?alt=sse"
        } else {
            "generateContent"
        };
        calls.push((
            format!("/gemini/v1beta/models/gemini-2.5-flash:{method}"),
            json!({"contents": [{"role": "user", "parts": [{"text": "list [[tool:shell]]"}]}],
                "tools": [{"functionDeclarations": [{"name": "shell", "parameters": schema}]}]}),
        ));
    }
    for (path, body) in &calls {
        let r = post(&client, &tap, path, &[], body).await;
        assert_eq!(r.status, 200, "{path}: {}", String::from_utf8_lossy(&r.body));
        let sent = up.sent().last().unwrap().clone();
        assert_eq!(
            r.body.as_ref(),
            sent.body.as_slice(),
            "{path}: bytes reach the client unchanged"
        );
    }
    let sent = up.sent();
    let tools: Vec<Option<&str>> = sent.iter().map(|s| s.tool.as_deref()).collect();
    assert_eq!(
        tools[..5],
        [Some("bash"), None, Some("shell"), None, Some("shell")],
        "tool first, text after a tool result"
    );
    assert_eq!(tools[..5], tools[5..]);

    let traces = up.assert_captured(&tap);
    for s in &sent {
        let t = traces
            .iter()
            .find(|t| t["headers"]["response"]["request-id"] == s.request_id().as_str())
            .unwrap();
        assert!(t["error"].is_null(), "{t:#}");
        let text = t["response"].to_string();
        match &s.tool {
            Some(tool) => assert!(text.contains("echo hi") && text.contains(tool.as_str()), "{text}"),
            None => assert!(text.contains(SCRIPTED_TEXT), "{text}"),
        }
    }
    let first = traces
        .iter()
        .find(|t| t["headers"]["response"]["request-id"] == sent[0].request_id().as_str())
        .unwrap();
    let cached = &first["usage"];
    assert!(cached["cache_read"].as_u64().unwrap() > 0, "{cached}");
}

/// Issue 36 item 10: a call whose upstream cannot be reached keeps the request the agent sent (and so its model),
/// a small body and one large enough to arrive in many frames alike; and an error status from the upstream (501)
/// is an `upstream_error`, not a complete call, with its status kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_call_keeps_its_request_and_an_error_status_is_not_complete() {
    let up = Scripted::start_plain().await;
    // A port with nothing listening.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let extra = format!("[upstreams.dead]\nurl = \"http://127.0.0.1:{dead_port}\"\napi = \"anthropic\"\n");
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, &extra), dir.path());
    let client = client();
    let small = json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello"}]});
    let large = json!({"model": "claude-opus-4-1", "max_tokens": 64,
        "messages": [{"role": "user", "content": "x".repeat(300_000)}]});
    for body in [&small, &large] {
        let r = post(
            &client,
            &tap,
            "/dead/v1/messages",
            &[("anthropic-version", "2023-06-01")],
            body,
        )
        .await;
        assert_eq!(r.status, 502);
    }
    let r = post(
        &client,
        &tap,
        "/openai/v1/chat/completions",
        &[("x-scripted-status", "501")],
        &json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 501);

    let traces = tap.wait_for_traces(3);
    assert_eq!(traces.len(), 3);
    for (t, sent) in traces.iter().zip([&small, &large]) {
        assert_eq!(t["outcome"], "upstream_error");
        assert!(t["status"].is_null(), "{}", t["status"]);
        assert!(
            t["error"].as_str().unwrap().contains("upstream unreachable"),
            "{}",
            t["error"]
        );
        assert_eq!(&t["request"], sent, "the request the agent sent is kept");
        assert_eq!(t["model"], sent["model"]);
    }
    let refused = &traces[2];
    assert_eq!(refused["status"], 501);
    assert_eq!(
        refused["outcome"], "upstream_error",
        "an error status is not a complete call"
    );
    assert!(refused["error"].is_string(), "{refused:#}");
    assert_eq!(refused["model"], "gpt-4o-mini");
}
