//! Derivation over the recorded multi-call agent sessions: replayed in order through the running proxy, then
//! read back with `llmtap export` / `llmtap sessions`. Also: interleaving unrelated sessions changes nothing,
//! and two llmtap processes agree on trajectory ids and step indexes without talking to each other.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use common::*;
use serde_json::Value;

struct Replayed {
    /// Trajectory id of each call, in call order (None for non-LLM calls such as traces/ingest).
    call_trajectory: Vec<Option<String>>,
    steps: Vec<Value>,
    sessions: Vec<Value>,
}

async fn replay_session(name: &str) -> Replayed {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    replay_into(&tap, &session(name)).await;
    let traces = tap.wait_for_traces(session(name).len());
    let steps = tap.export("steps", &[]);
    let sessions: Vec<Value> = tap.sessions_json();
    Replayed {
        call_trajectory: traces
            .iter()
            .map(|t| t["trajectory_id"].as_str().map(str::to_owned))
            .collect(),
        steps,
        sessions,
    }
}

async fn replay_into(tap: &Llmtap, calls: &[Fixture]) {
    let client = client();
    for f in calls {
        let r = send_fixture(&client, tap, f, &[]).await;
        assert_eq!(r.status, f.status, "{}", f.name);
    }
}

fn agent_steps<'a>(r: &'a Replayed, traj: &str) -> Vec<&'a Value> {
    r.steps
        .iter()
        .filter(|s| s["trajectory_id"] == traj && s["role"] == "agent")
        .collect()
}

fn distinct(ids: &[Option<String>]) -> Vec<String> {
    let mut seen = Vec::new();
    for id in ids.iter().flatten() {
        if !seen.contains(id) {
            seen.push(id.clone());
        }
    }
    seen
}

/// Tool results that answer a tool call made by an earlier response, by id (stable-id APIs).
fn expected_links(calls: &[Fixture]) -> BTreeSet<String> {
    let mut called: BTreeSet<String> = BTreeSet::new();
    let mut answered: BTreeSet<String> = BTreeSet::new();
    for f in calls {
        let req: Value = serde_json::from_slice(&f.request).unwrap();
        let text = req.to_string();
        for id in &called {
            if text.contains(&format!("\"{id}\"")) && is_result_id_in(&req, id) {
                answered.insert(id.clone());
            }
        }
        let trace_resp = match f.kind {
            BodyKind::Sse => String::from_utf8(f.body.clone()).unwrap(),
            _ => f.response_json.as_ref().map(|v| v.to_string()).unwrap_or_default(),
        };
        for key in ["\"call_id\":\"", "\"id\":\"call_", "\"id\":\"toolu_"] {
            let mut rest = trace_resp.as_str();
            while let Some(i) = rest.find(key) {
                let after = &rest[i + key.len()..];
                let end = after.find('"').unwrap();
                let prefix = if key.ends_with("call_") {
                    "call_"
                } else if key.ends_with("toolu_") {
                    "toolu_"
                } else {
                    ""
                };
                called.insert(format!("{prefix}{}", &after[..end]));
                rest = &after[end..];
            }
        }
    }
    answered
}

fn is_result_id_in(req: &Value, id: &str) -> bool {
    let s = req.to_string();
    s.contains(&format!("\"tool_call_id\":\"{id}\""))
        || s.contains(&format!("\"tool_use_id\":\"{id}\""))
        || (s.contains(&format!("\"call_id\":\"{id}\"")) && s.contains("function_call_output"))
}

fn observed_ids(r: &Replayed) -> BTreeSet<String> {
    r.steps
        .iter()
        .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
        .filter(|o| o["error"].is_null())
        .map(|o| o["source_call_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat_streamed_agent_is_one_trajectory_with_every_result_linked() {
    let name = "pydantic-ai__openai_chat_stream_agent_3calls";
    let r = replay_session(name).await;
    let trajs = distinct(&r.call_trajectory);
    assert_eq!(trajs.len(), 1, "{trajs:?}");
    let steps = agent_steps(&r, &trajs[0]);
    assert_eq!(steps.len(), 3);
    let want = expected_links(&session(name));
    assert!(!want.is_empty());
    assert_eq!(observed_ids(&r), want);
    // Step indexes come from the request: user 0, agent 1, agent 2, agent 3.
    let idx: Vec<u64> = steps.iter().map(|s| s["step_index"].as_u64().unwrap()).collect();
    assert_eq!(idx, [1, 2, 3]);
    assert_eq!(r.steps[0]["role"], "user");
    // Calls after the first extend the previous prompt exactly: prefix reuse = previous input + output.
    let u0 = &steps[0]["token_usage"];
    let u1 = &steps[1]["token_usage"];
    assert_eq!(
        u1["prefix_reuse_tokens"].as_u64().unwrap(),
        u0["input_tokens"].as_u64().unwrap() + u0["output_tokens"].as_u64().unwrap()
    );
    assert_eq!(u1["prefix_reuse_estimated"], false);
    for s in &steps[..2] {
        for tc in s["tool_calls"].as_array().unwrap() {
            assert!(tc["duration_ms"].is_u64(), "tool duration estimated: {tc}");
        }
    }
    assert_eq!(r.sessions.len(), 1);
    assert_eq!(r.sessions[0]["llm_calls"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_parallel_tool_results_all_link_to_their_calls() {
    let name = "pydantic-ai__anthropic_parallel_tools_agent";
    let r = replay_session(name).await;
    let trajs = distinct(&r.call_trajectory);
    assert_eq!(trajs.len(), 1);
    let steps = agent_steps(&r, &trajs[0]);
    assert_eq!(steps[0]["tool_calls"].as_array().unwrap().len(), 4);
    assert_eq!(steps[0]["observations"].as_array().unwrap().len(), 4);
    assert_eq!(observed_ids(&r), expected_links(&session(name)));
    assert!(steps[0]["token_usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert!(steps[0]["system_prompt_hash"].as_str().unwrap().starts_with("sp_"));
    assert_eq!(steps[1]["finish_reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_agents_sdk_handoff_creates_a_linked_child_trajectory() {
    let name = "openllmetry__openai_agents_sdk_handoff_hierarchy";
    let calls = session(name);
    let r = replay_session(name).await;
    // traces/ingest calls are captured but are not LLM calls.
    for (f, t) in calls.iter().zip(&r.call_trajectory) {
        assert_eq!(t.is_some(), f.upstream_path.ends_with("/responses"), "{}", f.name);
    }
    let trajs = distinct(&r.call_trajectory);
    assert_eq!(
        trajs.len(),
        3,
        "triage agent, recipe editor after handoff, recipe editor run alone: {trajs:?}"
    );
    let triage = r.call_trajectory[0].clone().unwrap();
    let editor = r.call_trajectory[1].clone().unwrap();
    assert_eq!(r.call_trajectory[3].as_ref(), Some(&editor));
    assert_eq!(r.call_trajectory[6].as_ref(), Some(&editor));
    let alone = r.call_trajectory[7].clone().unwrap();
    assert_eq!(r.call_trajectory[9].as_ref(), Some(&alone));
    assert_eq!(r.call_trajectory[10].as_ref(), Some(&alone));

    let child = agent_steps(&r, &editor);
    let parent = agent_steps(&r, &triage);
    assert_eq!(parent.len(), 1);
    for s in &child {
        assert_eq!(s["call_type"], "subagent");
        assert_eq!(s["parent_trajectory_id"], triage.as_str());
        assert_eq!(s["parent_step"], parent[0]["step_index"]);
        assert_eq!(s["agent_role"], "recipe_editor_agent");
    }
    // The handoff call's result (in the child's first request) is the parent step's observation.
    let handoff_id = parent[0]["tool_calls"][0]["tool_call_id"].as_str().unwrap();
    assert_eq!(parent[0]["observations"][0]["source_call_id"], handoff_id);
    for s in agent_steps(&r, &alone) {
        assert_eq!(s["call_type"], "main");
    }
    assert_eq!(observed_ids(&r), expected_links(&calls));
    let child_summary = r
        .sessions
        .iter()
        .find(|s| s["trajectory_id"] == editor.as_str())
        .unwrap();
    assert_eq!(child_summary["parent_trajectory_id"], triage.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn google_adk_transfer_links_the_sub_agent_to_the_router() {
    let r = replay_session("openinference__google_adk_multi_agent").await;
    let trajs = distinct(&r.call_trajectory);
    assert_eq!(trajs.len(), 2, "{trajs:?}");
    let root = r.call_trajectory[0].clone().unwrap();
    let weather = r.call_trajectory[1].clone().unwrap();
    assert_eq!(r.call_trajectory[2].as_ref(), Some(&weather));
    let steps = agent_steps(&r, &weather);
    assert_eq!(steps.len(), 2);
    for s in &steps {
        assert_eq!(s["call_type"], "subagent");
        assert_eq!(s["parent_trajectory_id"], root.as_str());
        assert_eq!(s["agent_role"], "weather_agent");
    }
    // get_weather's functionResponse (no ids on the wire) is linked by name and order.
    assert_eq!(steps[0]["tool_calls"][0]["tool_name"], "get_weather");
    assert_eq!(steps[0]["observations"].as_array().unwrap().len(), 1);
    assert!(
        steps[0]["observations"][0]["content"]
            .as_str()
            .unwrap()
            .contains("sunny")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_five_call_loop_links_every_function_response() {
    let name = "pydantic-ai__gemini_tool_loop_5calls";
    let calls = session(name);
    let r = replay_session(name).await;
    let trajs = distinct(&r.call_trajectory);
    assert_eq!(trajs.len(), 1, "{trajs:?}");
    let steps = agent_steps(&r, &trajs[0]);
    assert_eq!(steps.len(), 5);
    let last: Value = serde_json::from_slice(&calls.last().unwrap().request).unwrap();
    let responses = last.to_string().matches("\"functionResponse\"").count();
    let observations: usize = steps.iter().map(|s| s["observations"].as_array().unwrap().len()).sum();
    let calls_made: usize = steps[..4]
        .iter()
        .map(|s| s["tool_calls"].as_array().unwrap().len())
        .sum();
    assert_eq!(responses, calls_made);
    assert_eq!(observations, responses, "every functionResponse linked to its call");
    for s in &steps[..4] {
        let tcs = s["tool_calls"].as_array().unwrap();
        let obs = s["observations"].as_array().unwrap();
        assert_eq!(tcs.len(), obs.len());
        for (tc, o) in tcs.iter().zip(obs) {
            assert_eq!(tc["tool_call_id"], o["source_call_id"]);
        }
    }
    assert!(
        steps
            .iter()
            .all(|s| s["token_usage"]["reasoning_tokens"].as_u64().unwrap() > 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_in_one_cassette_are_kept_apart() {
    let r = replay_session("pydantic-ai__two_agents_interleaved").await;
    let t: Vec<String> = r.call_trajectory.iter().map(|t| t.clone().unwrap()).collect();
    assert_ne!(t[0], t[1]);
    assert_eq!(t[1], t[2]);
    assert_eq!(t[2], t[3]);
    assert_eq!(r.sessions.len(), 2);
    assert_eq!(agent_steps(&r, &t[1]).len(), 3);
    assert_eq!(agent_steps(&r, &t[0]).len(), 1);
    assert_eq!(
        observed_ids(&r),
        expected_links(&session("pydantic-ai__two_agents_interleaved"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_mid_stream_error_stays_in_the_trajectory() {
    let r = replay_session("pydantic-ai__groq_retry_after_midstream_error").await;
    let trajs = distinct(&r.call_trajectory);
    assert_eq!(trajs.len(), 1, "{trajs:?}");
    let steps = agent_steps(&r, &trajs[0]);
    assert_eq!(steps.len(), 3);
    assert_eq!(steps[0]["status"], "error");
    assert!(
        steps[0]["error"].as_str().unwrap().contains("tool_use_failed")
            || steps[0]["error"].as_str().unwrap().contains("invalid_request_error")
    );
    assert_eq!(steps[1]["status"], "ok");
    assert!(steps[1]["reasoning_content"].as_str().is_some());
}

// === determinism ===

fn step_keys(steps: &[Value]) -> BTreeSet<(String, u64, String)> {
    steps
        .iter()
        .map(|s| {
            (
                s["trajectory_id"].as_str().unwrap().to_owned(),
                s["step_index"].as_u64().unwrap(),
                s["role"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// (step id, tool call id) of every observation.
fn observation_pairs(steps: &[Value]) -> BTreeSet<(String, String)> {
    steps
        .iter()
        .flat_map(|s| {
            let id = s["step_id"].as_str().unwrap().to_owned();
            s["observations"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |o| (id.clone(), o["source_call_id"].to_string()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// xorshift: a reproducible shuffle without another dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Derive directly (no proxy) from calls in a given order; returns steps as JSON, last version of each.
fn derive_in_order(calls: &[Fixture]) -> Vec<Value> {
    use llmtap::derive::Deriver;
    use llmtap::store::Record;
    let mut d = Deriver::new(llmtap::config::DeriveConfig::default());
    let mut latest: BTreeMap<String, Value> = BTreeMap::new();
    let mut t = 1_700_000_000_000_000i64;
    for f in calls {
        let ex = f.raw_exchange(t, 1000, 2000);
        t += 10_000;
        let p = llmtap::pipeline::process::process(ex, usize::MAX);
        for rec in d.observe(p.trace, p.call) {
            if let Record::Step(s) = rec {
                latest.insert(s.step_id.clone(), serde_json::to_value(&*s).unwrap());
            }
        }
    }
    latest.into_values().collect()
}

#[test]
fn interleaving_unrelated_sessions_changes_no_trajectory() {
    let sessions: Vec<Vec<Fixture>> = [
        "pydantic-ai__openai_chat_stream_agent_3calls",
        "pydantic-ai__anthropic_parallel_tools_agent",
        "pydantic-ai__gemini_tool_loop_5calls",
        "openllmetry__openai_agents_sdk_handoff_hierarchy",
    ]
    .iter()
    .map(|n| session(n))
    .collect();
    let sequential: Vec<Fixture> = sessions.iter().flatten().cloned().collect();
    let baseline = derive_in_order(&sequential);
    let base_keys = step_keys(&baseline);
    let base_obs = observation_pairs(&baseline);
    assert!(base_keys.len() > 20);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for round in 0..40 {
        // A random interleaving that keeps each session's own order.
        let mut cursors = vec![0usize; sessions.len()];
        let mut order = Vec::new();
        while order.len() < sequential.len() {
            let live: Vec<usize> = (0..sessions.len())
                .filter(|i| cursors[*i] < sessions[*i].len())
                .collect();
            let pick = live[(rng.next() % live.len() as u64) as usize];
            order.push(sessions[pick][cursors[pick]].clone());
            cursors[pick] += 1;
        }
        let steps = derive_in_order(&order);
        assert_eq!(step_keys(&steps), base_keys, "round {round}");
        let obs = observation_pairs(&steps);
        assert_eq!(obs, base_obs, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_llmtap_processes_agree_on_trajectory_ids_and_step_indexes() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let names = [
        "pydantic-ai__gemini_tool_loop_5calls",
        "openllmetry__openai_agents_sdk_handoff_hierarchy",
        "pydantic-ai__anthropic_parallel_tools_agent",
    ];
    let calls: Vec<Fixture> = names.iter().flat_map(|n| session(n)).collect();
    let (da, db, dc) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let a = Llmtap::start(&upstream_config(&up, ""), da.path());
    let b = Llmtap::start(&upstream_config(&up, ""), db.path());
    replay_into(&a, &calls).await;
    replay_into(&b, &calls).await;
    a.wait_for_traces(calls.len());
    b.wait_for_traces(calls.len());
    let (sa, sb) = (a.export("steps", &[]), b.export("steps", &[]));
    assert_eq!(step_keys(&sa), step_keys(&sb));

    // Replicas behind a load balancer: alternate calls between two processes. Ids and indexes still agree.
    let c1 = Llmtap::start(&upstream_config(&up, ""), dc.path());
    let dd = tempfile::tempdir().unwrap();
    let c2 = Llmtap::start(&upstream_config(&up, ""), dd.path());
    let client = client();
    let mut per: HashMap<usize, usize> = HashMap::new();
    for (i, f) in calls.iter().enumerate() {
        let tap = if i % 2 == 0 { &c1 } else { &c2 };
        *per.entry(i % 2).or_default() += 1;
        assert_eq!(send_fixture(&client, tap, f, &[]).await.status, f.status);
    }
    c1.wait_for_traces(per[&0]);
    c2.wait_for_traces(per[&1]);
    let mut split = c1.export("steps", &[]);
    split.extend(c2.export("steps", &[]));
    let split_keys = step_keys(&split);
    let full = step_keys(&sa);
    // Sub-agent roots need the parent's call seen by the same replica (documented); ids of every step that
    // either replica produced are ones the single process produced too.
    assert!(
        split_keys.is_subset(&full),
        "{:?}",
        split_keys.difference(&full).collect::<Vec<_>>()
    );
    let agent_split: BTreeSet<_> = split_keys.iter().filter(|k| k.2 == "agent").collect();
    let agent_full: BTreeSet<_> = full.iter().filter(|k| k.2 == "agent").collect();
    assert_eq!(agent_split, agent_full);
}

#[test]
fn expected_links_are_not_vacuous() {
    for (name, min) in [
        ("pydantic-ai__openai_chat_stream_agent_3calls", 3),
        ("pydantic-ai__anthropic_parallel_tools_agent", 4),
        ("openllmetry__openai_agents_sdk_handoff_hierarchy", 5),
        ("pydantic-ai__two_agents_interleaved", 3),
    ] {
        let links = expected_links(&session(name));
        assert!(links.len() >= min, "{name}: {links:?}");
    }
}

/// A recorded Anthropic JSON answer that is text only: the upstream replays it for any request body.
fn anthropic_text_answer() -> (Fixture, String) {
    all_fixtures()
        .into_iter()
        .filter(|f| f.upstream == "anthropic" && f.status == 200 && f.kind == BodyKind::Json)
        .find_map(|f| {
            let content = f.response_json.as_ref()?["content"].as_array()?.clone();
            let texts: Vec<&str> = content
                .iter()
                .map(|b| (b["type"] == "text").then(|| b["text"].as_str()).flatten())
                .collect::<Option<Vec<_>>>()?;
            let text = texts.concat();
            (!text.is_empty()).then_some((f, text))
        })
        .expect("a text-only Anthropic recording")
}

/// Claude Code sessions through the binary: the session header and `metadata.user_id` group trajectories, a
/// resumed conversation with another system prompt continues its trajectory, a second run of the same prompt
/// is another trajectory, a title call is folded into its session, and the session header stays redacted in
/// the stored headers while the trace carries the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_sessions_group_resume_and_keep_runs_apart() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let (f, answer) = anthropic_text_answer();
    let client = client();
    let tools = serde_json::json!([{"name": "Bash", "input_schema": {"type": "object"}}]);
    let body = |system: &str, messages: Value, metadata: Option<&str>| {
        let mut b = serde_json::json!({"model": "claude-x", "max_tokens": 256, "system": system, "messages": messages, "tools": tools});
        if let Some(user_id) = metadata {
            b["metadata"] = serde_json::json!({ "user_id": user_id });
        }
        serde_json::to_vec(&b).unwrap()
    };
    let first = serde_json::json!([{"role": "user", "content": "list the files"}]);
    let resumed = serde_json::json!([
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": answer},
        {"role": "system", "content": "Available skills: none"},
        {"role": "user", "content": "and count them"}
    ]);
    let post = |session: Option<&'static str>, body: Vec<u8>| {
        let mut headers = vec![
            ("content-type", "application/json"),
            ("x-replay-fixture", f.name.as_str()),
        ];
        if let Some(s) = session {
            headers.push(("x-claude-code-session-id", s));
        }
        let url = tap.url(&f.client_path);
        let client = client.clone();
        async move { send(&client, "POST", &url, &headers, body).await }
    };
    for (session, b) in [
        (Some("sess-a"), body("cwd /r, model a", first.clone(), None)),
        (Some("sess-a"), body("cwd /r, model b", resumed.clone(), None)),
        (Some("sess-b"), body("cwd /r, model a", first.clone(), None)),
        (
            None,
            body(
                "cwd /r, model a",
                first.clone(),
                Some(r#"{"device_id":"d","session_id":"sess-c"}"#),
            ),
        ),
        (
            None,
            body(
                "cwd /r, model a",
                first.clone(),
                Some("user_0f_account__session_sess-d"),
            ),
        ),
    ] {
        assert_eq!(post(session, b).await.status, 200);
    }
    let mut title =
        serde_json::from_slice::<Value>(&body("Write a 5-10 word title for the conversation.", first, None)).unwrap();
    title.as_object_mut().unwrap().remove("tools");
    assert_eq!(
        post(Some("sess-a"), serde_json::to_vec(&title).unwrap()).await.status,
        200
    );
    let traces = tap.wait_for_traces(6);

    let groups = tap.session_groups();
    let by_id: BTreeMap<&str, &Value> = groups.iter().map(|g| (g["session_id"].as_str().unwrap(), g)).collect();
    assert_eq!(
        by_id.keys().copied().collect::<Vec<_>>(),
        ["sess-a", "sess-b", "sess-c", "sess-d"]
    );
    let a = by_id["sess-a"]["trajectories"].as_array().unwrap();
    let main: Vec<&Value> = a.iter().filter(|t| t["purpose"] == "main").collect();
    assert_eq!(main.len(), 1, "{a:#?}");
    assert_eq!(
        (main[0]["llm_calls"].as_u64(), main[0]["steps"].as_u64()),
        (Some(2), Some(4))
    );
    assert!(a.iter().any(|t| t["purpose"] == "title"), "{a:#?}");
    let b = &by_id["sess-b"]["trajectories"][0];
    assert_ne!(
        b["trajectory_id"], main[0]["trajectory_id"],
        "another run is another trajectory"
    );

    // System context in the history is no user step: the resumed call adds user step 2 only.
    let steps = tap.export("steps", &[]);
    let user_indexes: Vec<u64> = steps
        .iter()
        .filter(|s| s["trajectory_id"] == main[0]["trajectory_id"] && s["role"] == "user")
        .map(|s| s["step_index"].as_u64().unwrap())
        .collect();
    assert_eq!(user_indexes, [0, 2]);

    // The typed session id is kept; the header value in the stored header list is not.
    assert_eq!(traces[0]["session_id"], "sess-a");
    let stored = traces[0]["headers"]["request"].to_string();
    assert!(!stored.contains("sess-a"), "{stored}");

    let table = tap.cli(&["sessions"]);
    assert!(table.contains("session sess-a"), "{table}");
    assert!(table.contains("+ 1 side/title/warmup/quota trajectories"), "{table}");
    assert!(tap.cli(&["sessions", "--all"]).contains("title"));
}

/// Naming the session (`x-llmtap-session`) groups a run; it must not change how the run splits into trajectories
/// or how they link: every recorded session gives the same number of trajectories, the same parent links and
/// the same step counts with and without the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_changes_no_trajectory_or_link() {
    for name in session_names() {
        let shape = |tap: &Llmtap| -> Vec<(usize, bool, String)> {
            let mut out: Vec<(usize, bool, String)> = tap
                .export("steps", &[])
                .iter()
                .fold(BTreeMap::<String, (usize, bool, String)>::new(), |mut m, s| {
                    let e = m.entry(s["trajectory_id"].as_str().unwrap().to_owned()).or_default();
                    e.0 += 1;
                    e.1 |= !s["parent_step"].is_null() || s["call_type"] == "subagent";
                    e.2 = s["call_type"].as_str().unwrap_or("").to_owned();
                    m
                })
                .into_values()
                .collect();
            out.sort();
            out
        };
        let mut shapes = Vec::new();
        for header in [None, Some("s-1")] {
            let up = Upstream::start(ReplayOptions::default()).await;
            let dir = tempfile::tempdir().unwrap();
            let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
            let client = client();
            let calls = session(&name);
            for f in &calls {
                let extra: Vec<(&str, &str)> = header.iter().map(|h| ("x-llmtap-session", *h)).collect();
                send_fixture(&client, &tap, f, &extra).await;
            }
            tap.wait_for_traces(calls.len());
            tap.wait_settled();
            shapes.push(shape(&tap));
        }
        assert_eq!(
            shapes[0], shapes[1],
            "{name}: trajectories (steps, linked, call type) without vs with a session header"
        );
    }
}
