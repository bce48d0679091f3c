//! llmtap's own gRPC API through the real binary: a live subscription sees each step as its call completes;
//! filters work; queries return what the store holds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use llmtap::api::pb;
use llmtap::api::pb::llm_tap_client::LlmTapClient;

async fn connect(tap: &Llmtap) -> LlmTapClient<tonic::transport::Channel> {
    LlmTapClient::connect(format!("http://{}", tap.api_addr.expect("api enabled")))
        .await
        .unwrap()
}

async fn next_event(stream: &mut tonic::Streaming<pb::Event>) -> pb::Event {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("event in time")
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_subscription_sees_each_step_as_its_call_completes() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let mut api = connect(&tap).await;
    let mut stream = api
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let client = client();
    let calls = session("pydantic-ai__anthropic_parallel_tools_agent");

    // Call 1: its trace and its steps arrive before call 2 is even sent.
    assert_eq!(send_fixture(&client, &tap, &calls[0], &[]).await.status, 200);
    let mut first = Vec::new();
    while !first
        .iter()
        .any(|e: &pb::Event| matches!(&e.kind, Some(pb::event::Kind::Step(s)) if s.role == "agent"))
    {
        first.push(next_event(&mut stream).await);
    }
    let trace = first.iter().find_map(|e| match &e.kind {
        Some(pb::event::Kind::Trace(t)) => Some(t.clone()),
        _ => None,
    });
    let trace = trace.expect("trace event");
    assert_eq!(trace.api, "anthropic.messages");
    assert_eq!(trace.status, 200);
    let agent = first.iter().find_map(|e| match &e.kind {
        Some(pb::event::Kind::Step(s)) if s.role == "agent" => Some(s.clone()),
        _ => None,
    });
    let agent = agent.unwrap();
    assert_eq!(agent.tool_calls, 4);
    assert_eq!(agent.observations, 0);

    // Call 2 carries the tool results: the first step is sent again, now with its observations.
    assert_eq!(send_fixture(&client, &tap, &calls[1], &[]).await.status, 200);
    let mut updated = None;
    for _ in 0..10 {
        if let Some(pb::event::Kind::Step(s)) = next_event(&mut stream).await.kind
            && s.step_id == agent.step_id
        {
            updated = Some(s);
            break;
        }
    }
    let updated = updated.expect("updated step");
    assert_eq!(updated.observations, 4);
    let full: serde_json::Value = serde_json::from_str(&updated.json).unwrap();
    assert_eq!(full["observations"].as_array().unwrap().len(), 4);

    // Queries match the store.
    tap.wait_for_traces(2);
    let sessions = api
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].llm_calls, 2);
    let steps = api
        .get_session_steps(pb::GetSessionStepsRequest {
            session: sessions[0].trajectory_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .steps;
    let exported = tap.export("steps", &[]);
    assert_eq!(steps.len(), exported.len());
    assert!(
        api.get_session_steps(pb::GetSessionStepsRequest::default())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_filter_by_session_and_agent() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let mut api = connect(&tap).await;
    let mut only_b = api
        .subscribe(pb::SubscribeRequest {
            session: "b".into(),
            traces: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut only_planner = api
        .subscribe(pb::SubscribeRequest {
            agent: "planner".into(),
            steps: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
    let client = client();
    send_fixture(
        &client,
        &tap,
        &f,
        &[("x-llmtap-session", "a"), ("x-llmtap-agent", "coder")],
    )
    .await;
    send_fixture(
        &client,
        &tap,
        &f,
        &[("x-llmtap-session", "b"), ("x-llmtap-agent", "planner")],
    )
    .await;
    match next_event(&mut only_b).await.kind {
        Some(pb::event::Kind::Trace(t)) => assert_eq!(t.session_id, "b"),
        other => panic!("{other:?}"),
    }
    // Only traces were asked for, only for session b: nothing else arrives.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), only_b.message())
            .await
            .is_err()
    );
    let mut steps = Vec::new();
    while let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_millis(800), only_planner.message()).await {
        match e.kind {
            Some(pb::event::Kind::Step(s)) => steps.push(s),
            other => panic!("steps only: {other:?}"),
        }
    }
    assert!(!steps.is_empty());
    assert!(steps.iter().all(|s| s.agent == "planner" && s.session_id == "b"));
}
