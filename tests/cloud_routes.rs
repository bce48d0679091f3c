//! The cloud routes (Bedrock runtime and Mantle, Vertex AI, Azure OpenAI) against wire-format fixtures built from
//! the providers' documentation (tests/fixtures/cloud): each call decoded (Bedrock's binary event-stream
//! included), reassembled, normalized and priced like the golden files in tests/golden/cloud say
//! (`LLMTAP_BLESS=1` rewrites them); the same through the real binary, bytes unchanged for the client; and
//! damaged event-streams (cut frames, bad checksums) forwarded as they came, their capture marked, no panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;

use common::clients::files_containing;
use common::cloud::*;
use common::*;
use llmtap::capture::{Captured, ExchangeMeta, Outcome, RawExchange, Timings};
use llmtap::config::ApiFamily;
use llmtap::pipeline::process::{ProcessError, Processed, process};
use serde_json::{Value, json};

const CAP: usize = 32 << 20;
/// 2025-10-01, after every price change the fixtures' models had.
const AT: i64 = 1_759_276_800_000_000;

fn family(name: &str) -> ApiFamily {
    match name {
        "bedrock" => ApiFamily::Bedrock,
        "bedrock-mantle" => ApiFamily::BedrockMantle,
        "vertex" => ApiFamily::Vertex,
        _ => ApiFamily::AzureOpenai,
    }
}

/// The exchange the data path captures for `f` with `body` as its response.
fn raw_exchange(f: &CloudFixture, body: &[u8]) -> RawExchange {
    let path = f.path.split('?').next().unwrap();
    RawExchange {
        id: llmtap::capture::exchange_id(AT),
        upstream: f.route().into(),
        api: llmtap::provider::detect_api(family(f.family), path),
        method: http::Method::POST,
        path: f.path.clone(),
        status: Some(f.status),
        request: Captured {
            headers: [("content-type", "application/json")].into_iter().collect(),
            body: [f.request.clone().into()].into(),
            len: f.request.len() as u64,
            ended: true,
            ..Default::default()
        },
        response: Some(Captured {
            headers: [("content-type", f.content_type.as_str())].into_iter().collect(),
            body: f.frames(body).into_iter().collect(),
            len: body.len() as u64,
            ended: true,
            ..Default::default()
        }),
        timings: Timings {
            start: AT,
            first_byte: Some(AT + 300_000),
            end: AT + 1_000_000,
        },
        outcome: Outcome::Complete,
        error: None,
        meta: ExchangeMeta::default(),
        charge: Default::default(),
    }
}

fn processed(f: &CloudFixture, body: &[u8]) -> Processed {
    let mut p = process(raw_exchange(f, body), CAP);
    let table = llmtap::cost::CostTable::embedded().unwrap();
    let metrics = llmtap::telemetry::Metrics::default();
    llmtap::pipeline::pricing::price(&table, &mut p.trace, p.call.as_ref(), &metrics);
    p
}

#[test]
fn cloud_calls_normalize_and_price_as_the_golden_files_say() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/cloud");
    let bless = std::env::var_os("LLMTAP_BLESS").is_some();
    let fixtures = cloud_fixtures();
    assert!(fixtures.len() >= 13, "{}", fixtures.len());
    for f in &fixtures {
        let p = processed(f, &f.body);
        let errors: Vec<String> = p.errors.iter().map(ToString::to_string).collect();
        assert!(errors.is_empty(), "{}: {errors:?}", f.name);
        let t = &p.trace;
        let got = json!({
            "api": t.api.as_str(),
            "provider": llmtap::provider::otel_provider_name(t.api, &t.upstream, &t.path, t.model.as_deref()),
            "model": t.model,
            "streamed": t.streamed,
            "outcome": t.outcome.as_str(),
            "error": t.error,
            "usage": t.usage,
            "cost": t.cost,
            "call": p.call,
        });
        let file = dir.join(format!("{}.json", f.name.replace('/', "__")));
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&file, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        }
        let want: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(got, want, "{}", f.name);
    }
}

/// The numbers the golden files hold, checked against the documented wire fields with the conversion written
/// out here: input includes cache reads and writes; the model comes from the path where the body has none.
#[test]
fn usage_and_model_follow_the_wire_fields() {
    let get = |name: &str| {
        let f = cloud_fixture(name);
        processed(&f, &f.body)
    };
    // Converse: inputTokens excludes the cache; totalTokens is their sum with the output.
    let p = get("bedrock/converse_tool_use");
    let u = p.trace.usage.unwrap();
    assert_eq!((u.input, u.output, u.cache_write), (375 + 1000, 61, Some(1000)));
    assert_eq!(u.input + u.output, 1436, "= the documented totalTokens");
    let call = p.call.unwrap();
    assert_eq!(
        call.model_requested.as_deref(),
        Some("us.anthropic.claude-sonnet-4-5-20250929-v1:0")
    );
    assert_eq!(call.output.tool_calls[0].arguments, json!({"sign": "WZPZ"}));
    assert_eq!(call.system.as_deref(), Some("You are a radio assistant."));

    // The event-stream: the reassembled body is the one Converse would have returned.
    let p = get("bedrock/converse_stream_tool_round");
    let u = p.trace.usage.unwrap();
    assert_eq!((u.input, u.output, u.cache_read), (442 + 1000, 83, Some(1000)));
    let call = p.call.unwrap();
    assert_eq!(
        call.output.text.as_deref(),
        Some("The most popular song on WZPZ is Elemental Hotel by 8 Storey Hike.")
    );
    assert_eq!(call.output.reasoning.as_deref(), Some("The tool returned the song."));
    assert_eq!(call.output.tool_calls[0].id, "tooluse_Xq8BfQ7mT1mAb9F0c2D3eA");
    assert_eq!(call.output.tool_calls[0].arguments, json!({"sign": "WKRP"}));
    assert!(p.trace.raw_response.unwrap().contains("event: contentBlockDelta\n"));

    // InvokeModelWithResponseStream: Anthropic events inside base64 chunks; the percent-encoded path model.
    let p = get("bedrock/invoke_stream_tool_use");
    let u = p.trace.usage.unwrap();
    assert_eq!((u.input, u.output, u.cache_read), (472 + 1024, 89, Some(1024)));
    assert_eq!(u.input, 1496, "= Bedrock's own invocation metrics' inputTokenCount");
    let call = p.call.unwrap();
    assert_eq!(
        call.model_requested.as_deref(),
        Some("us.anthropic.claude-sonnet-4-5-20250929-v1:0")
    );
    assert_eq!(
        call.output.tool_calls[0].arguments,
        json!({"location": "San Francisco, CA"})
    );
    assert_eq!(
        llmtap::provider::otel_provider_name(p.trace.api, &p.trace.upstream, &p.trace.path, p.trace.model.as_deref()),
        "aws.bedrock"
    );
    assert!(p.trace.cost.is_some(), "priced from the AWS table");

    let p = get("vertex/anthropic_raw_predict");
    assert_eq!(
        p.call.unwrap().model_requested.as_deref(),
        Some("claude-sonnet-4-5@20250929")
    );
    assert!(p.trace.cost.is_some());

    // Priced as the path's model: a global profile costs less than the regional one the response names.
    let f = cloud_fixture("bedrock/invoke_tool_use");
    let regional = processed(&f, &f.body).trace.cost.unwrap();
    assert_eq!(
        regional.input.to_string(),
        "0.0012672",
        "384 uncached × $3.30/Mtok (regional)"
    );
    let mut global = f.clone();
    global.path = f.path.replace("/model/us.", "/model/global.");
    let global = processed(&global, &f.body).trace.cost.unwrap();
    assert_eq!(global.input.to_string(), "0.001152", "384 uncached × $3/Mtok (global)");

    // OpenAI's cache writes: part of input, priced at the table's cache-write rate (1.25× input here).
    let p = get("azure/v1_responses_cache_write");
    let u = p.trace.usage.unwrap();
    assert_eq!((u.input, u.cache_write, u.cache_read), (1438, Some(1408), Some(0)));
    let cost = p.trace.cost.unwrap();
    // OpenAI's gpt-5.6-terra (Azure falls back to OpenAI's rows) at the fixture's date: $2.50 input, $3.125 write.
    assert_eq!(cost.cache_write.to_string(), "0.00440", "1408 × $3.125/Mtok");
    assert_eq!(cost.input.to_string(), "0.000075", "30 uncached × $2.50/Mtok");

    let p = get("azure/deployment_chat");
    let call = p.call.unwrap();
    assert_eq!(call.model_requested.as_deref(), Some("my-gpt-4o"));
    assert_eq!(call.model_response.as_deref(), Some("gpt-4o-2024-11-20"));
    assert!(p.trace.cost.is_some(), "Azure falls back to OpenAI's prices");
}

/// Every way to cut or corrupt a Bedrock stream: the pipeline keeps what came before the damage, marks the
/// trace truncated, reports the damage as a processing error, and never panics.
#[test]
fn damaged_event_streams_are_kept_up_to_the_damage_and_marked() {
    for name in [
        "bedrock/invoke_stream_tool_use",
        "bedrock/converse_stream_tool_round",
        "bedrock/converse_stream_throttled",
    ] {
        let f = cloud_fixture(name);
        let whole = processed(&f, &f.body);
        assert_eq!(whole.trace.outcome, Outcome::Complete, "{name}");
        // Where messages end: a stream that stops there is well-framed (the HTTP body's end is all that says it
        // stopped early), anywhere else the framing itself shows the cut.
        let mut boundaries = std::collections::HashSet::new();
        let mut at = 0;
        while at < f.body.len() {
            at += u32::from_be_bytes(f.body[at..at + 4].try_into().unwrap()) as usize;
            boundaries.insert(at);
        }
        for cut in 1..f.body.len() {
            let p = processed(&f, &f.body[..cut]);
            if boundaries.contains(&cut) {
                assert_eq!(p.trace.outcome, Outcome::Complete, "{name} cut at {cut}");
                continue;
            }
            assert_eq!(p.trace.outcome, Outcome::Truncated, "{name} cut at {cut}");
            assert!(
                p.errors.iter().any(|e| matches!(e, ProcessError::EventStream { .. })),
                "{name} cut at {cut}"
            );
        }
        // Each flipped byte breaks a checksum (or the lengths): the capture is marked, never a panic.
        for at in (0..f.body.len()).step_by(7) {
            let mut body = f.body.clone();
            body[at] ^= 0x41;
            let p = processed(&f, &body);
            assert_eq!(p.trace.outcome, Outcome::Truncated, "{name} flipped at {at}");
        }
    }
    // A bad message checksum in the middle: the messages after it are still read.
    let f = cloud_fixture("bedrock/converse_stream_tool_round");
    let first = u32::from_be_bytes(f.body[..4].try_into().unwrap()) as usize;
    let mut body = f.body.clone();
    body[first - 5] ^= 1;
    let p = processed(&f, &body);
    assert_eq!(p.trace.outcome, Outcome::Truncated);
    let call = p.call.unwrap();
    assert_eq!(call.output.tool_calls.len(), 1, "later messages survive a bad checksum");
    assert_eq!(call.usage.unwrap().output, 83);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_routes_through_the_binary_forward_unchanged_and_capture_priced_calls() {
    let fixtures = cloud_fixtures();
    let up = serve_cloud(fixtures.clone(), HashMap::new()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&cloud_routes(&up), dir.path());
    let client = client();
    for f in &fixtures {
        let mut headers = vec![("content-type", "application/json")];
        if f.family == "azure-openai" {
            headers.push(("api-key", "azure-CLIENTSECRET-0123456789"));
        } else {
            headers.push(("authorization", "Bearer cloud-CLIENTSECRET-0123456789"));
        }
        let reply = send(
            &client,
            "POST",
            &tap.url(&format!("/{}{}", f.route(), f.path)),
            &headers,
            f.request.clone(),
        )
        .await;
        assert_eq!(reply.status, f.status, "{}", f.name);
        assert_eq!(reply.body, f.body, "{}: the client gets the provider's bytes", f.name);
    }
    let traces = tap.wait_for_traces(fixtures.len());
    assert_eq!(traces.len(), fixtures.len());
    for f in &fixtures {
        // Found by its response (two fixtures share a path; a request's credential-like members are redacted).
        let want = processed(f, &f.body);
        let response: Value = serde_json::from_str(want.trace.response.as_str()).unwrap();
        let t = traces
            .iter()
            .find(|t| t["upstream"] == f.route() && t["path"] == f.path.as_str() && t["response"] == response)
            .unwrap_or_else(|| panic!("no trace for {}", f.name));
        assert_eq!(t["outcome"], "complete", "{}: {t:#}", f.name);
        assert_eq!(t["api"], want.trace.api.as_str(), "{}", f.name);
        assert_eq!(
            t["usage"],
            serde_json::to_value(want.trace.usage).unwrap(),
            "{}",
            f.name
        );
        assert_eq!(t["model"], json!(want.trace.model), "{}", f.name);
        // Priced when the golden call is (the amount depends on the day: prices change).
        assert_eq!(
            t["cost_usd"]["total"].is_string(),
            want.trace.cost.is_some(),
            "{}: {t:#}",
            f.name
        );
    }
    // The Azure key reached the upstream and nothing of either key reached llmtap's files.
    let received = up.received.lock().unwrap().clone();
    assert!(received.iter().any(|r| {
        r.headers
            .get("api-key")
            .is_some_and(|v| v == "azure-CLIENTSECRET-0123456789")
    }));
    assert_eq!(
        files_containing(&tap.data_dir, "CLIENTSECRET"),
        Vec::<std::path::PathBuf>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_bedrock_stream_reaches_the_client_unchanged_and_its_capture_is_marked() {
    let f = cloud_fixture("bedrock/converse_stream_tool_round");
    let mut bad_crc = f.body.clone();
    let first = u32::from_be_bytes(bad_crc[..4].try_into().unwrap()) as usize;
    bad_crc[first - 5] ^= 1;
    let cut = f.body[..f.body.len() - 9].to_vec();
    let up = serve_cloud(vec![f.clone()], HashMap::from([(f.name.clone(), bad_crc.clone())])).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&cloud_routes(&up), dir.path());
    let client = client();
    let url = tap.url(&format!("/bedrock{}", f.path));
    let reply = send(
        &client,
        "POST",
        &url,
        &[("content-type", "application/json")],
        f.request.clone(),
    )
    .await;
    assert_eq!(reply.body, bad_crc, "forwarded byte for byte, damage included");
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["outcome"], "truncated", "{:#}", traces[0]);
    assert_eq!(
        traces[0]["usage"]["output"], 83,
        "what came after the damaged message is kept"
    );
    assert!(tap.metric("llmtap_process_errors_total") >= 1);
    drop(tap);

    // A stream cut mid-message (the upstream ends the body early).
    let up = serve_cloud(vec![f.clone()], HashMap::from([(f.name.clone(), cut.clone())])).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&cloud_routes(&up), dir.path());
    let url = tap.url(&format!("/bedrock{}", f.path));
    let reply = send(
        &client,
        "POST",
        &url,
        &[("content-type", "application/json")],
        f.request.clone(),
    )
    .await;
    assert_eq!(reply.body, cut);
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["outcome"], "truncated", "{:#}", traces[0]);
    assert!(traces[0]["usage"].is_null(), "the metadata event was in the cut part");
}
