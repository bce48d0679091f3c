//! Annotations and the cost page of the web viewer, through the real binary over the recorded agent sessions:
//! Debian's Chromium (headless, driven by tests/browser/dashboard.mjs through playwright-core) annotates a step,
//! finds it again after a reload and filters the sessions list by its label, and reads the cost page, whose
//! totals must equal what the JSON API reports call by call; the annotation routes' checks (JSON only, bounded,
//! refused from another site); annotations in the exports and across a restart; and the same answers from the
//! shared PostgreSQL store. Screenshots land in target/screenshots/.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use common::browser::{require_browser, run_script};
use common::*;
use rust_decimal::{Decimal, RoundingStrategy};
use serde_json::{Value, json};

/// The recorded session whose step the browser annotates (its session is its trajectory's id).
const SESSION: &str = "pydantic-ai__anthropic_parallel_tools_agent";

async fn get_json(client: &Client, url: &str) -> Value {
    let r = send(client, "GET", url, &[], Vec::new()).await;
    assert_eq!(r.status, 200, "{url}: {}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

/// POST an annotation as the page does; (status, JSON answer or the body as a string).
async fn post(client: &Client, base: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    raw_post(client, base, serde_json::to_vec(body).unwrap(), &all).await
}

async fn raw_post(client: &Client, base: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> (u16, Value) {
    let r = send(client, "POST", &format!("{base}/api/annotations"), headers, body).await;
    let v = serde_json::from_slice(&r.body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&r.body).into()));
    (r.status, v)
}

/// Recorded calls that read from the prompt cache (the agent sessions do not), so that the cost report has
/// cache savings to compute.
const CACHED: [&str; 5] = [
    "anthropic_messages/pydantic-ai__prompt_cache/00",
    "anthropic_messages/pydantic-ai__prompt_cache/01",
    "anthropic_messages/dd-trace-py__stream_cache_read",
    "openai_chat/openllmetry__prompt_caching/01",
    "openai_responses/pydantic-ai__reasoning_with_tool_calls/01",
];

/// The agent the cache-reading calls are sent as.
const CACHE_AGENT: &str = "cache-reader";

/// Replay every recorded agent session (the one the tests annotate first) and the calls that read from the
/// cache; returns the provider traces.
async fn replay_all(tap: &Llmtap) -> Vec<Value> {
    let client = client();
    let mut n = 0;
    let mut names = session_names();
    names.sort_by_key(|n| n != SESSION);
    for name in names {
        for f in session(&name) {
            assert_eq!(send_fixture(&client, tap, &f, &[]).await.status, f.status, "{}", f.name);
            n += 1;
        }
    }
    // Under an agent name of their own: the report's agent groups are then two.
    for name in CACHED {
        let f = fixture(name);
        let agent = [("x-llmtap-agent", CACHE_AGENT)];
        assert_eq!(
            send_fixture(&client, tap, &f, &agent).await.status,
            f.status,
            "{}",
            f.name
        );
        n += 1;
    }
    let traces = tap.wait_for_traces(n);
    assert_eq!(traces.len(), n);
    traces
}

/// The annotated session's trajectory and its first agent step.
fn first_agent_step(tap: &Llmtap, traces: &[Value]) -> (String, String) {
    let trajectory = traces[0]["trajectory_id"].as_str().unwrap().to_owned();
    let step = tap
        .export("steps", &[])
        .into_iter()
        .find(|s| s["trajectory_id"] == trajectory.as_str() && s["role"] == "agent")
        .unwrap();
    (trajectory, step["step_id"].as_str().unwrap().to_owned())
}

fn dec(v: &Value) -> Decimal {
    Decimal::from_str(v.as_str().unwrap_or_else(|| panic!("not a decimal string: {v}"))).unwrap()
}

/// The costs report's totals as the test computes them from the calls one by one (`api/calls/<id>`): counts,
/// tokens, the cost sum and the cache savings (what the cache reads would have cost at the call's uncached input
/// price, its input cost over its uncached input tokens, less what they cost).
#[derive(Debug, Default, PartialEq)]
struct Expected {
    calls: u64,
    priced: u64,
    unpriced: u64,
    input: u64,
    output: u64,
    cache_read: u64,
    cache_write: u64,
    cost: Decimal,
    savings: Decimal,
    calls_with_savings: u64,
}

async fn expected_from_calls(client: &Client, base: &str, traces: &[Value]) -> Expected {
    let mut e = Expected::default();
    for t in traces {
        let c = get_json(client, &format!("{base}/api/calls/{}", t["id"].as_str().unwrap())).await;
        e.calls += 1;
        let Some(u) = c["usage"].as_object() else { continue };
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        let (input, cr, cw) = (n("input"), n("cache_read"), n("cache_write"));
        e.input += input;
        e.output += n("output");
        e.cache_read += cr;
        e.cache_write += cw;
        if c["cost"]["total"].is_string() {
            e.priced += 1;
            e.cost += dec(&c["cost"]["total"]);
            let uncached = input.saturating_sub(cr + cw);
            if cr > 0 && uncached > 0 {
                let would = (Decimal::from(cr) * dec(&c["cost"]["input"]) / Decimal::from(uncached))
                    .round_dp_with_strategy(12, RoundingStrategy::MidpointAwayFromZero);
                e.savings += would - dec(&c["cost"]["cache_read"]);
                e.calls_with_savings += 1;
            }
        } else {
            e.unpriced += 1;
        }
    }
    e
}

/// The report's totals in the same shape.
fn reported(t: &Value) -> Expected {
    let n = |k: &str| t[k].as_u64().unwrap();
    Expected {
        calls: n("calls"),
        priced: n("priced_calls"),
        unpriced: n("unpriced_calls"),
        input: n("input_tokens"),
        output: n("output_tokens"),
        cache_read: n("cache_read_tokens"),
        cache_write: n("cache_write_tokens"),
        cost: t["cost_usd"].as_str().map_or(Decimal::ZERO, |_| dec(&t["cost_usd"])),
        savings: t["cache_savings_usd"]
            .as_str()
            .map_or(Decimal::ZERO, |_| dec(&t["cache_savings_usd"])),
        calls_with_savings: 0,
    }
}

/// The sum of a list of groups' totals, as [`reported`].
fn sum_of(groups: &Value) -> Expected {
    let mut s = Expected::default();
    for g in groups.as_array().unwrap() {
        let r = reported(&g["totals"]);
        s.calls += r.calls;
        s.priced += r.priced;
        s.unpriced += r.unpriced;
        s.input += r.input;
        s.output += r.output;
        s.cache_read += r.cache_read;
        s.cache_write += r.cache_write;
        s.cost += r.cost;
        s.savings += r.savings;
    }
    s
}

/// A range covering every recorded call (they were all made just now): yesterday to tomorrow, UTC.
fn whole_range() -> (String, String) {
    let today = chrono::Utc::now().date_naive();
    let day = |d: chrono::NaiveDate| d.format("%Y-%m-%d").to_string();
    (day(today.pred_opt().unwrap()), day(today.succ_opt().unwrap()))
}

#[tokio::test(flavor = "multi_thread")]
async fn chromium_annotates_a_step_filters_by_its_label_and_the_cost_page_adds_up_the_calls() {
    let chromium = require_browser();
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let traces = replay_all(&tap).await;
    let (trajectory, step) = first_agent_step(&tap, &traces);
    let client = client();
    let session = get_json(&client, &format!("{base}/api/sessions/{trajectory}")).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let label = "needs-review";
    let note = "The <b>second</b> tool call is redundant & costs tokens";
    let (since, until) = whole_range();
    let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");
    let report = run_script(
        &chromium,
        "dashboard.mjs",
        &[
            &format!("{base}/"),
            &shots.display().to_string(),
            &session,
            &trajectory,
            &step,
            label,
            note,
            "-2.5",
            &since,
            &until,
        ],
    );
    assert!(report.get("error").is_none(), "{report:#}");
    assert_eq!(report["console_errors"], json!([]), "{report:#}");

    // The annotation as saved, and after a reload (from the store): its label, score and note, the note's
    // markup shown as text.
    let want = json!([{"label": label, "score": "score -2.5", "note": note, "note_elements": 0}]);
    for when in ["after_save", "after_reload"] {
        let mut shown = report[when].clone();
        shown[0].as_object_mut().unwrap().remove("id");
        assert_eq!(shown, want, "{when}: {report:#}");
    }
    assert_eq!(report["after_save"][0]["id"], report["after_reload"][0]["id"]);
    // The sessions list filtered by the label: exactly the annotated session, its row showing the label.
    assert_eq!(
        report["filtered"],
        json!([{"id": session, "labels": [label]}]),
        "{report:#}"
    );
    assert!(report["filtered_hash"].as_str().unwrap().contains("label=needs-review"));
    // Deleted from the page, gone after a reload.
    assert_eq!(report["after_delete"], json!([]));

    // The cost page: its totals are the calls' costs as the JSON API reports them one by one.
    let expected = expected_from_calls(&client, &base, &traces).await;
    assert!(expected.priced > 0 && expected.cost > Decimal::ZERO, "{expected:?}");
    assert!(
        expected.calls_with_savings >= 3 && expected.savings > Decimal::ZERO,
        "{expected:?}"
    );
    let costs = get_json(&client, &format!("{base}/api/costs?since={since}&until={until}")).await;
    let mut got = reported(&costs["totals"]);
    got.calls_with_savings = expected.calls_with_savings;
    assert_eq!(got, expected, "{costs:#}");
    // Every grouping adds up to the same totals.
    for groups in ["by_day", "by_model", "by_agent"] {
        let mut sum = sum_of(&costs[groups]);
        sum.calls_with_savings = expected.calls_with_savings;
        assert_eq!(sum, expected, "{groups}: {costs:#}");
    }
    // And the spend equals `llmtap sessions --json`.
    let sessions = tap.session_groups();
    let from_sessions: Decimal = sessions
        .iter()
        .filter(|s| s["cost_usd"].is_object())
        .map(|s| dec(&s["cost_usd"]["total"]))
        .sum();
    assert_eq!(from_sessions, expected.cost);
    // The most expensive session first, as `llmtap sessions` prices it.
    let top = sessions
        .iter()
        .filter(|s| s["cost_usd"].is_object())
        .max_by_key(|s| dec(&s["cost_usd"]["total"]))
        .unwrap();
    assert_eq!(costs["top_sessions"][0]["session_id"], top["session_id"]);
    assert_eq!(
        dec(&costs["top_sessions"][0]["totals"]["cost_usd"]),
        dec(&top["cost_usd"]["total"])
    );

    // What the page shows: the total rounded as it rounds, the calls, one spend bar for today (all calls were made
    // now), every model and agent, the top sessions linked to their pages.
    let c = &report["costs"];
    let shown_total = c["total"].as_str().unwrap();
    let digits = shown_total.split('.').nth(1).map_or(0, |d| d.len() as u32);
    let shown = Decimal::from_str(shown_total.trim_start_matches('$')).unwrap();
    assert!(
        (shown - expected.cost).abs() * Decimal::from(10u64.pow(digits)) <= Decimal::new(5, 1)
            || shown.round_sf(3) == expected.cost.round_sf(3),
        "{shown_total} for {}",
        expected.cost
    );
    assert_eq!(c["calls"], expected.calls.to_string());
    let bar_days: BTreeSet<&str> = c["spend_bars"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["day"].as_str().unwrap())
        .collect();
    let api_days: BTreeSet<&str> = costs["by_day"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["day"].as_str().unwrap())
        .collect();
    assert_eq!(bar_days, api_days);
    assert!(c["token_bars"].as_u64().unwrap() >= 2);
    let keys = |groups: &Value, name: &str| -> Vec<String> {
        groups
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g[name].as_str().unwrap_or("").to_owned())
            .collect()
    };
    assert_eq!(c["models"], json!(keys(&costs["by_model"], "model")));
    assert_eq!(c["agents"], json!(keys(&costs["by_agent"], "agent")));
    let cache_agent = costs["by_agent"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["agent"] == CACHE_AGENT)
        .unwrap();
    assert_eq!(cache_agent["totals"]["calls"], CACHED.len());
    assert_eq!(dec(&cache_agent["totals"]["cache_savings_usd"]), expected.savings);
    // The bars are drawn to scale: the spend bar of the busiest day fills the chart's height.
    assert!(c["spend_bar_height"].as_f64().unwrap() > 100.0, "{c:#}");
    let links: Vec<String> = costs["top_sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| format!("#/s/{}", urlencode(s["session_id"].as_str().unwrap())))
        .collect();
    assert_eq!(c["top_links"], json!(links));
    assert_eq!(report["opened_from_costs"], json!(links[0]));
    println!(
        "cost page: {} calls, ${} spent, cache savings ${} over {} calls",
        expected.calls, expected.cost, expected.savings, expected.calls_with_savings
    );
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'!' | b'~' | b'*' | b'\'' | b'(' | b')' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn annotation_writes_are_json_only_bounded_checked_and_refused_from_another_site() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let client = client();
    let f = &session(SESSION)[0];
    assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
    let traces = tap.wait_for_traces(1);
    let (trajectory, step) = first_agent_step(&tap, &traces);
    let good = json!({"target": "step", "id": step, "label": "ok", "score": 1, "note": "fine"});
    let body = serde_json::to_vec(&good).unwrap();

    // Not JSON: a plain form (urlencoded, multipart, text/plain) cannot be an annotation.
    for ct in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
    ] {
        let headers: Vec<(&str, &str)> = ct.map(|c| ("content-type", c)).into_iter().collect();
        assert_eq!(raw_post(&client, &base, body.clone(), &headers).await.0, 415, "{ct:?}");
    }
    // From another site's page: refused before the body is read.
    for headers in [
        &[("sec-fetch-site", "cross-site"), ("origin", "http://evil.example")][..],
        &[("sec-fetch-site", "same-site")],
        &[("origin", "http://evil.example")],
        &[("origin", "null")],
    ] {
        assert_eq!(post(&client, &base, &good, headers).await.0, 403, "{headers:?}");
    }
    // Checked: unknown target or field, empty, an unknown step, a score that is not a finite number, too long.
    let long = "x".repeat(70);
    let huge_note = "n".repeat(20_000);
    for (bad, status) in [
        (json!({"target": "call", "id": step, "note": "n"}), 400),
        (json!({"target": "step", "id": step}), 400),
        (json!({"target": "step", "id": step, "note": "  "}), 400),
        (json!({"target": "step", "id": step, "score": "NaN"}), 400),
        (json!({"target": "step", "id": step, "score": "1"}), 400),
        (json!({"target": "step", "id": step, "label": long}), 400),
        (json!({"target": "step", "id": step, "label": "a\u{7}b"}), 400),
        (
            json!({"target": "step", "id": step, "note": "n", "html": "<script>"}),
            400,
        ),
        (
            json!({"target": "step", "id": format!("{trajectory}/999"), "note": "n"}),
            404,
        ),
        (json!({"target": "trajectory", "id": "tr_nothing", "note": "n"}), 404),
        (json!({"target": "step", "id": step, "note": huge_note}), 413),
    ] {
        let (got, answer) = post(&client, &base, &bad, &[]).await;
        assert_eq!(got, status, "{bad}: {answer}");
    }
    let overflow = format!(r#"{{"target":"step","id":"{step}","score":1e999}}"#);
    let (got, _) = raw_post(
        &client,
        &base,
        overflow.into_bytes(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(got, 400);
    // Only the annotation routes take writes.
    for (method, path) in [
        ("PUT", "/api/annotations"),
        ("POST", "/api/sessions"),
        ("DELETE", "/api/sessions"),
    ] {
        let r = send(
            &client,
            method,
            &format!("{base}{path}"),
            &[("content-type", "application/json")],
            vec![],
        )
        .await;
        assert_eq!(r.status, 405, "{method} {path}");
    }
    // Nothing refused was stored.
    let steps = get_json(&client, &format!("{base}/api/trajectories/{trajectory}/steps")).await;
    let none: Vec<&Value> = steps["steps"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["annotations"].as_array().unwrap())
        .collect();
    assert!(none.is_empty(), "{none:?}");

    // Accepted from the page (same origin), on the step, its trajectory and its session.
    let own = [("sec-fetch-site", "same-origin"), ("origin", base.as_str())];
    let (status, a) = post(&client, &base, &good, &own).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(
        (a["target"].clone(), a["target_id"].clone()),
        (json!("step"), json!(step))
    );
    let scored =
        json!({"target": "trajectory", "id": trajectory, "score": 0.75, "note": "mostly right", "label": "reviewed"});
    assert_eq!(post(&client, &base, &scored, &own).await.0, 200);
    let on_session = json!({"target": "session", "id": trajectory, "label": "batch-1"});
    let (status, s) = post(&client, &base, &on_session, &[]).await;
    assert_eq!(status, 200);
    let session = s["target_id"].as_str().unwrap().to_owned();

    // Deleting: refused cross-site, then done; a second time there is nothing.
    let id = a["id"].as_str().unwrap();
    let del = |headers: &'static [(&'static str, &'static str)]| {
        let url = format!("{base}/api/annotations/{id}");
        let client = client.clone();
        async move { send(&client, "DELETE", &url, headers, vec![]).await.status }
    };
    assert_eq!(del(&[("sec-fetch-site", "cross-site")]).await, 403);
    assert_eq!(del(&[]).await, 200);
    assert_eq!(del(&[]).await, 404);
    let (status, again) = post(&client, &base, &good, &[]).await;
    assert_eq!(status, 200);

    // A restart keeps them; they show on the session, its list row (and its label filter), the steps.
    assert!(tap.terminate().success());
    drop(tap);
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let page = get_json(&client, &format!("{base}/api/sessions/{session}")).await;
    let mut kinds: Vec<(String, String)> = page["annotations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["target"].as_str().unwrap().into(), a["id"].as_str().unwrap().into()))
        .collect();
    kinds.sort();
    let mut want = vec![
        ("session".to_owned(), s["id"].as_str().unwrap().to_owned()),
        ("step".to_owned(), again["id"].as_str().unwrap().to_owned()),
    ];
    want.push((
        "trajectory".into(),
        kinds.iter().find(|k| k.0 == "trajectory").unwrap().1.clone(),
    ));
    want.sort();
    assert_eq!(kinds, want);
    let steps = get_json(&client, &format!("{base}/api/trajectories/{trajectory}/steps")).await;
    let on_step: Vec<&Value> = steps["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| !x["annotations"].as_array().unwrap().is_empty())
        .collect();
    assert_eq!(on_step.len(), 1);
    assert_eq!(on_step[0]["step_id"], json!(step));
    assert_eq!(on_step[0]["annotations"][0]["note"], "fine");
    for label in ["ok", "reviewed", "batch-1"] {
        let listed = get_json(&client, &format!("{base}/api/sessions?label={label}")).await;
        let ids: Vec<&Value> = listed["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| &s["id"])
            .collect();
        assert_eq!(ids, [&json!(session)], "{label}");
    }
    let none = get_json(&client, &format!("{base}/api/sessions?label=nobody")).await;
    assert_eq!(none["sessions"], json!([]));

    // The exports with a place for them: opentraces (metadata, and the trajectory's score as its outcome) and
    // ATIF (extra).
    let record = tap
        .export("opentraces", &[])
        .into_iter()
        .find(|r| r["metadata"]["trajectory_id"] == trajectory.as_str())
        .unwrap();
    let labels: BTreeSet<&str> = record["metadata"]["annotations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["label"].as_str())
        .collect();
    assert_eq!(labels, BTreeSet::from(["ok", "reviewed", "batch-1"]));
    assert_eq!(
        record["outcome"],
        json!({"signal_source": "human", "signal_confidence": "annotated", "reward": 0.75,
               "reward_source": "human_annotation", "description": "mostly right"})
    );
    let atif = tap
        .export("atif", &[])
        .into_iter()
        .find(|r| r["trajectory_id"] == trajectory.as_str())
        .unwrap();
    assert_eq!(atif["extra"]["annotations"].as_array().unwrap().len(), 3);
}

/// Poll until `done` holds, for at most `secs`.
fn wait_until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An annotation answer without what differs between two stores (its id and time).
fn without_ids(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !["id", "created_at"].contains(&k.as_str()))
                .map(|(k, x)| (k.clone(), without_ids(x)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_ids).collect()),
        other => other.clone(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotations_and_the_cost_report_answer_the_same_from_postgresql() {
    let pg = postgres::server();
    let url = pg.database("dashboard");
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let shared = format!("[store]\nurl = \"{url}\"\n");
    let mut tap = Llmtap::start(&upstream_config(&up, &shared), dir.path());
    let traces = replay_all(&tap).await;
    let (trajectory, step) = first_agent_step(&tap, &traces);
    let count = |sql: &str| -> usize {
        if pg.psql(&url, "SELECT to_regclass('public.traces') IS NOT NULL").trim() != "t" {
            return 0;
        }
        pg.psql(&url, sql).trim().parse().unwrap()
    };
    wait_until("every call in PostgreSQL", 30, || {
        count("SELECT count(*) FROM traces") == traces.len()
    });
    assert!(tap.terminate().success());
    drop(tap);
    // One viewer on the local store, one (with an empty data dir of its own) on the shared one.
    let local = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let remote = Llmtap::start(&upstream_config(&up, &shared), empty.path());
    let client = client();
    let bases = [&local, &remote].map(|t| format!("http://{}", t.viewer_addr.unwrap()));
    let (since, until) = whole_range();
    let costs_url = format!("/api/costs?since={since}&until={until}&tz=90&top=50");
    // Later versions of steps and summaries follow their calls: wait until the reports agree.
    let mut answers = Vec::new();
    for _ in 0..150 {
        answers.clear();
        for base in &bases {
            answers.push(get_json(&client, &format!("{base}{costs_url}")).await);
        }
        if answers[0] == answers[1] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(answers[0], answers[1], "the cost report from PostgreSQL");
    assert_eq!(answers[0]["totals"]["calls"].as_u64().unwrap() as usize, traces.len());
    assert!(answers[0]["top_sessions"].as_array().unwrap().len() >= 2);

    // The same annotations made through each viewer: written to its own store, answered alike.
    let notes = [
        json!({"target": "step", "id": step, "label": "shared-label", "score": 2, "note": "from a viewer"}),
        json!({"target": "trajectory", "id": trajectory, "score": -1}),
        json!({"target": "session", "id": trajectory, "label": "team"}),
    ];
    for base in &bases {
        for n in &notes {
            let (status, a) = post(&client, base, n, &[]).await;
            assert_eq!(status, 200, "{base}: {a}");
        }
    }
    assert_eq!(count("SELECT count(*) FROM annotations"), notes.len());
    // As for the cost report: a trajectory's last version (closed) may reach PostgreSQL a moment after the
    // local store has it, so the views are read until they agree.
    let mut views = Vec::new();
    for _ in 0..150 {
        views.clear();
        for base in &bases {
            let mut v = Vec::new();
            for path in [
                format!("/api/sessions/{trajectory}"),
                format!("/api/trajectories/{trajectory}/steps"),
                "/api/sessions?label=shared-label".into(),
                "/api/sessions?label=team".into(),
            ] {
                v.push(without_ids(&get_json(&client, &format!("{base}{path}")).await));
            }
            views.push(v);
        }
        if views[0] == views[1] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(views[0], views[1]);
    assert_eq!(views[0][2]["sessions"].as_array().unwrap().len(), 1);
    // The shared store's exports carry them too.
    let record = remote
        .export("opentraces", &["--store", url.as_str()])
        .into_iter()
        .find(|r| r["metadata"]["trajectory_id"] == trajectory.as_str())
        .unwrap();
    assert_eq!(record["outcome"]["reward"], json!(-1.0));
}
