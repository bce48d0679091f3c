//! Search through the real binary: recorded calls replayed through llmtap (a recorded agent session, and
//! recorded OpenAI and Anthropic calls whose prompts are replaced by English, German and Japanese text), then
//! the viewer's `GET /api/search` with each filter, the same answers from the shared PostgreSQL store, and
//! Debian's Chromium (tests/browser/search.mjs through playwright-core) typing a phrase from a tool result into
//! the page's search box and opening its step. Screenshots land in target/screenshots/.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::browser::{require_browser, run_script};
use common::*;
use serde_json::{Value, json};

const SESSION: &str = "pydantic-ai__anthropic_parallel_tools_agent";
/// A phrase of one of that session's tool results.
const TOOL_PHRASE: &str = "charlie's younger sister";

fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

async fn search(client: &Client, tap: &Llmtap, params: &[(&str, &str)]) -> (u16, Value) {
    let query: Vec<String> = params.iter().map(|(k, v)| format!("{k}={}", enc(v))).collect();
    let url = format!("http://{}/api/search?{}", tap.viewer_addr.unwrap(), query.join("&"));
    let r = send(client, "GET", &url, &[], Vec::new()).await;
    (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
}

/// The hits of a search that must succeed.
async fn hits(client: &Client, tap: &Llmtap, params: &[(&str, &str)]) -> Vec<Value> {
    let (status, body) = search(client, tap, params).await;
    assert_eq!(status, 200, "{params:?}: {body}");
    body["hits"].as_array().unwrap().clone()
}

/// Search is indexed behind capture: poll until `params` finds `n` steps.
async fn wait_for_hits(client: &Client, tap: &Llmtap, params: &[(&str, &str)], n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = hits(client, tap, params).await;
        if found.len() >= n {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "{params:?} found {} of {n}: {found:#?}",
            found.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn marks(hit: &Value) -> Vec<String> {
    hit["snippet"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["hit"] == true)
        .map(|p| p["text"].as_str().unwrap().to_owned())
        .collect()
}

fn ids(hits: &[Value]) -> Vec<&str> {
    hits.iter().map(|h| h["step_id"].as_str().unwrap()).collect()
}

/// A recorded non-streamed call of `upstream` that succeeded, or the recorded 401 of OpenAI's chat API.
fn recording(upstream: &str) -> Fixture {
    if upstream == "error" {
        return fixture("errors_edge/dd-trace-py__openai_chat_401_invalid_api_key");
    }
    all_fixtures()
        .into_iter()
        .find(|f| {
            f.upstream == upstream
                && f.status == 200
                && f.kind == BodyKind::Json
                && (f.name.starts_with("openai_chat/") || f.name.starts_with("anthropic_messages/"))
        })
        .unwrap()
}

/// `f`'s request with its conversation replaced by one user message, sent as agent `agent`; answered with
/// `f`'s recorded response.
async fn ask(client: &Client, tap: &Llmtap, f: &Fixture, agent: &str, text: &str) {
    let mut body: Value = serde_json::from_slice(&f.request).unwrap();
    body["messages"] = json!([{ "role": "user", "content": text }]);
    let r = send(
        client,
        "POST",
        &tap.url(&f.client_path),
        &[
            ("content-type", "application/json"),
            ("x-replay-fixture", f.name.as_str()),
            ("x-llmtap-agent", agent),
        ],
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, f.status, "{}: {}", f.name, String::from_utf8_lossy(&r.body));
}

/// The calls every test searches: the recorded agent session, then prompts in three languages to OpenAI and
/// Anthropic, one of them refused (401), and one more after `split` (RFC 3339, returned). Returns the number
/// of calls and `split`.
async fn send_corpus(client: &Client, tap: &Llmtap) -> (usize, String) {
    let agent = session(SESSION);
    for f in &agent {
        assert_eq!(send_fixture(client, tap, f, &[]).await.status, f.status, "{}", f.name);
    }
    let (openai, anthropic, refused) = (recording("openai"), recording("anthropic"), recording("error"));
    ask(client, tap, &openai, "scout", "東京タワーの高さは何メートルですか").await;
    ask(
        client,
        tap,
        &anthropic,
        "chef",
        "Wie schmeckt die Crème brûlée in Zürich?",
    )
    .await;
    ask(client, tap, &openai, "chef", "A crème brûlée recipe, please").await;
    ask(client, tap, &refused, "chef", "A failing crème brûlée call").await;
    tap.wait_for_traces(agent.len() + 4);
    let split = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    ask(client, tap, &anthropic, "scout", "CRÈME BRÛLÉE again, later").await;
    tap.wait_for_traces(agent.len() + 5);
    (agent.len() + 5, split)
}

#[tokio::test(flavor = "multi_thread")]
async fn search_api_filters_by_model_agent_errors_cost_and_time_and_finds_non_english_text() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    let (_, split) = send_corpus(&client, &tap).await;

    // Japanese: a word inside a sentence without spaces, by the trigram index and (two characters) by a scan.
    let tokyo = wait_for_hits(&client, &tap, &[("q", "東京タワー")], 1).await;
    assert_eq!(tokyo.len(), 1, "{tokyo:#?}");
    assert_eq!(tokyo[0]["field"], "prompt");
    assert_eq!(tokyo[0]["agent"], "scout");
    assert_eq!(marks(&tokyo[0]), ["東京タワー"]);
    assert_eq!(ids(&hits(&client, &tap, &[("q", "東京")]).await), ids(&tokyo));
    assert_eq!(ids(&hits(&client, &tap, &[("q", "メートル")]).await), ids(&tokyo));

    // Accented text, any case; the snippet keeps the text as captured. Accents matter.
    let brulee = wait_for_hits(&client, &tap, &[("q", "crème brûlée")], 4).await;
    assert_eq!(brulee.len(), 4, "{brulee:#?}");
    assert_eq!(marks(&brulee[0]), ["CRÈME", "BRÛLÉE"], "newest first: {brulee:#?}");
    assert_eq!(hits(&client, &tap, &[("q", "zürich")]).await.len(), 1);
    assert!(hits(&client, &tap, &[("q", "creme brulee")]).await.is_empty());
    // Every term must occur.
    assert!(hits(&client, &tap, &[("q", "brûlée 東京")]).await.is_empty());

    // Agent.
    let chef = hits(&client, &tap, &[("q", "brûlée"), ("agent", "chef")]).await;
    assert_eq!(chef.len(), 3, "{chef:#?}");
    assert!(chef.iter().all(|h| h["agent"] == "chef"));

    // Model (part of `upstream/model`): a user's step goes by the call that answered it.
    let claude = hits(&client, &tap, &[("q", "brûlée"), ("model", "anthropic/")]).await;
    assert_eq!(claude.len(), 2, "{claude:#?}");
    assert!(
        claude
            .iter()
            .all(|h| h["model"].as_str().unwrap().starts_with("anthropic/"))
    );
    let openai = hits(&client, &tap, &[("q", "brûlée"), ("model", "openai/")]).await;
    assert_eq!(openai.len(), 2, "{openai:#?}");
    let mut all = ids(&claude);
    all.extend(ids(&openai));
    all.sort();
    let mut expected = ids(&brulee);
    expected.sort();
    assert_eq!(all, expected);

    // Errors only: the prompt whose call was refused, and the refusal's own error text.
    let failed = hits(&client, &tap, &[("q", "brûlée"), ("errors", "1")]).await;
    assert_eq!(failed.len(), 1, "{failed:#?}");
    assert_eq!(marks(&failed[0]), ["brûlée"]);
    assert_eq!(failed[0]["error"], true);
    let step_errors = hits(&client, &tap, &[("q", "api key"), ("errors", "1")]).await;
    assert!(
        step_errors
            .iter()
            .any(|h| h["field"] == "error" && h["role"] == "agent"),
        "{step_errors:#?}"
    );

    // Cost: the threshold between the calls' own costs keeps only the dearer ones.
    let priced: Vec<f64> = brulee
        .iter()
        .filter_map(|h| h["cost_usd"].as_str().map(|c| c.parse().unwrap()))
        .collect();
    let (low, high) = priced
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), c| (l.min(*c), h.max(*c)));
    assert!(low < high, "two different costs to split: {priced:?} {brulee:#?}");
    let mid = ((low + high) / 2.0).to_string();
    let dear = hits(&client, &tap, &[("q", "brûlée"), ("min_cost", &mid)]).await;
    assert!(!dear.is_empty());
    assert!(
        dear.iter()
            .all(|h| h["cost_usd"].as_str().unwrap().parse::<f64>().unwrap() > low)
    );
    let cheap = hits(&client, &tap, &[("q", "brûlée"), ("max_cost", &mid)]).await;
    assert!(!cheap.is_empty());
    assert_eq!(dear.len() + cheap.len(), priced.len(), "{dear:#?} {cheap:#?}");

    // Time.
    let later = hits(&client, &tap, &[("q", "brûlée"), ("since", &split)]).await;
    assert_eq!(later.len(), 1, "{later:#?}");
    assert_eq!(marks(&later[0]), ["BRÛLÉE"]);
    assert_eq!(
        hits(&client, &tap, &[("q", "brûlée"), ("until", &split)]).await.len(),
        3
    );

    // A phrase from a tool result: the agent step that received it.
    let tool = hits(&client, &tap, &[("q", TOOL_PHRASE)]).await;
    assert!(tool.iter().any(|h| h["field"] == "tool_result"), "{tool:#?}");

    // Bad requests are told why.
    for bad in [
        vec![("q", "  ")],
        vec![("q", "x"), ("since", "yesterday")],
        vec![("q", "x"), ("min_cost", "cheap")],
    ] {
        let (status, body) = search(&client, &tap, &bad).await;
        assert_eq!(status, 400, "{bad:?}: {body}");
        assert!(body["error"].as_str().is_some(), "{body}");
    }
}

/// The queries compared between the two stores.
const SAME_QUERIES: [&[(&str, &str)]; 7] = [
    &[("q", "東京タワー")],
    &[("q", "東京")],
    &[("q", "crème brûlée")],
    &[("q", "brûlée"), ("agent", "chef"), ("model", "openai/")],
    &[("q", "brûlée"), ("errors", "1")],
    &[("q", TOOL_PHRASE)],
    &[("q", "alice")],
];

#[tokio::test(flavor = "multi_thread")]
async fn the_same_search_answers_the_same_from_the_shared_postgresql_store() {
    let pg = postgres::server();
    let url = pg.database("search_same_answers");
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let shared_config = upstream_config(&up, &format!("[store]\nurl = \"{url}\"\n"));
    let mut tap = Llmtap::start(&shared_config, dir.path());
    let client = client();
    let (sent, _) = send_corpus(&client, &tap).await;
    let delivered = || {
        pg.psql(&url, "SELECT count(*) FROM traces")
            .trim()
            .parse::<usize>()
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while delivered() < sent {
        assert!(
            Instant::now() < deadline,
            "PostgreSQL holds {} of {sent} calls",
            delivered()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(tap.terminate().success());
    // One llmtap reading the local store, one (with an empty data dir of its own) reading the shared one.
    let local = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let shared = Llmtap::start(&shared_config, empty.path());
    for q in SAME_QUERIES {
        // Later versions of steps follow their calls to PostgreSQL; the local index follows the store.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (l, s) = (hits(&client, &local, q).await, hits(&client, &shared, q).await);
            if l == s && !l.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "{q:?}: local {l:#?}\nshared {s:#?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // `llmtap search` reads through the same query, from either store.
    let cli = |store: &[&str]| {
        let mut c = llmtap_command();
        c.args(["search", "crème", "--agent", "chef", "--json"]).args(store);
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let from_local = cli(&["--data-dir", dir.path().to_str().unwrap()]);
    assert_eq!(from_local.lines().count(), 3, "{from_local}");
    assert_eq!(
        from_local,
        cli(&["--store", &url, "--data-dir", empty.path().to_str().unwrap()])
    );
    // The trigram index exists (pg_trgm is there) and is what a search query uses.
    assert_eq!(
        pg.psql(
            &url,
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'search_docs_text'"
        )
        .trim(),
        "1"
    );
    // Not vacuous: the shared store found steps of every kind.
    let tool = hits(&client, &shared, &[("q", TOOL_PHRASE)]).await;
    assert!(tool.iter().any(|h| h["field"] == "tool_result"), "{tool:#?}");
    assert_eq!(hits(&client, &shared, &[("q", "crème brûlée")]).await.len(), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn chromium_finds_a_phrase_from_a_tool_result_and_opens_its_step() {
    let chromium = require_browser();
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let client = client();
    send_corpus(&client, &tap).await;
    // Captured text that looks like markup.
    let hostile = "<img src=x onerror=alert(1)><b>bold needle</b>";
    ask(&client, &tap, &recording("openai"), "scout", hostile).await;

    // The step whose tool result holds the phrase, as the store has it.
    let (trajectory, step) = tap
        .steps_by_trajectory()
        .into_iter()
        .flat_map(|(t, steps)| steps.into_iter().map(move |s| (t.clone(), s)))
        .find(|(_, s)| {
            s["observations"].as_array().is_some_and(|o| {
                o.iter()
                    .any(|o| o["content"].as_str().is_some_and(|c| c.contains(TOOL_PHRASE)))
            })
        })
        .expect("a step received the tool result");
    let step_id = step["step_id"].as_str().unwrap().to_owned();
    // Typed as a person searches a phrase: in quotes.
    let phrase = format!("\"{TOOL_PHRASE}\"");
    let found = wait_for_hits(&client, &tap, &[("q", &phrase)], 1).await;
    assert!(ids(&found).contains(&step_id.as_str()), "{found:#?}");
    wait_for_hits(&client, &tap, &[("q", "bold needle")], 1).await;

    let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");
    let report = run_script(
        &chromium,
        "search.mjs",
        &[
            &format!("http://{}/", tap.viewer_addr.unwrap()),
            &phrase,
            &step_id,
            &shots.display().to_string(),
            "bold needle",
        ],
    );
    assert!(report.get("error").is_none(), "{report:#}");
    assert_eq!(report["console_errors"], json!([]), "{report:#}");
    assert_eq!(report["dialogs"], json!([]), "{report:#}");

    // The results page lists the step with the phrase marked in its snippet.
    assert!(
        report["hash"].as_str().unwrap().starts_with("#/search?q="),
        "{report:#}"
    );
    let listed = report["hits"].as_array().unwrap();
    let hit = listed
        .iter()
        .find(|h| h["step"] == step_id.as_str())
        .unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(hit["marks"], json!([TOOL_PHRASE]), "{hit:#}");
    assert!(hit["meta"].as_str().unwrap().contains("tool result"), "{hit:#}");
    assert_eq!(listed.len(), found.len());

    // Opening it: the session page, the step's trajectory selected, the step shown and marked with its result.
    let opened = &report["opened"];
    assert_eq!(opened["selected"], trajectory.as_str(), "{opened:#}");
    assert_eq!(opened["index"], step["step_index"].to_string(), "{opened:#}");
    assert_eq!(opened["found_cards"], 1);
    assert_eq!(opened["in_view"], true);
    assert!(
        opened["results"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_str().unwrap().contains(TOOL_PHRASE)),
        "{opened:#}"
    );

    // Markup in captured text is shown as text: no element but the marks, no script ran.
    let hostile_hits = report["hostile"].as_array().unwrap();
    assert_eq!(hostile_hits.len(), 1, "{report:#}");
    assert_eq!(hostile_hits[0]["elements"], json!(["mark", "mark"]));
    assert!(
        hostile_hits[0]["snippet"].as_str().unwrap().contains(hostile),
        "{:#}",
        hostile_hits[0]
    );
}
