//! Trajectory formats for every recorded agent session, through the real binary: each validates against its
//! schema in ../shared/spec/schemas (a Rust JSON-schema validator), round-trips the key facts (steps, tool call
//! ↔ observation pairs, token totals, sub-agent links), and ATIF passes its own semantic rules.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use serde_json::Value;

fn schema(path: &str) -> jsonschema::Validator {
    let file = fixtures_root().join("../spec/schemas").join(path);
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    jsonschema::validator_for(&s).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn assert_valid(v: &jsonschema::Validator, doc: &Value, what: &str) {
    let errors: Vec<String> = v
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{what}: {errors:#?}");
}

/// ATIF's own rules (the reference Pydantic validators), checked on a trajectory and its embedded sub-agents.
fn atif_rules(t: &Value, seen_ids: &mut HashSet<String>) {
    let steps = t["steps"].as_array().unwrap();
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(
            s["step_id"].as_u64().unwrap(),
            i as u64 + 1,
            "step ids sequential from 1"
        );
        let source = s["source"].as_str().unwrap();
        if source != "agent" {
            for f in [
                "model_name",
                "reasoning_effort",
                "reasoning_content",
                "tool_calls",
                "metrics",
                "llm_call_count",
            ] {
                assert!(s.get(f).is_none(), "agent-only field {f} on a {source} step");
            }
        }
        let ids: Vec<&str> = s["tool_calls"]
            .as_array()
            .map(|a| a.iter().map(|c| c["tool_call_id"].as_str().unwrap()).collect())
            .unwrap_or_default();
        assert_eq!(
            ids.len(),
            ids.iter().collect::<HashSet<_>>().len(),
            "tool_call_id unique within a step"
        );
        for r in s["observation"]["results"].as_array().into_iter().flatten() {
            if let Some(src) = r["source_call_id"].as_str() {
                assert!(
                    ids.contains(&src),
                    "observation {src} refers to a tool call of the same step"
                );
            }
        }
    }
    let embedded: Vec<&Value> = t["subagent_trajectories"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let embedded_ids: HashSet<&str> = embedded.iter().map(|c| c["trajectory_id"].as_str().unwrap()).collect();
    for s in steps {
        for r in s["observation"]["results"].as_array().into_iter().flatten() {
            for rf in r["subagent_trajectory_ref"].as_array().into_iter().flatten() {
                assert!(
                    embedded_ids.contains(rf["trajectory_id"].as_str().unwrap()),
                    "ref resolves to an embedded sub-agent"
                );
            }
        }
    }
    for c in embedded {
        assert!(
            seen_ids.insert(c["trajectory_id"].as_str().unwrap().to_owned()),
            "embedded trajectory ids unique"
        );
        atif_rules(c, seen_ids);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_exports_valid_opentraces_and_atif() {
    let opentraces = schema("opentraces/opentraces-0.2.0.trace-record.schema.json");
    let atif = schema("atif/atif-v1.8.derived.schema.json");
    for name in session_names() {
        let up = Upstream::start(ReplayOptions::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
        let calls = session(&name);
        let client = client();
        for f in &calls {
            assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
        }
        tap.wait_for_traces(calls.len());
        let steps = tap.export("steps", &[]);
        let sessions: Vec<Value> = tap.sessions_json();

        // opentraces: one valid record per trajectory, facts preserved.
        let records = tap.export("opentraces", &[]);
        assert_eq!(records.len(), sessions.len(), "{name}");
        for r in &records {
            assert_valid(&opentraces, r, &format!("{name} opentraces"));
            let traj = r["session_id"].as_str().unwrap();
            let mine: Vec<&Value> = steps.iter().filter(|s| s["trajectory_id"] == traj).collect();
            assert_eq!(r["steps"].as_array().unwrap().len(), mine.len(), "{name}: step count");
            let pairs = |list: &Vec<&Value>| -> HashSet<(String, String)> {
                list.iter()
                    .flat_map(|s| {
                        s["observations"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|o| (s["step_index"].to_string(), o["source_call_id"].to_string()))
                    })
                    .collect()
            };
            let rsteps: Vec<&Value> = r["steps"].as_array().unwrap().iter().collect();
            assert_eq!(pairs(&rsteps), pairs(&mine), "{name}: observation pairs");
            let summary = sessions.iter().find(|s| s["trajectory_id"] == traj).unwrap();
            assert_eq!(r["metrics"]["total_input_tokens"], summary["input_tokens"]);
            let step_input: u64 = rsteps
                .iter()
                .map(|s| s["token_usage"]["input_tokens"].as_u64().unwrap_or(0))
                .sum();
            assert_eq!(
                step_input,
                summary["input_tokens"].as_u64().unwrap(),
                "{name}: per-step tokens add up"
            );
            for s in &rsteps {
                if let Some(h) = s["system_prompt_hash"].as_str() {
                    assert!(r["system_prompts"][h].is_string(), "{name}: system_prompts has {h}");
                }
            }
        }

        // ATIF: top-level trajectories valid, sub-agents embedded and referenced.
        let trajectories = tap.export("atif", &[]);
        let parents: HashMap<&str, &str> = sessions
            .iter()
            .filter_map(|s| Some((s["trajectory_id"].as_str()?, s["parent_trajectory_id"].as_str()?)))
            .collect();
        assert_eq!(
            trajectories.len(),
            sessions.len() - parents.len(),
            "{name}: sub-agents are embedded"
        );
        let mut seen = HashSet::new();
        let mut embedded = 0;
        for t in &trajectories {
            assert_valid(&atif, t, &format!("{name} atif"));
            atif_rules(t, &mut seen);
            embedded += t["subagent_trajectories"].as_array().map_or(0, |a| a.len());
            let agent_steps = t["steps"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["source"] == "agent")
                .count();
            let traj = t["trajectory_id"].as_str().unwrap();
            assert_eq!(
                agent_steps,
                steps
                    .iter()
                    .filter(|s| s["trajectory_id"] == traj && s["role"] == "agent")
                    .count()
            );
            let prompt: u64 = t["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["metrics"]["prompt_tokens"].as_u64().unwrap_or(0))
                .sum();
            assert_eq!(
                prompt,
                t["final_metrics"]["total_prompt_tokens"].as_u64().unwrap(),
                "{name}: token totals"
            );
        }
        assert_eq!(embedded, parents.len(), "{name}: every sub-agent embedded once");

        // Invariant: one valid trace per trajectory; every tool event answers a call of an earlier event.
        let invariant = schema("invariant/invariant-trace.derived.schema.json");
        let traces = tap.export("invariant", &[]);
        assert_eq!(traces.len(), sessions.len(), "{name}");
        for t in &traces {
            assert_valid(&invariant, t, &format!("{name} invariant"));
            let events = t.as_array().unwrap();
            assert!(events[0]["metadata"]["usage"]["input_tokens"].is_u64());
            let mut called = HashSet::new();
            for e in &events[1..] {
                for c in e["tool_calls"].as_array().into_iter().flatten() {
                    assert!(c["function"]["arguments"].is_object(), "arguments go out as objects");
                    called.insert(c["id"].as_str().unwrap().to_owned());
                }
                if e["role"] == "tool" {
                    assert!(
                        called.contains(e["tool_call_id"].as_str().unwrap()),
                        "{name}: tool result follows its call"
                    );
                }
            }
            let traj = events[0]["metadata"]["trajectory_id"].as_str().unwrap();
            let obs: usize = steps
                .iter()
                .filter(|s| s["trajectory_id"] == traj)
                .map(|s| s["observations"].as_array().unwrap().len())
                .sum();
            assert_eq!(
                events.iter().filter(|e| e["role"] == "tool").count(),
                obs,
                "{name}: tool events"
            );
        }
    }
}
