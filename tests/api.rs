//! llmtap's own gRPC API through the real binary: a live subscription sees each step as its call completes;
//! filters work; queries return what the store holds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use llmtap::api::pb;

async fn next_event(stream: &mut tonic::Streaming<pb::Event>) -> pb::Event {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("event in time")
        .unwrap()
        .unwrap()
}

/// llmtap over the replaying upstream, with a gRPC client subscribed to every step and call.
async fn subscribed_to_everything() -> (
    Upstream,
    tempfile::TempDir,
    Llmtap,
    ApiClient,
    tonic::Streaming<pb::Event>,
) {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let mut api = api_client(&tap).await;
    let stream = api
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    (up, dir, tap, api, stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_subscription_sees_each_step_as_its_call_completes() {
    let (_up, _dir, tap, mut api, mut stream) = subscribed_to_everything().await;
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
    let mut api = api_client(&tap).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_localharness_subscription_streams_tool_calls_then_their_results() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let mut api = api_client(&tap).await;
    let mut stream = api
        .subscribe(pb::SubscribeRequest {
            format: "localharness".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let client = client();
    let calls = session("pydantic-ai__anthropic_parallel_tools_agent");
    let mut events: Vec<serde_json::Value> = Vec::new();
    let mut next = async |events: &mut Vec<serde_json::Value>| {
        let e = next_event(&mut stream).await;
        match e.kind {
            Some(pb::event::Kind::Localharness(json)) => events.push(serde_json::from_str(&json).unwrap()),
            other => panic!("only localharness events on this subscription: {other:?}"),
        }
    };
    // Call 1 asks for four tools: four TOOL_CALL events, no results yet.
    assert_eq!(send_fixture(&client, &tap, &calls[0], &[]).await.status, 200);
    while events.iter().filter(|e| e["tool_calls"].is_array()).count() < 4 {
        next(&mut events).await;
    }
    assert!(events.iter().all(|e| e["tool_results"].is_null()));
    assert_eq!(events[0]["source"], "SYSTEM", "the system prompt opens the stream");
    // Call 2 carries the results: four tool-result events answering those ids, then the turn goes on.
    assert_eq!(send_fixture(&client, &tap, &calls[1], &[]).await.status, 200);
    while events.iter().filter(|e| e["tool_results"].is_array()).count() < 4 {
        next(&mut events).await;
    }
    let called: std::collections::HashSet<&str> = events
        .iter()
        .filter_map(|e| e["tool_calls"][0]["id"].as_str())
        .collect();
    for e in events.iter().filter(|e| e["tool_results"].is_array()) {
        assert!(called.contains(e["tool_results"][0]["id"].as_str().unwrap()));
        assert_eq!(e["type"], "TOOL_CALL");
        assert_eq!(e["status"], "DONE");
    }
    // Indexes count up within the turn without gaps or repeats.
    let indexes: Vec<u64> = events
        .iter()
        .filter(|e| e["source"] != "USER")
        .map(|e| e["step_index"].as_u64().unwrap())
        .collect();
    let mut sorted = indexes.clone();
    sorted.dedup();
    assert_eq!(indexes.len(), sorted.len(), "no repeated index: {indexes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_over_grpc_matches_the_cli() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let calls = session("pydantic-ai__two_agents_interleaved");
    for f in &calls {
        assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
    }
    tap.wait_for_traces(calls.len());
    let mut api = api_client(&tap).await;
    for format in ["atif", "letta", "turnwise", "localharness", "steps"] {
        let mut stream = api
            .export(pb::ExportRequest {
                format: format.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.message().await.unwrap() {
            assert!(chunk.data.ends_with(b"\n"), "chunks hold whole lines");
            bytes.extend_from_slice(&chunk.data);
        }
        let cli = tap.cli(&["export", "--format", format]);
        assert!(!cli.is_empty());
        assert_eq!(String::from_utf8(bytes).unwrap(), cli, "{format}");
    }
    // One session only, by trajectory id.
    let sessions = tap.sessions_json();
    let id = sessions[0]["trajectory_id"].as_str().unwrap();
    let mut stream = api
        .export(pb::ExportRequest {
            format: "steps".into(),
            session: id.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while let Some(chunk) = stream.message().await.unwrap() {
        for line in chunk.data.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let step: serde_json::Value = serde_json::from_slice(line).unwrap();
            assert_eq!(step["trajectory_id"], id);
            n += 1;
        }
    }
    assert_eq!(n, sessions[0]["steps"].as_u64().unwrap());
    // Bad input is a clear error, not a broken stream.
    let err = api
        .export(pb::ExportRequest {
            format: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("nope"));
}

/// The live feed is the store's commit feed: when a step or call event arrives, its record can already be read
/// back (the viewer reloads the session on an event; a read that found nothing would show a stale page).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_arrives_only_after_its_record_is_committed() {
    let (_up, _dir, tap, _api, mut stream) = subscribed_to_everything().await;
    let client = client();
    let calls = session("pydantic-ai__openai_chat_stream_agent_3calls");
    let viewer = format!("http://{}", tap.viewer_addr.unwrap());
    let mut checked = (0, 0);
    for f in &calls {
        assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
        // Each call ends with its trace and its agent step, in whichever order the pass wrote them.
        let (mut trace_seen, mut agent_seen) = (false, false);
        while !(trace_seen && agent_seen) {
            let event = next_event(&mut stream).await;
            match event.kind {
                // Read at once, on the event: no wait, no retry.
                Some(pb::event::Kind::Trace(t)) => {
                    let r = send(&client, "GET", &format!("{viewer}/api/calls/{}", t.id), &[], Vec::new()).await;
                    assert_eq!(r.status, 200, "call {} readable when its event arrives", t.id);
                    checked.0 += 1;
                    trace_seen = true;
                }
                Some(pb::event::Kind::Step(s)) => {
                    let page = send(
                        &client,
                        "GET",
                        &format!("{viewer}/api/trajectories/{}/steps", s.trajectory_id),
                        &[],
                        Vec::new(),
                    )
                    .await;
                    assert_eq!(page.status, 200);
                    let page: serde_json::Value = serde_json::from_slice(&page.body).unwrap();
                    assert!(
                        page.to_string().contains(&s.step_id),
                        "step {} readable when its event arrives: {page}",
                        s.step_id
                    );
                    checked.1 += 1;
                    agent_seen |= s.role == "agent";
                }
                _ => {}
            }
        }
    }
    assert_eq!(checked.0, calls.len(), "every call's event checked");
    assert!(checked.1 >= calls.len(), "steps checked: {}", checked.1);
}
