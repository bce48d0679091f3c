//! Cost as a user sees it, through the `llmtap` binary: recorded calls replayed through the proxy, their cost read
//! back from `llmtap traces/sessions` (table and --json), the gRPC API, `/metrics` and `llmtap tail` under a
//! pseudo-terminal. Expected amounts are computed by hand from genai-prices' prices (see tests/cost.rs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// usage: input 3, cache write 418, cache read 1111, output 33 (claude-sonnet-4-5: $3 in, $3.75 cache write,
/// $0.30 cache read, $15 out per Mtok).
const ANTHROPIC_CACHE: &str = "anthropic_messages/pydantic-ai__prompt_cache/01";
/// usage: prompt 1149 of which 1024 cached, completion 353 (gpt-4o-mini: $0.15 in, $0.075 cached, $0.60 out).
const OPENAI_CACHED: &str = "openai_chat/openllmetry__prompt_caching/01";
/// "moonshotai/kimi-k2" sent to api.openai.com: OpenAI sells no such model, so its cost is unknown.
const UNPRICED: &str = "openai_chat/simonw-llm__tools_streaming/00";
const FAILING: &str = "errors_edge/pydantic-ai__anthropic_400_invalid_request";

async fn send_as(tap: &Llmtap, name: &str, session: &str) {
    let f = fixture(name);
    let reply = send_fixture(&client(), tap, &f, &[("x-llmtap-session", session)]).await;
    assert_eq!(reply.status, f.status, "{name}");
}

fn trace_with_model<'a>(traces: &'a [Value], model: &str) -> &'a Value {
    traces
        .iter()
        .find(|t| t["model"] == model)
        .unwrap_or_else(|| panic!("no trace of {model} in {traces:?}"))
}

fn session_row<'a>(rows: &'a [Value], session: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["session_id"] == session)
        .unwrap_or_else(|| panic!("no session {session} in {rows:?}"))
}

fn traces_json(tap: &Llmtap) -> Vec<Value> {
    tap.cli(&["traces", "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_and_session_shows_its_cost_and_an_unpriced_model_shows_unknown() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let mut api = api_client(&tap).await;
    let mut live = api
        .subscribe(llmtap::api::pb::SubscribeRequest {
            traces: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    send_as(&tap, ANTHROPIC_CACHE, "s-anthropic").await;
    send_as(&tap, OPENAI_CACHED, "s-openai").await;
    send_as(&tap, UNPRICED, "s-kimi").await;
    tap.wait_for_traces(3);
    tap.wait_settled();

    // Per call, --json: the five parts and the total as exact decimal strings; unknown is null.
    let traces = traces_json(&tap);
    let anthropic = &trace_with_model(&traces, "claude-sonnet-4-5-20250929")["cost_usd"];
    assert_eq!(anthropic["input"], "0.000009"); // 3 × 3 / 1e6
    assert_eq!(anthropic["cache_write"], "0.0015675"); // 418 × 3.75 / 1e6
    assert_eq!(anthropic["cache_read"], "0.0003333"); // 1111 × 0.30 / 1e6
    assert_eq!(anthropic["output"], "0.000495"); // 33 × 15 / 1e6
    assert_eq!(anthropic["reasoning"], "0");
    assert_eq!(anthropic["total"], "0.0024048");
    let openai = &trace_with_model(&traces, "gpt-4o-mini-2024-07-18")["cost_usd"];
    assert_eq!(openai["input"], "0.00001875"); // (1149 − 1024) × 0.15 / 1e6
    assert_eq!(openai["cache_read"], "0.0000768"); // 1024 × 0.075 / 1e6
    assert_eq!(openai["cache_write"], "0");
    assert_eq!(openai["output"], "0.0002118"); // 353 × 0.60 / 1e6
    assert_eq!(openai["total"], "0.00030735");
    let kimi = trace_with_model(&traces, "moonshotai/kimi-k2");
    assert!(kimi["usage"].is_object(), "the call has usage: {kimi}");
    assert_eq!(kimi["cost_usd"], Value::Null, "no price: unknown, not 0");

    // Per call, table: a COST column, "unknown" for the unpriced model.
    let table = tap.cli(&["traces"]);
    assert!(table.lines().next().unwrap().contains("COST"), "{table}");
    let line = |model: &str| table.lines().find(|l| l.contains(model)).unwrap().to_owned();
    assert!(line("claude-sonnet-4-5").contains("$0.002405"), "{table}");
    assert!(line("gpt-4o-mini").contains("$0.000307"), "{table}");
    assert!(line("kimi-k2").contains("unknown"), "{table}");

    // Per session (trajectory), --json and table.
    let rows = tap.sessions_json();
    let s = session_row(&rows, "s-anthropic");
    assert_eq!(s["cost_usd"]["total"], "0.0024048");
    assert_eq!(s["cost_usd"]["cache_write"], "0.0015675");
    assert_eq!(s["unpriced_calls"], 0);
    assert_eq!(s["cache_write_tokens"], 418);
    let s = session_row(&rows, "s-kimi");
    assert_eq!(s["cost_usd"], Value::Null);
    assert_eq!(s["unpriced_calls"], 1);
    let table = tap.cli(&["sessions"]);
    assert!(table.lines().next().unwrap().contains("COST"), "{table}");
    let line = |session: &str| table.lines().find(|l| l.contains(session)).unwrap().to_owned();
    assert!(line("s-anthropic").contains("$0.002405"), "{table}");
    assert!(line("s-kimi").contains("unknown"), "{table}");

    // Per step: the agent step carries its call's cost.
    let steps = tap.export("steps", &["--session", "s-openai"]);
    let agent = steps.iter().find(|s| s["role"] == "agent").unwrap();
    assert_eq!(agent["cost_usd"]["total"], "0.00030735");

    // gRPC: sessions and the live trace summaries.
    let listed = api
        .list_sessions(llmtap::api::pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions;
    let by_session = |id: &str| listed.iter().find(|s| s.session_id == id).unwrap().clone();
    let s = by_session("s-openai");
    let cost = s.cost.expect("a known cost");
    assert_eq!(
        (cost.total.as_str(), cost.cache_read.as_str()),
        ("0.00030735", "0.0000768")
    );
    assert_eq!(s.unpriced_calls, 0);
    let s = by_session("s-kimi");
    assert_eq!((s.cost, s.unpriced_calls), (None, 1));
    let mut summaries = Vec::new();
    while summaries.len() < 3 {
        let event = tokio::time::timeout(Duration::from_secs(20), live.message())
            .await
            .expect("three trace events")
            .unwrap()
            .unwrap();
        if let Some(llmtap::api::pb::event::Kind::Trace(t)) = event.kind {
            summaries.push(t);
        }
    }
    let summary = |model: &str| summaries.iter().find(|t| t.model == model).unwrap();
    let t = summary("claude-sonnet-4-5-20250929");
    assert_eq!(t.cost.as_ref().unwrap().total, "0.0024048");
    assert_eq!((t.cache_write_tokens, t.cache_read_tokens), (418, 1111));
    assert_eq!(summary("moonshotai/kimi-k2").cost, None);

    // /metrics: dollars by model, and calls of unknown cost by model.
    let metrics = tap.metrics();
    assert!(
        metrics.contains("llmtap_cost_usd_total{model=\"claude-sonnet-4-5-20250929\"} 0.0024048"),
        "{metrics}"
    );
    assert!(
        metrics.contains("llmtap_cost_usd_total{model=\"gpt-4o-mini-2024-07-18\"} 0.00030735"),
        "{metrics}"
    );
    assert!(
        metrics.contains("llmtap_cost_unknown_calls_total{model=\"moonshotai/kimi-k2\"} 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("llmtap_cost_usd_total{model=\"moonshotai/kimi-k2\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prices_file_overrides_the_embedded_price_and_a_bad_one_stops_startup() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let prices = dir.path().join("prices.toml");
    std::fs::write(
        &prices,
        "[[prices]]\nprovider = \"openai\"\nmodel = \"gpt-4o-mini*\"\ninput_mtok = 0.1\noutput_mtok = 0.2\n",
    )
    .unwrap();
    let cost_section = format!("[cost]\nprices_file = \"{}\"\n", prices.display());
    let tap = Llmtap::start(&upstream_config(&up, &cost_section), &dir.path().join("data"));
    send_as(&tap, OPENAI_CACHED, "s-override").await;
    send_as(&tap, ANTHROPIC_CACHE, "s-table").await;
    tap.wait_for_traces(2);
    let traces = traces_json(&tap);
    let openai = &trace_with_model(&traces, "gpt-4o-mini-2024-07-18")["cost_usd"];
    // Cache reads have no override price: charged at the override's input price.
    assert_eq!(openai["input"], "0.0000125"); // 125 × 0.1 / 1e6
    assert_eq!(openai["cache_read"], "0.0001024"); // 1024 × 0.1 / 1e6
    assert_eq!(openai["output"], "0.0000706"); // 353 × 0.2 / 1e6
    assert_eq!(openai["total"], "0.0001855");
    // Models the file does not name keep the embedded price.
    let anthropic = &trace_with_model(&traces, "claude-sonnet-4-5-20250929")["cost_usd"];
    assert_eq!(anthropic["total"], "0.0024048");
    drop(tap);

    // A broken file is a startup error naming the file and the problem, for serve and check-config alike.
    std::fs::write(&prices, "[[prices]]\nmodel = \"x\"\ninput_mtok = 1\noutput_mtok = -2\n").unwrap();
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, upstream_config(&up, &cost_section)).unwrap();
    for args in [
        vec!["check-config", "-c", config.to_str().unwrap()],
        vec![
            "serve",
            "-c",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().join("data2").to_str().unwrap(),
        ],
    ] {
        let out = llmtap_command().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} accepted a negative price");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("cost.prices_file") && err.contains("prices.toml") && err.contains("negative"),
            "{args:?}: {err}"
        );
    }
}

/// What a child wrote to its stdout so far, read by a thread.
struct Output {
    child: Child,
    text: Arc<Mutex<String>>,
}

impl Output {
    fn spawn(mut command: Command) -> Output {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let text = Arc::new(Mutex::new(String::new()));
        let sink = text.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    return;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Output { child, text }
    }

    fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = self.text.lock().unwrap().clone();
            if pred(&text) {
                return text;
            }
            assert!(Instant::now() < deadline, "no {what} in the output:\n{text}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Subscribers the instance serves (the `llmtap_api_streams` gauge).
fn wait_for_streams(tap: &Llmtap, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tap.metric("llmtap_api_streams") < n {
        assert!(Instant::now() < deadline, "tail never subscribed");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_in_a_terminal_shows_new_calls_with_cost_and_errors_in_red() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let api = tap.api_addr.unwrap().to_string();
    // A real pseudo-terminal: script(1) runs tail with its stdout on a pty and copies what it writes to ours.
    let tail = format!("{} tail --api {api}", bin());
    let mut in_pty = Command::new("script");
    in_pty.args(["-q", "-f", "-e", "-c", &tail, "/dev/null"]);
    clean_env(&mut in_pty).env_remove("NO_COLOR");
    let terminal = Output::spawn(in_pty);
    // The same command on a pipe: no colour.
    let mut piped = llmtap_command();
    piped.args(["tail", "--api", &api]);
    let pipe = Output::spawn(piped);
    wait_for_streams(&tap, 2);

    send_as(&tap, ANTHROPIC_CACHE, "s-tail").await;
    let shown = terminal.wait_for("the call", |t| t.contains("claude-sonnet-4-5-20250929"));
    let line = shown
        .lines()
        .find(|l| l.contains("claude-sonnet-4-5-20250929"))
        .unwrap();
    assert!(
        line.contains("s-tail"),
        "the session names the call when no agent does: {line}"
    );
    assert!(line.contains("in 1532 (cache read 1111, write 418) out 33"), "{line}");
    assert!(line.contains("$0.002405"), "{line}");
    assert!(!line.contains("\x1b[31m"), "a successful call is not red: {line:?}");

    send_as(&tap, FAILING, "s-tail").await;
    let shown = terminal.wait_for("the error", |t| t.contains("ERROR"));
    let line = shown.lines().find(|l| l.contains("ERROR")).unwrap();
    assert!(line.contains("\x1b[31m"), "an error is red on a terminal: {line:?}");
    assert!(line.contains("unknown") || line.contains('$'), "{line}");

    let piped = pipe.wait_for("both calls", |t| t.contains("ERROR") && t.contains("claude-sonnet-4-5"));
    assert!(!piped.contains('\x1b'), "no colour on a pipe: {piped:?}");
}

#[test]
fn tail_without_a_running_llmtap_says_so_and_exits() {
    let out = llmtap_command()
        .args(["tail", "--api", "127.0.0.1:9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach llmtap's API at http://127.0.0.1:9"), "{err}");
}
