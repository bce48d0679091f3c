//! Dropping by whole trajectory, through the real binary: with a capture queue of one exchange, a client
//! running several conversations overruns capture; every conversation is then stored as a prefix of its calls
//! (never with a hole), and each conversation that lost calls is counted once in
//! `llmtap_capture_dropped_trajectories_total`, which `llmtap status` shows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// Call `call` (1-based) of conversation `conv`: a shared system prompt, the conversation's first user
/// message, then one assistant/user pair per earlier call.
fn request(conv: usize, call: usize) -> Vec<u8> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are the same assistant in every conversation."}),
        json!({"role": "user", "content": format!("conversation {conv}")}),
    ];
    for i in 1..call {
        messages.push(json!({"role": "assistant", "content": format!("answer {i}")}));
        messages.push(json!({"role": "user", "content": format!("follow-up {i}")}));
    }
    serde_json::to_vec(&json!({"model": "gpt-4o-mini", "messages": messages})).unwrap()
}

/// (conversation, call) of a stored request built by `request`.
fn identify(request: &Value) -> (usize, usize) {
    let messages = request["messages"].as_array().unwrap();
    let conv = messages[1]["content"]
        .as_str()
        .and_then(|c| c.strip_prefix("conversation "))
        .and_then(|n| n.parse().ok())
        .unwrap();
    (conv, (messages.len() - 2) / 2 + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_capture_drops_whole_conversations_and_counts_them() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    // Without the spill (on by default), which would absorb the overrun instead of dropping.
    let config = upstream_config(&up, "[capture]\nqueue_capacity = 1\nspill_bytes = 0\n");
    let tap = Llmtap::start(&config, dir.path());
    let f = all_fixtures()
        .into_iter()
        .find(|f| f.api() == llmtap::capture::Api::OpenAiChat && f.status == 200 && f.kind == BodyKind::Json)
        .expect("a recorded OpenAI chat completion");
    let client = client();
    let (conversations, calls) = (8, 6);
    // The conversations' calls in lockstep: each exchange reaches the capture queue (after its response is
    // written) before its conversation's next request is sent, and the eight exchanges of one step arrive
    // together at a one-slot queue, so most find it full. Rounds of new conversations until some exchange was
    // dropped.
    let mut sent = Vec::new();
    let url = tap.url(&f.client_path);
    for round in 0..10 {
        for call in 1..=calls {
            // Call `call` of every conversation at once; the next call of each only once all are answered.
            let sends: Vec<_> = (round * conversations..(round + 1) * conversations)
                .map(|conv| {
                    let (client, url, name) = (client.clone(), url.clone(), f.name.clone());
                    tokio::spawn(async move {
                        send(
                            &client,
                            "POST",
                            &url,
                            &[("x-replay-fixture", name.as_str())],
                            request(conv, call),
                        )
                        .await
                        .status
                    })
                })
                .collect();
            for s in sends {
                assert_eq!(s.await.unwrap(), 200, "traffic is unaffected by capture dropping");
            }
        }
        sent.extend(round * conversations..(round + 1) * conversations);
        if tap.metric("llmtap_capture_dropped_total") > 0 {
            break;
        }
    }
    // Settled: every exchange processed or dropped, and every processed one stored as a trace.
    let exchanges = (sent.len() * calls) as u64;
    wait::poll_until("every exchange processed or dropped", Duration::from_secs(20), || {
        tap.metric("llmtap_processed_total") + tap.metric("llmtap_capture_dropped_total") == exchanges
    });
    let processed = tap.metric("llmtap_processed_total") as usize;
    let mut traces = Vec::new();
    wait::poll_until("every processed exchange stored", Duration::from_secs(20), || {
        traces = tap.export("provider-traces", &[]);
        traces.len() == processed
    });

    let dropped = tap.metric("llmtap_capture_dropped_total");
    assert!(dropped > 0, "a one-exchange queue overran");
    let mut stored: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for t in traces {
        let (conv, call) = identify(&t["request"]);
        stored.entry(conv).or_default().push(call);
    }
    let mut lost = 0;
    for &conv in &sent {
        let mut got = stored.remove(&conv).unwrap_or_default();
        got.sort_unstable();
        let prefix: Vec<usize> = (1..=got.len()).collect();
        assert_eq!(
            got, prefix,
            "conversation {conv}: stored calls are a prefix, never with a hole"
        );
        lost += usize::from(got.len() < calls);
    }
    assert!(lost > 0, "{dropped} exchanges dropped");
    // The pipeline counts a conversation whose last exchange was dropped once it finds the queue quiet.
    wait::poll_until("the dropped conversations counted", Duration::from_secs(20), || {
        tap.metric("llmtap_capture_dropped_trajectories_total") >= lost as u64
    });
    assert_eq!(
        tap.metric("llmtap_capture_dropped_trajectories_total"),
        lost as u64,
        "each conversation that lost calls counted once ({dropped} exchanges dropped)"
    );
    assert_eq!(
        tap.metric("llmtap_processed_total") + dropped,
        exchanges,
        "every exchange is either processed or counted as dropped"
    );
}
