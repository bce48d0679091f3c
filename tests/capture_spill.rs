//! The capture spill through the real binary: with a pipeline handoff of four exchanges, a burst far above
//! what the pipeline takes goes to `<data_dir>/spill/` and is processed later, in order, instead of being
//! dropped; without the spill the same burst drops; the spill outlives a stop and a kill -9; a torn spill is
//! skipped with one error.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const SESSION: &str = "pydantic-ai__openai_chat_stream_agent_3calls";

/// One burst at a time in this binary. A burst fills the spill only because it saturates the machine: the
/// pipeline then waits for the data path (`background::deferral`). Two tests bursting at once (the test harness
/// runs them in parallel) each see their own proxy take only part of the machine, so neither pipeline waits,
/// and a test that needs a backlog in the spill got none (a full `cargo test` run failed that way once).
static BURSTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `n` requests at once (one client each), all answered 200.
async fn burst(tap: &Llmtap, f: &Fixture, n: usize) {
    let _alone = BURSTS.lock().await;
    let url = tap.url(&f.client_path);
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (url, f) = (url.clone(), f.clone());
            tokio::spawn(async move {
                let headers = [
                    ("content-type", "application/json"),
                    ("x-replay-fixture", f.name.as_str()),
                ];
                send(&client(), "POST", &url, &headers, f.request.clone()).await.status
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
}

/// Wait (at most three minutes) until nothing waits in memory or in the spill, every exchange taken is
/// processed, and the store has committed one trace per processed exchange on top of the `before` it held
/// when this llmtap started (so the wait holds on a starved machine, where the store may commit seconds after
/// the pipeline processed). Records read back from the spill are not counted anywhere between the moment the
/// spill hands them to the pipeline and the moment they are processed, so the state must also hold still for
/// three polls in a row (a handful of exchanges in the pipeline's hands take milliseconds, not 400 ms).
fn wait_drained(tap: &Llmtap, dir: &Path, before: i64) {
    let deadline = Instant::now() + Duration::from_secs(180);
    // Consecutive drained-looking polls, and the processed count they saw.
    let (mut still, mut seen) = (0, None);
    loop {
        let m = tap.metrics();
        let get = |name: &str| {
            m.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<u64>().ok()))
                .unwrap_or(0)
        };
        let processed = get("llmtap_processed_total ");
        // Processed may exceed captured: a restart processes what an earlier run captured.
        let idle = get("llmtap_capture_spill_bytes ") == 0
            && get("llmtap_capture_queue_bytes ") == 0
            && processed + get("llmtap_capture_dropped_total ") >= get("llmtap_captured_total ");
        let committed = traces_in_db(dir);
        if idle && committed == before + processed as i64 {
            still = if seen == Some(processed) { still + 1 } else { 1 };
            seen = Some(processed);
            if still >= 3 {
                return;
            }
        } else {
            (still, seen) = (0, None);
        }
        assert!(
            Instant::now() < deadline,
            "capture did not drain: {committed} traces committed, {before} before + {processed} processed\n{m}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn traces_in_db(dir: &Path) -> i64 {
    open_store_db(dir)
        .query_row("SELECT COUNT(*) FROM traces", [], |r| r.get(0))
        .unwrap()
}

fn spill_files(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("spill")).map_or(0, |d| d.count())
}

/// (a) A burst of 300 concurrent requests against a four-exchange handoff: every exchange is stored, none
/// dropped, the spill was used; a three-call tool-using agent run sent inside the burst derives as it does
/// alone (one trajectory, agent steps 1, 2, 3, every tool call linked to its result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_pipeline_is_spilled_and_all_stored_in_order() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, "[capture]\nqueue_capacity = 4\n"), dir.path());
    let f = json_calls(1).remove(0);
    let agent = session(SESSION);
    let client = client();
    for call in &agent {
        // Each agent call while a burst is under way, so that it passes through the spill.
        let traffic = burst(&tap, &f, 100);
        let reply = send_fixture(&client, &tap, call, &[("x-llmtap-session", "spill-agent")]);
        let ((), reply) = tokio::join!(traffic, reply);
        assert_eq!(reply.status, call.status, "{}", call.name);
    }
    let n = 300 + agent.len();
    wait_drained(&tap, dir.path(), 0);
    assert_eq!(tap.metric("llmtap_capture_dropped_total"), 0);
    assert!(tap.metric("llmtap_capture_spilled_total") > 0, "the burst was spilled");
    assert_eq!(tap.metric("llmtap_capture_spill_errors_total"), 0);
    let traces = tap.export("provider-traces", &[]);
    assert_eq!(traces.len(), n);
    assert_eq!(spill_files(dir.path()), 0, "consumed segments deleted");

    let steps: Vec<Value> = tap
        .export("steps", &[])
        .into_iter()
        .filter(|s| s["session_id"] == "spill-agent" && s["role"] == "agent")
        .collect();
    let trajectories: BTreeSet<&str> = steps.iter().map(|s| s["trajectory_id"].as_str().unwrap()).collect();
    assert_eq!(trajectories.len(), 1, "{trajectories:?}");
    let indexes: Vec<u64> = steps.iter().map(|s| s["step_index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, [1, 2, 3]);
    // Every tool call of a step but the last is answered by an observation of a later step.
    let called: BTreeSet<String> = steps[..steps.len() - 1]
        .iter()
        .flat_map(|s| s["tool_calls"].as_array().cloned().unwrap_or_default())
        .inspect(|c| assert!(c["duration_ms"].is_u64(), "tool duration from the next call: {c}"))
        .map(|c| c["tool_call_id"].as_str().unwrap().to_owned())
        .collect();
    let observed: BTreeSet<String> = steps
        .iter()
        .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
        .filter(|o| o["error"].is_null())
        .map(|o| o["source_call_id"].as_str().unwrap().to_owned())
        .collect();
    assert!(!called.is_empty());
    assert_eq!(observed, called);
}

/// (b) The same burst with `spill_bytes = 0`: a full queue drops, as without a spill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_spill_the_burst_drops() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "[capture]\nqueue_capacity = 4\nspill_bytes = 0\n");
    let tap = Llmtap::start(&config, dir.path());
    let f = json_calls(1).remove(0);
    burst(&tap, &f, 300).await;
    wait_drained(&tap, dir.path(), 0);
    let dropped = tap.metric("llmtap_capture_dropped_total");
    assert!(dropped > 0, "a four-exchange queue took a 300-request burst");
    assert_eq!(tap.metric("llmtap_capture_spilled_total"), 0);
    assert_eq!(tap.export("provider-traces", &[]).len() as u64, 300 - dropped);
    assert!(!dir.path().join("spill").exists());
}

/// Bursts until, once every exchange has left memory for the handoff or the spill
/// (`llmtap_capture_queue_bytes` = 0: nothing in flight or in the intake queue), records wait in the spill;
/// returns the requests answered.
async fn fill_the_spill(tap: &Llmtap, f: &Fixture) -> usize {
    let mut answered = 0;
    for _ in 0..10 {
        burst(tap, f, 500).await;
        answered += 500;
        let deadline = Instant::now() + Duration::from_secs(30);
        while tap.metric("llmtap_capture_queue_bytes") > 0 {
            assert!(Instant::now() < deadline, "the intake queue did not empty");
            std::thread::sleep(Duration::from_millis(20));
        }
        if tap.metric("llmtap_capture_spill_bytes") > 0 {
            return answered;
        }
    }
    panic!("the pipeline kept up with every burst: nothing waited in the spill");
}

/// llmtap with a four-exchange pipeline handoff, its spill holding a backlog.
struct Backlog {
    _up: Upstream,
    dir: tempfile::TempDir,
    config: String,
    tap: Llmtap,
    /// Requests the clients got an answer for.
    answered: usize,
}

impl Backlog {
    async fn fill() -> Backlog {
        let up = Upstream::start(ReplayOptions::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let config = upstream_config(&up, "[capture]\nqueue_capacity = 4\n");
        let tap = Llmtap::start(&config, dir.path());
        let f = json_calls(1).remove(0);
        let answered = fill_the_spill(&tap, &f).await;
        Backlog {
            _up: up,
            dir,
            config,
            tap,
            answered,
        }
    }

    /// Stop llmtap with `stop` (the backlog must be on disk then) and start it again on the same data
    /// directory: the new llmtap, and the traces the store held in between.
    fn restart_after(mut self, stop: impl FnOnce(&mut Llmtap)) -> Restarted {
        stop(&mut self.tap);
        assert!(spill_files(self.dir.path()) > 0, "the backlog is on disk");
        let before = traces_in_db(self.dir.path());
        let tap = Llmtap::start(&self.config, self.dir.path());
        Restarted {
            _up: self._up,
            dir: self.dir,
            tap,
            answered: self.answered,
            before,
        }
    }
}

/// llmtap started again on a [`Backlog`]'s data directory.
struct Restarted {
    _up: Upstream,
    dir: tempfile::TempDir,
    tap: Llmtap,
    answered: usize,
    /// Traces in the store when it started.
    before: i64,
}

/// (c) Stopped (SIGTERM) while the spill holds a backlog: stopping does not wait for the backlog, and the
/// next start stores every exchange the clients got an answer for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_left_at_stop_is_stored_after_the_restart() {
    let Restarted {
        _up,
        dir,
        tap,
        answered,
        before,
    } = Backlog::fill()
        .await
        .restart_after(|tap| assert!(tap.terminate().success()));
    wait_drained(&tap, dir.path(), before);
    assert!(
        tap.metric("llmtap_processed_total") > 0,
        "the backlog was processed after the restart"
    );
    assert_eq!(tap.export("provider-traces", &[]).len(), answered);
    assert_eq!(tap.metric("llmtap_capture_spill_errors_total"), 0);
    assert_eq!(spill_files(dir.path()), 0);
}

/// (c) kill -9 while the spill holds a backlog: after a restart on the same data directory the backlog is
/// stored, nothing twice (the store then holds exactly what was committed before the kill plus what the
/// second run processed), and at most what was in memory between the spill and the store is lost: the
/// four-exchange handoff, the pipeline's pass (64) and the store's uncommitted batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_keeps_the_spilled_backlog() {
    let Restarted {
        _up,
        dir,
        tap,
        answered,
        before: committed,
    } = Backlog::fill().await.restart_after(Llmtap::kill9);
    wait_drained(&tap, dir.path(), committed);
    let recovered = tap.metric("llmtap_processed_total") as i64;
    assert!(recovered > 0, "the backlog was processed after the restart");
    let stored = tap.export("provider-traces", &[]).len() as i64;
    assert_eq!(
        stored,
        committed + recovered,
        "an exchange processed twice, or one lost after recovery"
    );
    let lost = answered as i64 - stored;
    eprintln!("answered {answered}, committed before the kill {committed}, recovered {recovered}, lost {lost}");
    assert!((0..=4 + 2 * 64).contains(&lost), "{lost} of {answered} lost to kill -9");
    assert_eq!(spill_files(dir.path()), 0);
}

/// (d) A spill whose last record was cut short (kill -9 in the middle of a write) and a damaged segment: the
/// whole records are stored, the damage is counted and logged once, llmtap runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_spill_is_skipped_with_one_error() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let spill = dir.path().join("spill");
    let f = json_calls(1).remove(0);
    {
        let mut segments = llmtap::capture::spill::Segments::open(&spill).unwrap();
        let start = llmtap::capture::now_micros() - 60_000_000;
        for i in 0..3 {
            segments
                .append(&f.raw_exchange(start + i * 1_000_000, 1_000, 2_000), u64::MAX)
                .unwrap();
        }
    }
    let segment = std::fs::read_dir(&spill).unwrap().next().unwrap().unwrap().path();
    let len = std::fs::metadata(&segment).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap()
        .set_len(len - 7)
        .unwrap();
    std::fs::write(spill.join(format!("{:020}.seg", 99)), b"LLMTSPL1 then noise").unwrap();

    let (tap, log) = Llmtap::start_capturing_log(&upstream_config(&up, ""), dir.path());
    tap.wait_for_traces(2);
    wait_drained(&tap, dir.path(), 0);
    assert_eq!(
        tap.export("provider-traces", &[]).len(),
        2,
        "the records before the torn one"
    );
    assert_eq!(tap.metric("llmtap_capture_spill_errors_total"), 2);
    let logged = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("Capture spill error"))
        .count();
    assert_eq!(logged, 1, "logged once, then counted");
    assert_eq!(spill_files(dir.path()), 0);
    // Still capturing.
    assert_eq!(send_fixture(&client(), &tap, &f, &[]).await.status, 200);
    assert_eq!(tap.wait_for_traces(3).len(), 3);
}

/// (e) Issue 36 item 4: a credential member of a request body never reaches `<data_dir>/spill/`. The pipeline
/// is held back (a four-exchange handoff under bursts of 500) so that exchanges wait in the spill; the raw
/// segment files are searched for the secret while the backlog is there and after the stop that leaves it on
/// disk. After a restart the backlog is stored, with the member redacted and the rest of the body intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_in_a_request_body_never_reaches_the_spill_files() {
    const SECRET: &str = "sk-spilled-body-secret-7f3a9c";
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(&up, "[capture]\nqueue_capacity = 4\n");
    let mut tap = Llmtap::start(&config, dir.path());
    let mut f = json_calls(1).remove(0);
    let mut body: Value = serde_json::from_slice(&f.request).unwrap();
    body["api_key"] = Value::String(SECRET.into());
    f.request = serde_json::to_vec(&body).unwrap();
    let answered = fill_the_spill(&tap, &f).await;

    let spilled = || -> Vec<u8> {
        let mut bytes = Vec::new();
        for entry in std::fs::read_dir(dir.path().join("spill")).unwrap() {
            // A segment handed out and deleted between the listing and the read is no longer on disk.
            bytes.extend(std::fs::read(entry.unwrap().path()).unwrap_or_default());
        }
        bytes
    };
    let has = |hay: &[u8], needle: &str| hay.windows(needle.len()).any(|w| w == needle.as_bytes());
    let running = spilled();
    assert!(has(&running, "\"api_key\":\"REDACTED\""), "spilled records are on disk");
    assert!(!has(&running, SECRET), "the secret is in a spill segment");
    assert!(tap.terminate().success());
    let left = spilled();
    assert!(
        has(&left, "\"api_key\":\"REDACTED\""),
        "the backlog stays on disk at stop"
    );
    assert!(!has(&left, SECRET), "the secret is in a spill segment left at stop");

    let before = traces_in_db(dir.path());
    let tap = Llmtap::start(&config, dir.path());
    wait_drained(&tap, dir.path(), before);
    let traces = tap.export("provider-traces", &[]);
    assert_eq!(traces.len(), answered);
    for t in &traces {
        assert_eq!(t["request"]["api_key"], "REDACTED");
        assert_eq!(t["request"]["messages"], body["messages"]);
    }
}
