//! Adapters against the whole corpus: the normalized call of every recorded interaction (golden files in
//! tests/golden/normalized, reviewed by hand; `LLMTAP_BLESS=1` rewrites them), and usage checked against the
//! provider's own numbers with the conversion rules written out independently here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use llmtap::capture::Api;
use llmtap::capture::sse::parse_events;
use llmtap::model::call::NormalizedCall;
use llmtap::model::json::Json;
use llmtap::provider::{CallContext, adapter_for};
use serde_json::Value;

/// (request, response as a non-streamed body, normalized call) for every fixture with an adapter.
fn normalized() -> Vec<(Fixture, Value, NormalizedCall)> {
    let mut out = Vec::new();
    for f in all_fixtures() {
        let Some((response, call)) = f.normalize() else {
            continue;
        };
        out.push((f, response, call));
    }
    out
}

#[test]
fn normalized_calls_match_golden() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/normalized");
    let bless = std::env::var_os("LLMTAP_BLESS").is_some();
    let all = normalized();
    assert!(all.len() >= 85, "{}", all.len());
    for (f, _, call) in &all {
        let got = serde_json::to_value(call).unwrap();
        let file = dir.join(format!("{}.json", f.name.replace('/', "__")));
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&file, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        }
        let want: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(got, want, "{}", f.name);
    }
}

fn n(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for k in path {
        cur = &cur[*k];
    }
    cur.as_u64().unwrap_or(0)
}

#[test]
fn usage_is_exact_against_provider_numbers() {
    let mut checked = 0;
    for (f, resp, call) in normalized() {
        let (input, output, cache_read, reasoning) = match f.api() {
            Api::OpenAiChat => {
                let u = &resp["usage"];
                if !u.is_object() {
                    assert!(call.usage.is_none(), "{}", f.name);
                    continue;
                }
                (
                    n(u, &["prompt_tokens"]),
                    n(u, &["completion_tokens"]),
                    n(u, &["prompt_tokens_details", "cached_tokens"]),
                    n(u, &["completion_tokens_details", "reasoning_tokens"]),
                )
            }
            Api::OpenAiResponses => {
                let u = &resp["usage"];
                if !u.is_object() {
                    assert!(call.usage.is_none(), "{}", f.name);
                    continue;
                }
                (
                    n(u, &["input_tokens"]),
                    n(u, &["output_tokens"]),
                    n(u, &["input_tokens_details", "cached_tokens"]),
                    n(u, &["output_tokens_details", "reasoning_tokens"]),
                )
            }
            Api::AnthropicMessages => {
                let u = &resp["usage"];
                if !u.is_object() {
                    assert!(call.usage.is_none(), "{}", f.name);
                    continue;
                }
                let cr = n(u, &["cache_read_input_tokens"]);
                let cw = n(u, &["cache_creation_input_tokens"]);
                assert_eq!(call.usage.unwrap().cache_write.unwrap_or(0), cw, "{}", f.name);
                (n(u, &["input_tokens"]) + cr + cw, n(u, &["output_tokens"]), cr, 0)
            }
            Api::GeminiGenerateContent => {
                let u = &resp["usageMetadata"];
                if !u.is_object() {
                    assert!(call.usage.is_none(), "{}", f.name);
                    continue;
                }
                let thoughts = n(u, &["thoughtsTokenCount"]);
                // Gemini's total is prompt + candidates + tool-use prompt + thoughts: our input + output.
                let input = n(u, &["promptTokenCount"]) + n(u, &["toolUsePromptTokenCount"]);
                let output = n(u, &["candidatesTokenCount"]) + thoughts;
                if u.get("totalTokenCount").is_some() && f.kind != BodyKind::Sse {
                    assert_eq!(input + output, n(u, &["totalTokenCount"]), "{}", f.name);
                }
                (input, output, n(u, &["cachedContentTokenCount"]), thoughts)
            }
            // Bedrock Converse has no recorded fixtures here (tests/cloud_routes.rs checks its usage).
            Api::BedrockConverse | Api::Other => continue,
        };
        let u = call.usage.unwrap_or_else(|| panic!("{}: usage missing", f.name));
        assert_eq!(u.input, input, "{}: input", f.name);
        assert_eq!(u.output, output, "{}: output", f.name);
        assert_eq!(u.cache_read.unwrap_or(0), cache_read, "{}: cache_read", f.name);
        assert_eq!(u.reasoning.unwrap_or(0), reasoning, "{}: reasoning", f.name);
        assert!(call.raw_usage.is_some());
        checked += 1;
    }
    assert!(checked >= 70, "{checked}");
}

#[test]
fn streamed_usage_combines_start_and_final_events() {
    // Anthropic: input side in message_start, output in message_delta (cumulative).
    let all = normalized();
    let (_, _, call) = all
        .iter()
        .find(|(f, _, _)| f.name == "anthropic_messages/pydantic-ai__thinking_stream")
        .unwrap();
    let u = call.usage.unwrap();
    assert_eq!(u.input, 43);
    assert!(u.output > 100, "{u:?}");
    // OpenAI chat: usage only in the last chunk (choices: []).
    let (_, _, call) = all
        .iter()
        .find(|(f, _, _)| f.name == "openai_chat/pydantic-ai__stream_include_usage_parallel_tools")
        .unwrap();
    assert_eq!(call.usage.unwrap().input, 364);
    assert_eq!(call.output.tool_calls.len(), 2);
}

#[test]
fn errors_are_read_from_http_and_mid_stream() {
    let all = normalized();
    for (f, _, call) in &all {
        if f.status >= 400 {
            let e = call
                .error
                .as_ref()
                .unwrap_or_else(|| panic!("{}: error missing", f.name));
            assert!(!e.message.is_empty() && !e.kind.is_empty(), "{}", f.name);
        }
    }
    let (_, _, groq) = all
        .iter()
        .find(|(f, _, _)| f.name == "agent_sessions/pydantic-ai__groq_retry_after_midstream_error/00")
        .unwrap();
    let e = groq.error.as_ref().unwrap();
    assert_eq!(e.kind, "invalid_request_error");
    assert!(e.message.contains("Tool call validation failed"));
    assert!(
        groq.output
            .reasoning
            .as_deref()
            .unwrap()
            .starts_with("We need to call the tool")
    );
}

#[test]
fn reasoning_in_every_dialect_is_found() {
    let all = normalized();
    let has_reasoning = |name: &str| {
        let (_, _, c) = all
            .iter()
            .find(|(f, _, _)| f.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        c.output.reasoning.as_deref().is_some_and(|r| !r.is_empty()) || c.output.reasoning_redacted
    };
    assert!(has_reasoning("anthropic_messages/pydantic-ai__thinking_stream"));
    assert!(has_reasoning("gemini/pydantic-ai__stream_thoughts"));
    assert!(has_reasoning(
        "openai_responses/pydantic-ai__reasoning_with_tool_calls/00"
    ));
    assert!(has_reasoning(
        "agent_sessions/pydantic-ai__groq_retry_after_midstream_error/01"
    ));
}

#[test]
fn unknown_fields_do_not_break_parsing() {
    let adapter = adapter_for(Api::OpenAiChat).unwrap();
    let req = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi", "brand_new": {"x": 1}}], "new_param": true});
    let resp = serde_json::json!({"id": "c1", "model": "m", "future": [1], "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "yo", "annotations": [], "new_field": "z"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "new_detail": {"q": 1}}});
    let ctx = CallContext {
        path: "/v1/chat/completions",
        status: Some(200),
    };
    let (req, resp) = (req.to_string(), resp.to_string());
    let call = adapter
        .normalize(&ctx, &Json::parse(&req).unwrap(), &Json::parse(&resp).unwrap())
        .unwrap();
    assert_eq!(call.output.text.as_deref(), Some("yo"));
    assert_eq!(call.usage.unwrap().input, 3);
    let events = parse_events(
        "data: {\"id\":\"c\",\"new\":1,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\",\"novel\":\"x\"}}]}\n\ndata: [DONE]\n\n",
    );
    let body = adapter.reassemble(&events).unwrap();
    assert_eq!(body["new"], 1);
    assert_eq!(body["choices"][0]["message"]["novel"], "x");
}

#[test]
fn response_only_chunk_recordings_reassemble() {
    // vercel/ai fixtures: one SSE data payload per line, framing stripped.
    let dir = fixtures_root().join("response_only_vercel-ai");
    for (file, api) in [
        (
            "anthropic__anthropic-json-output-format.1.chunks.txt",
            Api::AnthropicMessages,
        ),
        (
            "google__google-reasoning-gemini3.chunks.txt",
            Api::GeminiGenerateContent,
        ),
        (
            "google__google-tool-call-gemini3.chunks.txt",
            Api::GeminiGenerateContent,
        ),
        (
            "google__google-stream-tool-call-array-arguments-missing-terminal-function-call.chunks.txt",
            Api::GeminiGenerateContent,
        ),
        (
            "openai__openai-reasoning-encrypted-content.1.chunks.txt",
            Api::OpenAiResponses,
        ),
        ("openai__openai-error.1.chunks.txt", Api::OpenAiResponses),
    ] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let sse: String = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| format!("data: {l}\n\n"))
            .collect();
        let adapter = adapter_for(api).unwrap();
        let body = adapter
            .reassemble(&parse_events(&sse))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let ctx = CallContext {
            path: "/v1beta/models/gemini-3-pro:streamGenerateContent",
            status: Some(200),
        };
        let call = adapter
            .normalize(&ctx, &Json::parse("{}").unwrap(), &Json::from_value(&body))
            .unwrap();
        if file.contains("error") {
            assert!(call.error.is_some(), "{file}");
        } else {
            assert!(
                call.output.text.is_some() || !call.output.tool_calls.is_empty(),
                "{file}: {body}"
            );
        }
    }
}
