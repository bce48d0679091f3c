//! The derived steps and trajectories of every recorded agent session, compared with reviewed files
//! (tests/golden/derived; `LLMTAP_BLESS=1` rewrites them). Derivation runs in-process on the pipeline's own
//! `process` (no proxy, no binary), calls one second apart, and every trajectory is closed at the end so calls
//! that never got a result show as `no_result`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;

use common::*;
use llmtap::derive::Deriver;
use llmtap::store::Record;
use serde_json::{Value, json};

const T0: i64 = 1_700_000_000_000_000;

/// The last version of every step (in order of first emission) and of every trajectory summary.
fn derive_session(calls: &[Fixture]) -> Value {
    let mut d = Deriver::new(llmtap::config::DeriveConfig::default());
    // Priced as the pipeline prices them, so the files show each step's and trajectory's cost for review.
    let prices = llmtap::cost::CostTable::embedded().unwrap();
    let metrics = llmtap::telemetry::Metrics::default();
    let mut steps: Vec<(String, Value)> = Vec::new();
    let mut trajectories: Vec<(String, Value)> = Vec::new();
    // Exchange ids carry random bits: number them in call order instead.
    let mut trace_ids: HashMap<String, String> = HashMap::new();
    let mut keep = |records: Vec<Record>, trace_ids: &mut HashMap<String, String>| {
        for r in records {
            let (list, key, value) = match r {
                Record::Trace(t) => {
                    let n = trace_ids.len();
                    trace_ids.insert(t.id.clone(), format!("<trace-{n}>"));
                    continue;
                }
                Record::Step(s) => (&mut steps, s.step_id.clone(), serde_json::to_value(&*s).unwrap()),
                Record::Trajectory(t) => (
                    &mut trajectories,
                    t.trajectory_id.clone(),
                    serde_json::to_value(t.without_heavy_parts()).unwrap(),
                ),
            };
            match list.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = value,
                None => list.push((key, value)),
            }
        }
    };
    for (i, f) in calls.iter().enumerate() {
        let ex = f.raw_exchange(T0 + i as i64 * 1_000_000, 200_000, 500_000);
        let mut p = llmtap::pipeline::process::process(ex, usize::MAX);
        llmtap::pipeline::pricing::price(&prices, &mut p.trace, p.call.as_ref(), &metrics);
        keep(d.observe(p.trace, p.call), &mut trace_ids);
    }
    keep(d.close_all(), &mut trace_ids);
    let mut steps: Vec<Value> = steps.into_iter().map(|(_, v)| v).collect();
    for s in &mut steps {
        if let Some(id) = s["provider_trace_id"].as_str() {
            s["provider_trace_id"] = Value::String(trace_ids[id].clone());
        }
    }
    json!({
        "trajectories": trajectories.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        "steps": steps,
    })
}

#[test]
fn every_recorded_session_derives_its_reviewed_steps() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/derived");
    let bless = std::env::var_os("LLMTAP_BLESS").is_some();
    let names = session_names();
    assert!(names.len() >= 7, "{names:?}");
    let mut differ = Vec::new();
    for name in &names {
        let got = derive_session(&session(name));
        assert!(!got["steps"].as_array().unwrap().is_empty(), "{name}: no steps");
        let file = dir.join(format!("{name}.json"));
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&file, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        }
        let want: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        if got != want {
            differ.push(file.display().to_string());
        }
    }
    assert!(differ.is_empty(), "derived steps differ from: {differ:#?}");
}

/// Derivation depends only on the calls: two runs over the same session agree byte for byte (no hash-map
/// order, clock or randomness leaks into steps).
#[test]
fn deriving_a_session_twice_gives_the_same_steps() {
    for name in [
        "openinference__google_adk_multi_agent",
        "pydantic-ai__anthropic_parallel_tools_agent",
    ] {
        let calls = session(name);
        assert_eq!(derive_session(&calls), derive_session(&calls), "{name}");
    }
}
