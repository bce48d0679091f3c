//! The web viewer as a user sees it: recorded agent sessions replayed through the real binary (and a Claude
//! Code-shaped session made of recorded Anthropic calls: quota probe, warmup, the agent's tool round, title),
//! then the viewer's JSON API read over HTTP, and Debian's Chromium (headless, driven by tests/browser/viewer.mjs through
//! playwright-core) opening the sessions list, a session page and a call page; a call made while the list is
//! open must appear without a reload. Screenshots land in target/screenshots/.
//!
//! Chromium and the npm packages come from `scripts/test.sh` (apt-get install chromium, npm ci).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::browser::{browser_dir, require_browser};
use common::*;
use serde_json::Value;

const SESSION: &str = "pydantic-ai__anthropic_parallel_tools_agent";
/// The native session id the Claude Code-shaped calls carry (`x-claude-code-session-id`).
const CLAUDE_SESSION: &str = "viewer-claude-code-session";
/// The recorded Anthropic tool round that is the Claude Code session's main conversation.
const CLAUDE_MAIN: [&str; 2] = [
    "anthropic_messages/pydantic-ai__parallel_tool_use/00",
    "anthropic_messages/pydantic-ai__parallel_tool_use/01",
];

async fn get_json(client: &Client, url: &str) -> Value {
    let r = send(client, "GET", url, &[], Vec::new()).await;
    assert_eq!(r.status, 200, "{url}: {}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

/// Replays every recorded agent session (the Anthropic one first, so its calls are known) and returns the
/// Anthropic session's provider traces.
async fn replay_all(tap: &Llmtap) -> Vec<Value> {
    let client = client();
    let first = session(SESSION);
    for f in &first {
        assert_eq!(send_fixture(&client, tap, f, &[]).await.status, f.status, "{}", f.name);
    }
    let anthropic = tap.wait_for_traces(first.len());
    let mut total = first.len();
    for name in session_names().into_iter().filter(|n| n != SESSION) {
        let calls = session(&name);
        for f in &calls {
            assert_eq!(send_fixture(&client, tap, f, &[]).await.status, f.status, "{}", f.name);
        }
        total += calls.len();
    }
    total += replay_claude_code(&client, tap).await;
    tap.wait_for_traces(total);
    anthropic
}

/// A session shaped like a Claude Code run, every call with its session header: a quota probe (one output
/// token, no tools), a warmup (one output token, the agent's tools), the recorded tool round, and a title call.
/// The upstream answers each with a recorded response. Returns the number of calls.
async fn replay_claude_code(client: &Client, tap: &Llmtap) -> usize {
    let main: Vec<Fixture> = CLAUDE_MAIN.iter().map(|n| fixture(n)).collect();
    let first = with_injected_context(serde_json::from_slice(&main[0].request).unwrap());
    let post = |f: &Fixture, body: Value| {
        let url = tap.url(&f.client_path);
        let name = f.name.clone();
        let client = client.clone();
        async move {
            send(
                &client,
                "POST",
                &url,
                &claude_headers(&name),
                serde_json::to_vec(&body).unwrap(),
            )
            .await
        }
    };
    let quota = quota_probe(&first);
    let mut warmup = first.clone();
    warmup["max_tokens"] = 1.into();
    warmup["messages"] = serde_json::json!([{"role": "user", "content": "Warmup"}]);
    assert_eq!(post(&main[0], quota).await.status, 200);
    assert_eq!(post(&main[0], warmup).await.status, 200);
    for f in &main {
        let body = with_injected_context(serde_json::from_slice(&f.request).unwrap());
        let r = send(
            client,
            &f.method,
            &tap.url(&f.client_path),
            &claude_headers(&f.name),
            serde_json::to_vec(&body).unwrap(),
        )
        .await;
        assert_eq!(r.status, f.status, "{}", f.name);
    }
    let mut title = first;
    title["system"] = "Write a 5-10 word title for the conversation. Answer with the title only.".into();
    title.as_object_mut().unwrap().remove("tools");
    title.as_object_mut().unwrap().remove("tool_choice");
    assert_eq!(post(&main[1], title).await.status, 200);
    main.len() + 3
}

/// Context Claude Code injects before what the person typed in the first user message (CLAUDE.md as a
/// `<system-reminder>` block).
const INJECTED_CONTEXT: &str = "<system-reminder>\nAs you answer the user's questions, you can use the following \
    context:\n# claudeMd\nCodebase and user instructions are shown below.\n\nContents of /repo/CLAUDE.md:\n\
    Answer in one sentence.\n</system-reminder>";

/// The request with Claude Code's injected context as the first block of its first user message.
fn with_injected_context(mut body: Value) -> Value {
    let content = body["messages"][0]["content"].as_array_mut().unwrap();
    content.insert(0, serde_json::json!({"type": "text", "text": INJECTED_CONTEXT}));
    body
}

/// What the person typed first in the Claude Code-shaped session (and in the Anthropic session): its title
/// when there is no title call.
fn first_user_text() -> String {
    let req: Value = serde_json::from_slice(&fixture(CLAUDE_MAIN[0]).request).unwrap();
    req["messages"][0]["content"][0]["text"].as_str().unwrap().to_owned()
}

/// The title the Claude Code-shaped session's title call was answered with: the recorded answer it gets
/// (`CLAUDE_MAIN[1]`'s) is plain text, whose first line is the title.
fn answered_title() -> String {
    let resp = fixture(CLAUDE_MAIN[1]).response_json.unwrap();
    let text = resp["content"][0]["text"].as_str().unwrap();
    text.lines().next().unwrap().trim().to_owned()
}

/// The quota probe's text: in no recording, so only the Claude Code session's steps contain it.
const QUOTA_TEXT: &str = "quota probe of the viewer test";

/// A quota probe like Claude Code's: one output token, no tools.
fn quota_probe(first: &Value) -> Value {
    let mut quota = first.clone();
    quota["max_tokens"] = 1.into();
    quota["messages"] = serde_json::json!([{"role": "user", "content": QUOTA_TEXT}]);
    quota.as_object_mut().unwrap().remove("tools");
    quota.as_object_mut().unwrap().remove("tool_choice");
    quota
}

fn claude_headers(fixture: &str) -> Vec<(&str, &str)> {
    vec![
        ("content-type", "application/json"),
        ("x-replay-fixture", fixture),
        ("x-claude-code-session-id", CLAUDE_SESSION),
    ]
}

/// The request body llmtap stored for a call, as text.
fn fixture_request(trace: &Value) -> String {
    trace["request"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| trace["request"].to_string())
}

/// `llmtap sessions --json`: the session with this id.
fn group<'a>(groups: &'a [Value], id: &str) -> &'a Value {
    groups
        .iter()
        .find(|g| g["session_id"] == id)
        .unwrap_or_else(|| panic!("no session {id} in {groups:#?}"))
}

/// Trajectories of a session group that `llmtap sessions` folds (side calls, titles, warmups, quota probes).
fn auxiliary(group: &Value) -> Vec<&Value> {
    group["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| ["side", "title", "warmup", "quota"].contains(&t["purpose"].as_str().unwrap_or("")))
        .collect()
}

/// The cost of a stored call, computed here from its usage with the library's price table.
fn expected_cost(trace: &Value) -> rust_decimal::Decimal {
    let usage: llmtap::model::usage::Usage = serde_json::from_value(trace["usage"].clone()).unwrap();
    let start = chrono::DateTime::parse_from_rfc3339(trace["timings"]["start"].as_str().unwrap())
        .unwrap()
        .timestamp_micros();
    llmtap::cost::CostTable::embedded()
        .unwrap()
        .cost("anthropic", trace["model"].as_str().unwrap(), start, &usage)
        .unwrap()
        .usd
        .total
}

/// Steps of `trajectory` in the `steps` export, and how many tool calls there have a result.
fn expected_steps(tap: &Llmtap, trajectory: &str) -> (usize, usize) {
    let steps: Vec<Value> = tap
        .export("steps", &[])
        .into_iter()
        .filter(|s| s["trajectory_id"] == trajectory)
        .collect();
    let results = steps
        .iter()
        .map(|s| {
            let answered: Vec<&str> = s["observations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o["source_call_id"].as_str().unwrap())
                .collect();
            s["tool_calls"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| answered.contains(&c["tool_call_id"].as_str().unwrap()))
                .count()
        })
        .sum();
    (steps.len(), results)
}

#[tokio::test(flavor = "multi_thread")]
async fn json_api_lists_sessions_with_totals_and_serves_steps_calls_and_exports() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let viewer = tap.viewer_addr.expect("viewer enabled");
    let anthropic = replay_all(&tap).await;
    let client = client();
    let base = format!("http://{viewer}");

    let page = get_json(&client, &format!("{base}/api/sessions?limit=500")).await;
    let listed = page["sessions"].as_array().unwrap();
    // One row per session of `llmtap sessions`, none twice.
    let groups = tap.session_groups();
    let mut want_ids: Vec<&str> = groups.iter().map(|g| g["session_id"].as_str().unwrap()).collect();
    let mut got_ids: Vec<&str> = listed.iter().map(|s| s["id"].as_str().unwrap()).collect();
    want_ids.sort_unstable();
    got_ids.sort_unstable();
    assert_eq!(got_ids, want_ids);
    // Newest first.
    let started: Vec<&str> = listed.iter().map(|s| s["started_at"].as_str().unwrap()).collect();
    assert!(started.windows(2).all(|w| w[0] >= w[1]), "{started:?}");
    // Every call is counted under exactly one listed session.
    let calls: u64 = listed.iter().map(|s| s["totals"]["calls"].as_u64().unwrap()).sum();
    let traced = tap
        .export("provider-traces", &[])
        .iter()
        .filter(|t| t["trajectory_id"].is_string())
        .count();
    assert_eq!(calls as usize, traced);

    // Keyset pages: two rows at a time cover the same sessions in the same order.
    let mut paged = Vec::new();
    let mut next = String::new();
    loop {
        let p = get_json(&client, &format!("{base}/api/sessions?limit=2{next}")).await;
        paged.extend(p["sessions"].as_array().unwrap().iter().map(|s| s["id"].clone()));
        match p["next"].as_str() {
            Some(n) => next = format!("&before={n}"),
            None => break,
        }
    }
    assert_eq!(paged, listed.iter().map(|s| s["id"].clone()).collect::<Vec<_>>());

    // The Claude Code session: one row covering every trajectory and call, side calls and warmups included.
    let claude = group(&groups, CLAUDE_SESSION);
    let claude_trajectories = claude["trajectories"].as_array().unwrap();
    let aux = auxiliary(claude);
    let purposes: Vec<&str> = aux.iter().map(|t| t["purpose"].as_str().unwrap()).collect();
    for p in ["quota", "warmup", "title"] {
        assert!(purposes.contains(&p), "{p} missing from {claude:#}");
    }
    let row = listed.iter().find(|s| s["id"] == CLAUDE_SESSION).unwrap();
    assert_eq!(row["trajectories"], claude_trajectories.len());
    assert_eq!(row["side_trajectories"], aux.len());
    let claude_calls = tap
        .export("provider-traces", &[])
        .iter()
        .filter(|t| t["session_id"] == CLAUDE_SESSION)
        .count();
    assert_eq!(row["totals"]["calls"], claude_calls);
    for t in claude_trajectories {
        assert!(!got_ids.contains(&t["trajectory_id"].as_str().unwrap()), "{t:#}");
    }
    // Its page: every trajectory, the auxiliary ones marked as side and placed under the main run.
    let page = get_json(&client, &format!("{base}/api/sessions/{CLAUDE_SESSION}")).await;
    let shown = page["trajectories"].as_array().unwrap();
    assert_eq!(shown.len(), claude_trajectories.len());
    assert_eq!(shown.iter().filter(|t| t["side"] == true).count(), aux.len());
    let main_run = &shown[0];
    assert_eq!(main_run["purpose"], "main");
    assert!(main_run["under"].is_null());
    for a in &aux {
        let t = shown.iter().find(|t| t["id"] == a["trajectory_id"]).unwrap();
        assert_eq!(t["under"], main_run["id"], "{t:#}");
    }
    // A trajectory's id (links written before sessions were grouped) opens its session, focused on it.
    let warmup_id = aux.iter().find(|t| t["purpose"] == "warmup").unwrap()["trajectory_id"].clone();
    let by_trajectory = get_json(&client, &format!("{base}/api/sessions/{}", warmup_id.as_str().unwrap())).await;
    assert_eq!(by_trajectory["id"], CLAUDE_SESSION);
    assert_eq!(by_trajectory["focus"], warmup_id);
    // A text only a side trajectory's step holds finds its whole session, once.
    let q = QUOTA_TEXT.replace(' ', "+");
    let found = get_json(&client, &format!("{base}/api/sessions?q={q}")).await;
    let found: Vec<&Value> = found["sessions"].as_array().unwrap().iter().map(|s| &s["id"]).collect();
    assert_eq!(found, [CLAUDE_SESSION]);
    // Time: sessions still running at the Claude Code session's start, by `llmtap sessions`' own times.
    let since = row["started_at"].as_str().unwrap();
    let mut want: Vec<&str> = groups
        .iter()
        .filter(|g| g["ended_at"].as_str().unwrap() >= since)
        .map(|g| g["session_id"].as_str().unwrap())
        .collect();
    let page = get_json(&client, &format!("{base}/api/sessions?since={since}&limit=500")).await;
    let mut got: Vec<&str> = page["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want);
    assert!(got.contains(&CLAUDE_SESSION) && got.len() < listed.len(), "{got:?}");

    // The Anthropic session: its totals' cost is the sum of its calls' costs.
    let trajectory = anthropic[0]["trajectory_id"].as_str().unwrap();
    let s = get_json(&client, &format!("{base}/api/sessions/{trajectory}")).await;
    let want: rust_decimal::Decimal = anthropic.iter().map(expected_cost).sum();
    let got: rust_decimal::Decimal = s["totals"]["cost_usd"].as_str().unwrap().parse().unwrap();
    assert_eq!(got, want);
    assert_eq!(s["totals"]["calls"], anthropic.len());

    // Filters: by agent-less text that only this session's steps contain, and by model.
    let model = anthropic[0]["model"].as_str().unwrap();
    let by_model = get_json(&client, &format!("{base}/api/sessions?model={model}")).await;
    let ids: Vec<&str> = by_model["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&trajectory), "{ids:?}");
    assert!(ids.len() < listed.len());
    let none = get_json(&client, &format!("{base}/api/sessions?q=no-such-text-anywhere-42")).await;
    assert_eq!(none["sessions"].as_array().unwrap().len(), 0);

    // Steps, paged by index.
    let (n_steps, _) = expected_steps(&tap, trajectory);
    let first = get_json(&client, &format!("{base}/api/trajectories/{trajectory}/steps?limit=1")).await;
    assert_eq!(first["steps"].as_array().unwrap().len(), 1);
    let after = first["next"].as_u64().unwrap();
    let rest = get_json(
        &client,
        &format!("{base}/api/trajectories/{trajectory}/steps?after={after}&limit=1000"),
    )
    .await;
    assert_eq!(1 + rest["steps"].as_array().unwrap().len(), n_steps);

    // A later call: new messages only, its previous call, no secret header, a curl with a placeholder key.
    let call_id = anthropic.last().unwrap()["id"].as_str().unwrap();
    let call = get_json(&client, &format!("{base}/api/calls/{call_id}")).await;
    assert_eq!(call["previous_call"], anthropic[anthropic.len() - 2]["id"]);
    assert!(call["request"]["history"].as_u64().unwrap() > 0);
    let headers = call["request_headers"].to_string().to_ascii_lowercase();
    assert!(
        !headers.contains("x-api-key") && !headers.contains("authorization"),
        "{headers}"
    );
    let curl = call["curl"].as_str().unwrap();
    assert!(curl.contains("x-api-key: $ANTHROPIC_API_KEY"), "{curl}");
    let cost: rust_decimal::Decimal = call["cost"]["total"].as_str().unwrap().parse().unwrap();
    assert_eq!(cost, expected_cost(anthropic.last().unwrap()));

    // Each export format of the session downloads what `llmtap export --session` writes.
    let exports = s["exports"].as_array().unwrap();
    assert_eq!(exports.len(), 8);
    let steps_link = exports.iter().find(|e| e["format"] == "steps").unwrap();
    let r = send(
        &client,
        "GET",
        &format!("{base}/{}", steps_link["url"].as_str().unwrap()),
        &[],
        Vec::new(),
    )
    .await;
    assert_eq!(r.status, 200);
    let cli = tap.cli(&["export", "--format", "steps", "--session", trajectory]);
    assert_eq!(String::from_utf8_lossy(&r.body), cli);

    // Page and API responses carry the strict policy; a foreign Host name is refused (DNS rebinding).
    let index = send(&client, "GET", &format!("{base}/"), &[], Vec::new()).await;
    let csp = index.headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("script-src 'self'"),
        "{csp}"
    );
    let rebound = send(
        &client,
        "GET",
        &format!("{base}/api/sessions"),
        &[("host", "evil.example:80")],
        Vec::new(),
    )
    .await;
    assert_eq!(rebound.status, 403);
}

/// Titles through the real binary: the Claude Code-shaped session is named by its title call's answer, the
/// Anthropic session (no title call) by its first user text without the injected context; `llmtap sessions`
/// prints them on each session's line and `--json` carries them, and the viewer's list and session page agree.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_are_titled_by_their_title_call_or_first_user_text_in_the_cli_and_the_viewer() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let mut calls = 0;
    for f in &session(SESSION) {
        // Claude Code's injected context in front of what the person typed, here without a session header.
        let body = with_injected_context(serde_json::from_slice(&f.request).unwrap());
        let r = send(
            &client,
            &f.method,
            &tap.url(&f.client_path),
            &[
                ("content-type", "application/json"),
                ("x-replay-fixture", f.name.as_str()),
            ],
            serde_json::to_vec(&body).unwrap(),
        )
        .await;
        assert_eq!(r.status, f.status, "{}", f.name);
        calls += 1;
    }
    calls += replay_claude_code(&client, &tap).await;
    let traces = tap.wait_for_traces(calls);
    let anthropic = traces.iter().find(|t| t["session_id"] != CLAUDE_SESSION).unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (title, first) = (answered_title(), first_user_text());
    assert_ne!(title, first);
    assert!(!first.contains("system-reminder"));

    let groups = tap.session_groups();
    assert_eq!(group(&groups, CLAUDE_SESSION)["title"], title.as_str());
    assert_eq!(group(&groups, &anthropic)["title"], first.as_str());
    let table = tap.cli(&["sessions"]);
    let line = |id: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("session {id} ")))
            .unwrap_or_else(|| panic!("no line for {id}: {table}"))
            .to_owned()
    };
    assert!(line(CLAUDE_SESSION).ends_with(&format!("  {title}")), "{table}");
    assert!(line(&anthropic).ends_with(&format!("  {first}")), "{table}");
    assert!(
        !table.contains("system-reminder") && !table.contains("claudeMd"),
        "{table}"
    );

    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let list = get_json(&client, &format!("{base}/api/sessions")).await;
    let row = |id: &str| {
        list["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(row(CLAUDE_SESSION)["title"], title.as_str());
    assert_eq!(row(&anthropic)["title"], first.as_str());
    let page = get_json(&client, &format!("{base}/api/sessions/{CLAUDE_SESSION}")).await;
    assert_eq!(page["title"], title.as_str());
    // In the tree: the main run by its first user text, the title call by its title.
    let by_purpose = |p: &str| {
        page["trajectories"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["purpose"] == p)
            .unwrap()["title"]
            .clone()
    };
    assert_eq!(by_purpose("main"), first.as_str());
    assert_eq!(by_purpose("title"), title.as_str());
    assert_eq!(by_purpose("warmup"), Value::Null);
}

#[tokio::test(flavor = "multi_thread")]
async fn viewer_beyond_loopback_requires_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let out = llmtap_command()
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .arg("--config")
        .arg({
            let p = dir.path().join("c.toml");
            std::fs::write(&p, "[api]\nlisten = \"off\"\n[viewer]\nlisten = \"0.0.0.0:0\"\n").unwrap();
            p
        })
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("viewer"));

    // With a token: refused without it; accepted as a bearer header, and as ?token= on the page alone, answered
    // with a redirect that drops it from the URL and a cookie that is not the token.
    let up = Upstream::start(ReplayOptions::default()).await;
    let token = "s3cret-viewer";
    let tap = Llmtap::start(
        &upstream_config(
            &up,
            &format!("[api]\nlisten = \"off\"\ntoken = \"{token}\"\n[viewer]\nlisten = \"127.0.0.1:0\"\n"),
        ),
        dir.path(),
    );
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let client = client();
    assert_eq!(get(&client, &base, "/api/sessions", &[]).await.status, 401);
    assert_eq!(get(&client, &base, "/?token=nope", &[]).await.status, 401);
    let ok = get(&client, &base, &format!("/?token={token}"), &[]).await;
    assert_eq!(ok.status, 303);
    assert_eq!(ok.headers["location"], "./");
    assert_eq!(ok.headers["referrer-policy"], "no-referrer");
    let cookie = ok.headers["set-cookie"].to_str().unwrap();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(attribute), "{attribute}: {cookie}");
    }
    assert!(!cookie.contains(token), "the cookie is the token: {cookie}");
    let pair = cookie.split(';').next().unwrap();
    let page = get(&client, &base, "/", &[("cookie", pair)]).await;
    assert_eq!(page.status, 200);
    assert_eq!(page.headers["referrer-policy"], "no-referrer");
    assert_eq!(
        get(&client, &base, "/api/sessions", &[("cookie", pair)]).await.status,
        200
    );
    assert_eq!(
        get(&client, &base, "/assets/app.js", &[("cookie", pair)]).await.status,
        200
    );
    // The token itself is not a cookie, and ?token= is not taken on any other path.
    let raw = format!("llmtap_viewer={token}");
    assert_eq!(
        get(&client, &base, "/api/sessions", &[("cookie", raw.as_str())])
            .await
            .status,
        401
    );
    assert_eq!(
        get(&client, &base, "/api/sessions", &[("cookie", "llmtap_viewer=00")])
            .await
            .status,
        401
    );
    for path in ["/api/sessions", "/assets/app.js", "/api/export/steps"] {
        assert_eq!(
            get(&client, &base, &format!("{path}?token={token}"), &[]).await.status,
            401,
            "{path}"
        );
    }
    let bearer = format!("Bearer {token}");
    assert_eq!(
        get(&client, &base, "/api/sessions", &[("authorization", bearer.as_str())])
            .await
            .status,
        200
    );
    // The cookie does not make a cross-site request acceptable.
    let cross = [("cookie", pair), ("sec-fetch-site", "cross-site")];
    assert_eq!(get(&client, &base, "/api/sessions", &cross).await.status, 403);
}

/// A page on another site that the user visits cannot drive the viewer: cross-site requests are refused on every
/// API route, by `Sec-Fetch-Site` or, from a browser that does not send it, by `Origin`. The viewer's own page,
/// a URL typed into the browser and clients sending neither header (curl) are served; so is a link to the page.
#[tokio::test(flavor = "multi_thread")]
async fn cross_site_requests_to_the_api_are_refused_and_same_origin_ones_served() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let client = client();
    let f = &session(SESSION)[0];
    assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
    let trace = tap.wait_for_traces(1).remove(0);
    let (call, trajectory) = (trace["id"].as_str().unwrap(), trace["trajectory_id"].as_str().unwrap());
    let routes = [
        "/api/sessions".to_owned(),
        format!("/api/sessions/{trajectory}"),
        format!("/api/trajectories/{trajectory}/steps"),
        format!("/api/calls/{call}"),
        format!("/api/export/steps?session={trajectory}"),
    ];
    let refused: [&[(&str, &str)]; 5] = [
        &[("origin", "http://evil.example"), ("sec-fetch-site", "cross-site")],
        // Another site on this host (another port of 127.0.0.1) or a sibling domain.
        &[("sec-fetch-site", "same-site")],
        // A browser without Sec-Fetch-*: its Origin names another origin.
        &[("origin", "http://evil.example")],
        &[("origin", "null")],
        &[("origin", "http://127.0.0.1:1")],
    ];
    let own = base.clone();
    let served: [&[(&str, &str)]; 4] = [
        &[],
        &[("sec-fetch-site", "same-origin"), ("origin", own.as_str())],
        &[("sec-fetch-site", "none")],
        &[("origin", own.as_str())],
    ];
    for route in routes.iter().chain([&"/api/events".to_owned()]) {
        for headers in refused {
            let r = send(&client, "GET", &format!("{base}{route}"), headers, vec![]).await;
            assert_eq!(r.status, 403, "{route} {headers:?}");
        }
    }
    for route in &routes {
        for headers in served {
            let r = send(&client, "GET", &format!("{base}{route}"), headers, vec![]).await;
            assert_eq!(
                r.status,
                200,
                "{route} {headers:?}: {}",
                String::from_utf8_lossy(&r.body)
            );
        }
    }
    // A link from elsewhere opens the page (its data requests are then same-origin).
    let navigate = [("sec-fetch-site", "cross-site"), ("sec-fetch-mode", "navigate")];
    assert_eq!(
        send(&client, "GET", &format!("{base}/"), &navigate, vec![])
            .await
            .status,
        200
    );
    // DNS rebinding: another name resolving to this address is refused, whatever the fetch headers say.
    let rebound = [("host", "evil.example"), ("sec-fetch-site", "same-origin")];
    assert_eq!(
        send(&client, "GET", &format!("{base}/api/sessions"), &rebound, vec![])
            .await
            .status,
        403
    );
}

async fn get(client: &Client, base: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    send(client, "GET", &format!("{base}{path}"), headers, vec![]).await
}

#[tokio::test(flavor = "multi_thread")]
async fn chromium_shows_sessions_a_session_tree_a_call_cost_and_live_calls() {
    let chromium = require_browser();
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let viewer = tap.viewer_addr.expect("viewer enabled");
    let anthropic = replay_all(&tap).await;
    let trajectory = anthropic[0]["trajectory_id"].as_str().unwrap().to_owned();
    let call = &anthropic[0];
    let (n_steps, n_results) = expected_steps(&tap, &trajectory);
    let groups = tap.session_groups();
    let claude = group(&groups, CLAUDE_SESSION);
    let claude_aux = auxiliary(claude).len();
    let claude_trajectories = claude["trajectories"].as_array().unwrap().len();
    let claude_main = claude["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["purpose"] == "main")
        .unwrap()["trajectory_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (claude_steps, _) = expected_steps(&tap, &claude_main);
    let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");

    let mut node = Command::new("node")
        .arg(browser_dir().join("viewer.mjs"))
        .arg(format!("http://{viewer}/"))
        .arg(&trajectory)
        .arg(call["id"].as_str().unwrap())
        .arg(&shots)
        .arg(CLAUDE_SESSION)
        .arg(&claude_main)
        .arg(anthropic.last().unwrap()["id"].as_str().unwrap())
        .arg(&trajectory)
        .arg(&claude_main)
        .env("CHROMIUM", &chromium)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(node.stdout.take().unwrap());
    let mut report = None;
    let client = client();
    for line in stdout.lines() {
        let line = line.unwrap();
        if line == "READY-FOR-CALL" {
            // A call in its own session scope: a new session for the open list.
            let f = json_calls(1).remove(0);
            let scoped = [("x-llmtap-session", "viewer-live-check")];
            assert_eq!(send_fixture(&client, &tap, &f, &scoped).await.status, 200);
        } else if line == "READY-FOR-SESSION-CALL" {
            // Another call of the Claude Code session: its row must update in place.
            let f = fixture(CLAUDE_MAIN[0]);
            let probe = quota_probe(&serde_json::from_slice(&f.request).unwrap());
            let r = send(
                &client,
                "POST",
                &tap.url(&f.client_path),
                &claude_headers(&f.name),
                serde_json::to_vec(&probe).unwrap(),
            )
            .await;
            assert_eq!(r.status, 200);
        } else if let Some(r) = line.strip_prefix("REPORT ") {
            report = Some(serde_json::from_str::<Value>(r).unwrap());
        }
    }
    assert!(node.wait().unwrap().success());
    let report = report.expect("the browser script reported");
    assert!(report.get("error").is_none(), "{report:#}");
    assert_eq!(report["console_errors"], serde_json::json!([]), "{report:#}");
    assert!(report["csp"].as_str().unwrap().contains("default-src 'none'"));

    // The list shows every session once: the Anthropic one (no native session id: its trajectory's id) and the
    // Claude Code one as a single row, none of its side trajectories as a row of its own.
    let rows = report["sessions"].as_array().unwrap();
    assert_eq!(rows.len(), groups.len());
    assert!(rows.iter().any(|r| r["id"] == trajectory.as_str()));
    assert_eq!(rows.iter().filter(|r| r["id"] == CLAUDE_SESSION).count(), 1);
    let claude_ids: Vec<&Value> = claude["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["trajectory_id"])
        .collect();
    assert!(!rows.iter().any(|r| claude_ids.contains(&&r["id"])), "{rows:#?}");

    // The Claude Code session page: its main trajectory's steps, every trajectory in the tree and the timeline,
    // the side calls, title, warmup and quota probe dimmed.
    let c = &report["claude"];
    assert_eq!(c["tree_nodes"], claude_trajectories);
    assert_eq!(c["dim_nodes"], claude_aux);
    assert!(claude_aux >= 3, "{claude:#}");
    assert_eq!(c["dim_purposes"].as_array().unwrap().len(), claude_aux);
    assert!(c["dim_purposes"].as_array().unwrap().iter().all(|p| p != "main"));
    assert_eq!(c["lanes"], claude_trajectories);
    assert_eq!(c["dim_lanes"], claude_aux);
    assert_eq!(c["selected"], claude_main.as_str());
    assert_eq!(c["steps"], claude_steps);
    // An old link naming the main trajectory opens the same session, the address rewritten to the session's.
    assert_eq!(c["old_link"]["hash"], format!("#/s/{CLAUDE_SESSION}?t={claude_main}"));
    assert_eq!(c["old_link"]["selected"], claude_main.as_str());
    assert_eq!(c["old_link"]["tree_nodes"], claude_trajectories);

    // Titles: the Claude Code session by its title call's answer, in the list and on its page; the main run in
    // the tree by what the person typed (without the injected context); the Anthropic session by its first
    // user text.
    let title_of = |id: &str| rows.iter().find(|r| r["id"] == id).unwrap()["title"].clone();
    assert_eq!(title_of(CLAUDE_SESSION), answered_title().as_str());
    assert_eq!(title_of(&trajectory), first_user_text().as_str());
    assert_eq!(c["title"], answered_title().as_str());
    let tree_title = |p: &str| {
        c["tree_titles"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["purpose"] == p)
            .unwrap()["title"]
            .clone()
    };
    assert_eq!(tree_title("main"), first_user_text().as_str());
    assert_eq!(tree_title("title"), answered_title().as_str());

    // The injected context of the first user step: one folded block, hidden until its summary is clicked; the
    // person's text shown beside it.
    let inj = &c["injected"];
    assert_eq!(inj["count"], 1, "{inj:#}");
    assert_eq!(
        (inj["open_before"].as_bool(), inj["visible_before"].as_bool()),
        (Some(false), Some(false))
    );
    assert_eq!(
        (inj["open_after"].as_bool(), inj["visible_after"].as_bool()),
        (Some(true), Some(true))
    );
    assert!(
        inj["summary"]
            .as_str()
            .unwrap()
            .starts_with("system-reminder: CLAUDE.md"),
        "{inj:#}"
    );
    assert_eq!(inj["text"], INJECTED_CONTEXT);
    assert_eq!(inj["user_text"], first_user_text().as_str());

    // A long tool output: its first 40 lines, then all of it on "show all".
    let show = &c["show_all"];
    assert_eq!(show["before"], 40, "{show:#}");
    assert_eq!(show["label"], "show all (100 lines, 789 chars)");
    assert_eq!(
        (show["whole"].as_bool(), show["button_left"].as_bool()),
        (Some(true), Some(false))
    );

    // Copy as JSON: what lands on the clipboard parses and equals what the API serves.
    let base = format!("http://{viewer}");
    let parse = |v: &Value| -> Value { serde_json::from_str(v.as_str().unwrap()).unwrap() };
    let step = parse(&report["copied_step"]);
    let steps = get_json(
        &client,
        &format!("{base}/api/trajectories/{claude_main}/steps?limit=1000"),
    )
    .await;
    let served = steps["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step_id"] == step["step_id"])
        .unwrap();
    assert_eq!(&step, served);
    assert!(step["content_parts"].is_array(), "{step:#}");
    let session = parse(&report["copied_session"]);
    assert_eq!(session, parse(&report["api_session"]));
    assert_eq!(session["id"], CLAUDE_SESSION);
    let copied_call = parse(&report["copied_call"]);
    assert_eq!(
        copied_call,
        get_json(&client, &format!("{base}/api/calls/{}", call["id"].as_str().unwrap())).await
    );

    // The later Anthropic call against the one before: exactly the messages it added, in order, and the rest
    // folded as unchanged.
    let d = &report["diff"];
    let last: Value = serde_json::from_str(&fixture_request(&anthropic[anthropic.len() - 1])).unwrap();
    let before: Value = serde_json::from_str(&fixture_request(&anthropic[anthropic.len() - 2])).unwrap();
    let (new_msgs, old_msgs) = (
        last["messages"].as_array().unwrap(),
        before["messages"].as_array().unwrap(),
    );
    assert_eq!(&new_msgs[..old_msgs.len()], &old_msgs[..]);
    let added = &new_msgs[old_msgs.len()..];
    assert_eq!(d["against"], anthropic[anthropic.len() - 2]["id"]);
    assert_eq!(d["removed"], 0);
    assert_eq!(d["added"].as_array().unwrap().len(), added.len(), "{d:#}");
    for (shown, want) in d["added"].as_array().unwrap().iter().zip(added) {
        assert_eq!(shown["head"], format!("+ {}", want["role"].as_str().unwrap()));
        let text: Value = serde_json::from_str(shown["text"].as_str().unwrap()).unwrap();
        assert_eq!(text, want["content"], "{shown:#}");
    }
    assert_eq!(
        d["same"],
        serde_json::json!([format!("… {} unchanged message(s)", old_msgs.len())])
    );

    // The Anthropic session and the Claude Code main run are the same task: every step lines up.
    let rows_cmp = report["compare"]["rows"].as_array().unwrap();
    assert_eq!(rows_cmp.len(), n_steps, "{rows_cmp:#?}");
    assert!(rows_cmp.iter().all(|r| r["kind"] == "both"), "{rows_cmp:#?}");

    // The session page: its tree, every step and every tool result of the main trajectory.
    let s = &report["session"];
    assert!(s["tree_nodes"].as_u64().unwrap() >= 1);
    assert_eq!(s["steps"], n_steps);
    assert_eq!(s["tool_results"], n_results);
    assert!(n_results > 0);
    assert_eq!(s["timeline_bars"], anthropic.len());

    // The call page: the cost the price table gives for its usage, to the digits shown.
    let shown = report["call"]["cost"].as_str().unwrap();
    let value: f64 = shown
        .trim_start_matches('$')
        .parse()
        .unwrap_or_else(|_| panic!("cost {shown:?}"));
    let digits = shown.split('.').nth(1).map_or(0, str::len) as i32;
    let want: f64 = expected_cost(call).to_string().parse().unwrap();
    assert!(
        (value - want).abs() <= 0.5 * 10f64.powi(-digits) + want * 0.005,
        "shown {shown}, expected {want}"
    );
    assert!(!report["call"]["text"].as_str().unwrap().contains("sk-"));

    // The live call appeared in the open list, without a reload.
    let live = &report["live"];
    assert_eq!(live["marker"], "same page");
    assert_eq!(
        live["after"].as_array().unwrap().len(),
        live["before"].as_u64().unwrap() as usize + 1
    );

    // The call made in the Claude Code session while the list was open: the same single row, one more call, the
    // count the store has for the session.
    let live = &report["live_session"];
    assert_eq!(live["marker"], "same page");
    assert_eq!(live["rows"], report["live"]["after"].as_array().unwrap().len());
    let count = |v: &Value| -> usize { v.as_str().unwrap().replace(',', "").parse().unwrap() };
    let (before, after) = (&live["before"], &live["after"]);
    assert_eq!(before.as_array().unwrap().len(), 1);
    assert_eq!(after.as_array().unwrap().len(), 1);
    let stored = tap
        .export("provider-traces", &[])
        .iter()
        .filter(|t| t["session_id"] == CLAUDE_SESSION)
        .count();
    assert_eq!(count(&after[0]), count(&before[0]) + 1);
    assert_eq!(count(&after[0]), stored);
}

/// "Copy as curl" of calls whose sender chose a hostile method, header value and body, pasted into bash with a
/// fake `curl` first on PATH: bash runs that curl and nothing else (a `pwned` command, also on PATH, would leave
/// a marker), and curl gets exactly the call's method, URL, headers and body bytes (stdin).
#[tokio::test(flavor = "multi_thread")]
async fn copy_as_curl_of_a_hostile_call_runs_only_curl_with_the_call_as_sent() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), &dir.path().join("data"));
    let base = format!("http://{}", tap.viewer_addr.expect("viewer enabled"));
    let client = client();

    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let marker = dir.path().join("pwned-marker");
    let script = |name: &str, text: &str| {
        let p = bin.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    };
    script(
        "curl",
        "#!/bin/sh\n: > \"$CURL_OUT.args\"\nfor a in \"$@\"; do printf '%s\\0' \"$a\" >> \"$CURL_OUT.args\"; done\n\
         cat > \"$CURL_OUT.stdin\"\n",
    );
    script("pwned", "#!/bin/sh\necho \"$0 $*\" >> \"$MARKER\"\n");

    // (method, content-type, body sent, the body as stored: JSON text, a body that is not JSON as a JSON string)
    let terminator_body = "line one\nLLMTAP_EOF\npwned\n'$(pwned)' `pwned`\nLLMTAP_EOF";
    let calls: Vec<(&str, &str, String, String)> = vec![
        (
            "X|pwned",
            "text/plain'; pwned; '",
            terminator_body.to_owned(),
            serde_json::to_string(terminator_body).unwrap(),
        ),
        (
            "X`pwned`&pwned&",
            "application/json",
            // One line of JSON with a tab, DEL and a C1 control (all valid raw in JSON), quotes, % and \.
            "{\"m\":\"it's 100% $(pwned) `pwned` \\\\ \\u0041\",\t\"d\":\"\u{7f}\u{9b}\"}".to_owned(),
            "{\"m\":\"it's 100% $(pwned) `pwned` \\\\ \\u0041\",\t\"d\":\"\u{7f}\u{9b}\"}".to_owned(),
        ),
        ("X'|pwned|'", "application/json", "-1\t".to_owned(), "-1\t".to_owned()),
    ];
    for (method, content_type, body, _) in &calls {
        send(
            &client,
            method,
            &tap.url("/anthropic/v1/messages"),
            &[("content-type", content_type), ("anthropic-version", "2023-06-01")],
            body.clone().into_bytes(),
        )
        .await;
    }
    let traces = tap.wait_for_traces(calls.len());
    let scheme = if up.ca_pem_path.exists() { "https" } else { "http" };
    let url = format!("{scheme}://127.0.0.1:{}/v1/messages", up.addr.port());
    for (i, (method, content_type, _, stored)) in calls.iter().enumerate() {
        let trace = traces.iter().find(|t| t["method"] == *method).expect(method);
        let call = get_json(&client, &format!("{base}/api/calls/{}", trace["id"].as_str().unwrap())).await;
        let cmd = call["curl"].as_str().unwrap();
        assert!(
            !cmd.chars().any(|c| c.is_control() && c != '\n'),
            "a control character a terminal would act on: {cmd:?}"
        );
        let out_base = dir.path().join(format!("curl-{i}"));
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        let out = Command::new("bash")
            .arg("-c")
            .arg(cmd)
            .current_dir(dir.path())
            .env("PATH", path)
            .env("CURL_OUT", &out_base)
            .env("MARKER", &marker)
            .env("ANTHROPIC_API_KEY", "test-key-42")
            .output()
            .unwrap();
        assert!(!marker.exists(), "{method}: an injected command ran: {cmd}");
        assert!(
            out.status.success(),
            "{method}: {cmd}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let args = std::fs::read(out_base.with_extension("args")).unwrap();
        let args: Vec<String> = args
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8(a.to_vec()).unwrap())
            .collect();
        assert_eq!(args[..5], ["-sS", "-X", method, &url, "-H"], "{cmd}");
        assert_eq!(args[5], "x-api-key: test-key-42", "{cmd}");
        let (headers, tail) = args[6..].split_at(args.len() - 8);
        let mut headers: Vec<&str> = headers
            .chunks(2)
            .map(|p| {
                assert_eq!(p[0], "-H", "{cmd}");
                p[1].as_str()
            })
            .collect();
        headers.sort_unstable();
        let want_type = format!("content-type: {content_type}");
        assert_eq!(headers, ["anthropic-version: 2023-06-01", want_type.as_str()], "{cmd}");
        assert_eq!(tail, ["--data-binary", "@-"], "{cmd}");
        let stdin = std::fs::read(out_base.with_extension("stdin")).unwrap();
        assert_eq!(String::from_utf8_lossy(&stdin), *stored, "{cmd}");
    }
}
