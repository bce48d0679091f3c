//! The shared PostgreSQL store (`[store] url`) through the real binary and a real PostgreSQL server
//! (tests/common/postgres.rs): every recorded session lands there and every query answers the same from it
//! as from the local SQLite store (the CLI, the viewer's JSON API, every export format); PostgreSQL stopped for
//! 30 s under traffic loses and doubles nothing while the traffic flows; a replica killed with -9 delivers
//! what it had stored once it is back.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::nginx::{Balance, Nginx};
use common::*;
use serde_json::Value;

/// The tests of this file share one PostgreSQL server, and two of them stop it: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn shared_config(up: &Upstream, url: &str) -> String {
    upstream_config(up, &format!("[store]\nurl = \"{url}\"\n"))
}

/// `llmtap <args> --store URL` (the shared store) or `--data-dir` (the local one): stdout.
fn cli(args: &[&str], store: Store<'_>) -> String {
    let mut c = llmtap_command();
    c.args(args);
    match store {
        Store::Local(dir) => c.arg("--data-dir").arg(dir),
        // An empty data dir of its own: the answer can only come from the shared store.
        Store::Shared(url, dir) => c.arg("--store").arg(url).arg("--data-dir").arg(dir),
    };
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "llmtap {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[derive(Clone, Copy)]
enum Store<'a> {
    Local(&'a Path),
    Shared(&'a str, &'a Path),
}

fn lines(text: &str) -> Vec<Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// What the CLI answers from one store, for comparing two.
fn cli_answers(store: Store<'_>) -> Vec<(String, Value)> {
    let mut out = vec![
        (
            "sessions".to_owned(),
            Value::Array(lines(&cli(&["sessions", "--json"], store))),
        ),
        (
            "traces".to_owned(),
            Value::Array(lines(&cli(&["traces", "--json"], store))),
        ),
    ];
    for format in [
        "provider-traces",
        "steps",
        "atif",
        "opentraces",
        "invariant",
        "letta",
        "localharness",
    ] {
        out.push((
            format.to_owned(),
            Value::Array(lines(&cli(&["export", "--format", format], store))),
        ));
    }
    let turnwise: Value = serde_json::from_str(cli(&["export", "--format", "turnwise"], store).trim()).unwrap();
    out.push(("turnwise".into(), turnwise));
    out
}

/// Replay every recorded agent session through `tap`; returns how many calls were sent.
async fn replay_all(tap: &Llmtap) -> usize {
    let client = client();
    let mut n = 0;
    for name in session_names() {
        for f in session(&name) {
            assert_eq!(send_fixture(&client, tap, &f, &[]).await.status, f.status, "{}", f.name);
            n += 1;
        }
    }
    n
}

/// Poll until `done` holds, for at most `secs`.
fn wait_until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A count from the shared store; 0 while llmtap has not created its tables yet (it does on first delivery).
fn count(pg: &postgres::Postgres, url: &str, sql: &str) -> usize {
    if pg.psql(url, "SELECT to_regclass('public.traces') IS NOT NULL").trim() != "t" {
        return 0;
    }
    pg.psql(url, sql).trim().parse().unwrap()
}

async fn get_json(client: &Client, url: &str) -> Value {
    let r = send(client, "GET", url, &[], Vec::new()).await;
    assert_eq!(r.status, 200, "{url}: {}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

/// The viewer's answers for every session: the list, each session, each trajectory's steps, each call.
async fn viewer_answers(tap: &Llmtap) -> Vec<(String, Value)> {
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let client = client();
    let mut out = Vec::new();
    let list = get_json(&client, &format!("{base}/api/sessions?limit=500")).await;
    out.push(("/api/sessions".to_owned(), list.clone()));
    for s in list["sessions"].as_array().unwrap() {
        let id = s["id"].as_str().unwrap();
        let path = format!("/api/sessions/{}", urlencode(id));
        let session = get_json(&client, &format!("{base}{path}")).await;
        out.push((path, session.clone()));
        let trajectories: Vec<String> = session["trajectories"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap().to_owned())
            .collect();
        let mut calls = Vec::new();
        for t in trajectories {
            let path = format!("/api/trajectories/{}/steps", urlencode(&t));
            let steps = get_json(&client, &format!("{base}{path}")).await;
            collect_ids(&steps, "provider_trace_id", &mut calls);
            out.push((path, steps));
        }
        calls.sort();
        calls.dedup();
        for c in calls {
            let path = format!("/api/calls/{}", urlencode(&c));
            out.push((path.clone(), get_json(&client, &format!("{base}{path}")).await));
        }
    }
    out
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every string value of `key` anywhere in `v`.
fn collect_ids(v: &Value, key: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == key
                    && let Some(s) = x.as_str()
                {
                    out.push(s.to_owned());
                }
                collect_ids(x, key, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect_ids(x, key, out)),
        _ => {}
    }
}

fn assert_same(what: &str, local: &[(String, Value)], shared: &[(String, Value)]) {
    assert_eq!(local.len(), shared.len(), "{what}: as many answers");
    for ((name, l), (_, s)) in local.iter().zip(shared) {
        if let Some((at, a, b)) = first_difference(l, s, String::new()) {
            panic!("{what} {name}: the shared store answers otherwise at {at}: local {a}, shared {b}");
        }
    }
}

/// Where two JSON values first differ (a JSON pointer), with both sides there.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<(String, String, String)> {
    let short = |v: &Value| v.to_string().chars().take(300).collect::<String>();
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => {
                        if let Some(d) = first_difference(v, w, format!("{at}/{k}")) {
                            return Some(d);
                        }
                    }
                    None => return Some((format!("{at}/{k}"), short(v), "absent".into())),
                }
            }
            y.keys()
                .find(|k| !x.contains_key(*k))
                .map(|k| (format!("{at}/{k}"), "absent".into(), short(&y[k])))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some((at, short(a), short(b))),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_answers_the_same_from_the_shared_store_as_from_the_local_one() {
    let _serial = SERIAL.lock().await;
    let pg = postgres::server();
    let url = pg.database("same_answers");
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let mut tap = Llmtap::start(&shared_config(&up, &url), dir.path());
    let sent = replay_all(&tap).await;
    assert_eq!(tap.wait_for_traces(sent).len(), sent);

    // Delivery is asynchronous: wait until the shared store holds every call, then until the two stores'
    // answers agree (later versions of steps and summaries follow their calls).
    wait_until("every call in PostgreSQL", 30, || {
        count(pg, &url, "SELECT count(*) FROM traces") == sent
    });
    let local = Store::Local(dir.path());
    let shared = Store::Shared(&url, empty.path());
    wait_until("the shared store to answer as the local one", 30, || {
        cli_answers(local) == cli_answers(shared)
    });
    let from_local = cli_answers(local);
    assert_same("CLI", &from_local, &cli_answers(shared));
    // Not vacuous: every session and call is there.
    let sessions = &from_local[0].1;
    assert!(
        sessions.as_array().unwrap().len() >= session_names().len(),
        "{sessions}"
    );
    assert_eq!(from_local[1].1.as_array().unwrap().len(), sent);

    // The viewer's JSON API: one llmtap reading the local store, another (with an empty data dir of its own)
    // reading the shared one.
    assert!(tap.terminate().success());
    let local_viewer = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let shared_viewer = Llmtap::start(&shared_config(&up, &url), empty.path());
    let l = viewer_answers(&local_viewer).await;
    let s = viewer_answers(&shared_viewer).await;
    assert!(
        l.len() > session_names().len() * 3,
        "sessions, trajectories and calls were read: {}",
        l.len()
    );
    assert_same("viewer", &l, &s);

    // A second delivery of everything (a replica that lost its cursor) changes nothing: upserts by id.
    let before = pg.psql(&url, "SELECT count(*), sum(length(head)) FROM traces");
    let steps_before = pg.psql(&url, "SELECT count(*), sum(length(body)) FROM steps");
    drop(shared_viewer);
    drop(local_viewer);
    // Every record logged for delivery once more, behind the sink's cursor.
    let db = rusqlite::Connection::open(dir.path().join("llmtap.sqlite")).unwrap();
    let relogged = db
        .execute(
            "INSERT INTO ship_log (kind, ref) SELECT 'trace', id FROM traces UNION ALL
             SELECT 'step', step_id FROM steps UNION ALL SELECT 'trajectory', trajectory_id FROM trajectories",
            [],
        )
        .unwrap();
    assert!(relogged > sent * 2, "{relogged} records logged again");
    drop(db);
    let again = Llmtap::start(&shared_config(&up, &url), dir.path());
    wait_until("the ship log delivered again", 30, || cursor_at_head(dir.path()));
    assert!(
        again.metric("llmtap_exported_total") as usize >= relogged,
        "{}",
        again.metrics()
    );
    assert_eq!(pg.psql(&url, "SELECT count(*), sum(length(head)) FROM traces"), before);
    assert_eq!(
        pg.psql(&url, "SELECT count(*), sum(length(body)) FROM steps"),
        steps_before
    );
    assert_same("CLI after a second delivery", &cli_answers(local), &cli_answers(shared));
}

/// The shared-store sink's cursor has reached the end of the ship log.
fn cursor_at_head(dir: &Path) -> bool {
    let db = rusqlite::Connection::open(dir.join("llmtap.sqlite")).unwrap();
    let head: i64 = db
        .query_row("SELECT COALESCE(MAX(seq), 0) FROM ship_log", [], |r| r.get(0))
        .unwrap();
    let cursor: i64 = db
        .query_row(
            "SELECT COALESCE((SELECT seq FROM cursors WHERE sink = 'shared-store'), 0)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    head > 0 && cursor >= head
}

/// Replays the recorded sessions in a loop under fresh session ids until `stop`, counting calls; every call
/// must succeed whatever happens to the database.
fn traffic(
    tap_addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = client();
        let base = format!("http://{tap_addr}");
        let mut round = 0;
        while !stop.load(Ordering::SeqCst) {
            round += 1;
            for name in session_names() {
                let key = format!("round-{round}-{name}");
                for f in session(&name) {
                    let headers = [
                        ("content-type", "application/json"),
                        ("x-replay-fixture", f.name.as_str()),
                        ("x-llmtap-session", key.as_str()),
                    ];
                    let reply = send(
                        &client,
                        &f.method,
                        &format!("{base}{}", f.client_path),
                        &headers,
                        f.request.clone(),
                    )
                    .await;
                    assert_eq!(reply.status, f.status, "{} while the database is away", f.name);
                    sent.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_for_30_seconds_under_traffic_loses_and_doubles_nothing() {
    let _serial = SERIAL.lock().await;
    let pg = postgres::server();
    let url = pg.database("outage");
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&shared_config(&up, &url), dir.path());
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let load = traffic(tap.addr, stop.clone(), sent.clone());
    wait_until("calls delivered before the outage", 30, || {
        count(pg, &url, "SELECT count(*) FROM traces") > 0
    });

    pg.stop();
    let outage = Instant::now();
    let at_stop = sent.load(Ordering::SeqCst);
    // The outage lasts 30 s of traffic (the test's subject, not a stand-in for an event).
    while outage.elapsed() < Duration::from_secs(30) {
        assert!(!load.is_finished(), "traffic failed during the outage");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let during = sent.load(Ordering::SeqCst) - at_stop;
    assert!(during > 20, "traffic flowed during the outage: {during} calls");
    pg.start();
    stop.store(true, Ordering::SeqCst);
    load.await.unwrap();
    let total = sent.load(Ordering::SeqCst);

    let local = tap.wait_for_traces(total);
    assert_eq!(local.len(), total, "every call captured locally");
    wait_until("every call delivered after the outage", 60, || {
        count(pg, &url, "SELECT count(*) FROM traces") == total
    });
    // Nothing doubled: as many rows as distinct ids, and exactly the local ids.
    let mut ids: Vec<String> = local.iter().map(|t| t["id"].as_str().unwrap().to_owned()).collect();
    ids.sort();
    let shared: Vec<String> = pg
        .psql(&url, "SELECT id FROM traces ORDER BY id")
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(shared, ids);
    // Every trajectory's calls counted once across its parts.
    let empty = tempfile::tempdir().unwrap();
    wait_until("sessions to agree", 30, || {
        lines(&cli(&["sessions", "--json"], Store::Local(dir.path())))
            == lines(&cli(&["sessions", "--json"], Store::Shared(&url, empty.path())))
    });
    // The outage was seen and counted (retries), not silent.
    assert!(tap.metric("llmtap_export_retries_total") > 0, "{}", tap.metrics());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_with_sigkill_delivers_what_it_stored_after_restart() {
    let _serial = SERIAL.lock().await;
    let pg = postgres::server();
    let url = pg.database("killed");
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = shared_config(&up, &url);
    let mut tap = Llmtap::start(&config, dir.path());
    // The database is away while the replica works and dies: what it stored can only be in its spool.
    pg.stop();
    let sent = replay_all(&tap).await;
    tap.wait_for_traces(sent);
    tap.kill9();
    pg.start();
    assert_eq!(
        count(pg, &url, "SELECT count(*) FROM traces"),
        0,
        "nothing delivered while the database was down"
    );

    let _back = Llmtap::start(&config, dir.path());
    wait_until("the restarted replica to deliver its spool", 60, || {
        count(pg, &url, "SELECT count(*) FROM traces") == sent
    });
    let empty = tempfile::tempdir().unwrap();
    wait_until("the stores to agree", 30, || {
        cli_answers(Store::Local(dir.path())) == cli_answers(Store::Shared(&url, empty.path()))
    });
}

#[test]
fn a_url_that_is_not_postgres_or_cannot_be_reached_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = llmtap_command()
        .args([
            "sessions",
            "--store",
            "postgres://nobody@127.0.0.1:1/none",
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("shared store postgres://nobody@127.0.0.1:1/none"), "{err}");
    assert!(err.contains("cannot connect"), "{err}");
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "[store]\nurl = \"mysql://u:secret@h/db\"\n").unwrap();
    let out = llmtap_command()
        .args(["check-config", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("store.url"), "{err}");
    assert!(!err.contains("secret"), "the password is never printed: {err}");
}

/// The session in a viewer's list holding trajectory `id` (the list names sessions; a session's page names its
/// trajectories).
async fn viewer_session_of(tap: &Llmtap, id: &str) -> Value {
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let client = client();
    get_json(&client, &format!("{base}/api/sessions/{}", urlencode(id))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_code_session_balanced_round_robin_over_two_replicas_is_one_session_with_its_links() {
    let _serial = SERIAL.lock().await;
    let Some(bin) = common::claude::claude_binary() else {
        eprintln!("SKIP: no native Claude Code build for this platform");
        return;
    };
    let pg = postgres::server();
    let url = pg.database("round_robin");
    let up = common::scripted::Scripted::start().await;
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let config = shared_config(&up, &url);
    let a = Llmtap::start(&config, dirs[0].path());
    let b = Llmtap::start(&config, dirs[1].path());
    let nginx_dir = tempfile::tempdir().unwrap();
    let nginx = Nginx::start(&[a.addr, b.addr], Balance::RoundRobin, nginx_dir.path()).await;

    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let mut claude = std::process::Command::new(&bin);
    claude
        .current_dir(project.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CLAUDE_CONFIG_DIR", home.path().join(".claude"))
        .env("ANTHROPIC_BASE_URL", format!("{}/anthropic", nginx.url()))
        .env("ANTHROPIC_API_KEY", "sk-ant-api03-SHAREDSECRET")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .args(["-p", "[[tool:Task]] Delegate saying hi to a helper."])
        .args(["--output-format", "json", "--allowedTools", "Bash"]);
    let run = common::clients::run_client(claude, 90).await;
    assert!(
        run.stdout.contains(common::scripted::SCRIPTED_TEXT),
        "{}\n{}",
        run.stdout,
        up.dump()
    );
    let calls = up.model_calls().len();
    assert!(calls >= 4, "a main run with a Task sub-agent: {}", up.dump());

    // nginx sent the calls to both replicas.
    let used: std::collections::BTreeSet<String> = nginx
        .access_log()
        .into_iter()
        .map(|(_, upstream, _)| upstream)
        .collect();
    assert!(
        used.contains(&a.addr.to_string()) && used.contains(&b.addr.to_string()),
        "round-robin over both replicas: {used:?}"
    );
    let local_a = a.wait_for_traces(1).len();
    let local_b = b.wait_for_traces(1).len();
    assert!(
        local_a > 0 && local_b > 0,
        "round-robin split the calls: {local_a} + {local_b}"
    );
    let total = local_a + local_b;
    wait_until("both replicas' calls in PostgreSQL", 30, || {
        count(pg, &url, "SELECT count(*) FROM traces") == total
    });

    // One session in the shared store, with the sub-agent linked to its main trajectory.
    let empty = tempfile::tempdir().unwrap();
    let shared = Store::Shared(&url, empty.path());
    let linked = |groups: &[Value]| -> Option<(String, String)> {
        let claude: Vec<&Value> = groups
            .iter()
            .filter(|g| g["trajectories"].to_string().contains("subagent"))
            .collect();
        let [group] = claude.as_slice() else { return None };
        let trajectories = group["trajectories"].as_array()?;
        let sub = trajectories.iter().find(|t| t["parent_trajectory_id"].is_string())?;
        let parent = sub["parent_trajectory_id"].as_str()?;
        let sub_id = sub["trajectory_id"].as_str()?;
        trajectories
            .iter()
            .any(|t| t["trajectory_id"] == parent)
            .then(|| (parent.to_owned(), sub_id.to_owned()))
    };
    let mut found = None;
    wait_until("one Claude Code session with its sub-agent linked", 30, || {
        found = linked(&lines(&cli(&["sessions", "--json"], shared)));
        found.is_some()
    });
    let (main_id, sub_id) = found.unwrap();
    let groups = lines(&cli(&["sessions", "--json"], shared));
    let session = groups
        .iter()
        .find(|g| g["trajectories"].to_string().contains(&sub_id))
        .unwrap();
    let session_calls: u64 = session["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["llm_calls"].as_u64().unwrap())
        .sum();
    // Counted once each, whichever replica took them: the calls the shared store holds for these trajectories.
    let ids: Vec<&str> = session["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["trajectory_id"].as_str().unwrap())
        .collect();
    let traces = lines(&cli(&["traces", "--json"], shared));
    let in_session = traces
        .iter()
        .filter(|t| t["trajectory_id"].as_str().is_some_and(|id| ids.contains(&id)))
        .count();
    assert_eq!(
        session_calls as usize, in_session,
        "every call of both replicas counted once: {session:#}"
    );
    assert!(in_session >= 4, "{session:#}");
    let replicas: std::collections::BTreeSet<String> = pg
        .psql(&url, "SELECT DISTINCT replica FROM traces")
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(replicas.len(), 2, "calls from both replicas: {replicas:?}");

    // The viewer of either replica shows the same session, the sub-agent under its parent.
    for tap in [&a, &b] {
        let page = viewer_session_of(tap, &main_id).await;
        let ts = page["trajectories"].as_array().unwrap();
        let sub = ts
            .iter()
            .find(|t| t["id"] == sub_id.as_str())
            .unwrap_or_else(|| panic!("{page:#}"));
        assert_eq!(sub["parent_trajectory_id"], main_id.as_str(), "{page:#}");
        assert!(ts.iter().any(|t| t["id"] == main_id.as_str()), "{page:#}");
    }
    assert_eq!(
        viewer_session_of(&a, &main_id).await,
        viewer_session_of(&b, &main_id).await,
        "both replicas' viewers read one store"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_applies_in_the_shared_store_and_a_newer_schema_is_refused() {
    let _serial = SERIAL.lock().await;
    let pg = postgres::server();
    let url = pg.database("retention");
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    // A first llmtap creates the schema and delivers one session.
    let config = upstream_config(&up, &format!("[store]\nurl = \"{url}\"\nretention_days = 1\n"));
    let mut tap = Llmtap::start(&config, dir.path());
    let first = session(&session_names()[0]);
    let client = client();
    for f in &first {
        assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
    }
    wait_until("the first session delivered", 30, || {
        count(pg, &url, "SELECT count(*) FROM traces") == first.len()
    });
    assert!(tap.terminate().success());
    // Another replica's rows from three days ago.
    let old = chrono::Utc::now().timestamp_micros() - 3 * 86_400_000_000;
    pg.psql(
        &url,
        &format!(
            "INSERT INTO traces (id, replica, trajectory_id, session_key, started_us, head)
                 SELECT 'old-' || id, 'elsewhere', 'tr_old', 'tr_old', {old}, head FROM traces;
             INSERT INTO trajectory_parts (trajectory_id, replica, session_key, started_us, ended_us, body)
                 VALUES ('tr_old', 'elsewhere', 'tr_old', {old}, {old}, '{{}}');
             INSERT INTO sessions (session_key, started_us, ended_us) VALUES ('tr_old', {old}, {old});"
        ),
    );
    assert_eq!(count(pg, &url, "SELECT count(*) FROM traces"), first.len() * 2);
    // Annotations a viewer of the team made: on the old session and its trajectory, and on the first session.
    pg.psql(
        &url,
        &format!(
            "INSERT INTO annotations (id, target, target_id, session_key, trajectory_id, note, created_us) VALUES
                 ('a-old-session', 'session', 'tr_old', 'tr_old', NULL, 'old', {old}),
                 ('a-old-trajectory', 'trajectory', 'tr_old', 'tr_old', 'tr_old', 'old', {old});
             INSERT INTO annotations (id, target, target_id, session_key, trajectory_id, note, created_us)
                 SELECT 'a-kept', 'session', session_key, session_key, NULL, 'kept', {old}
                 FROM sessions WHERE session_key <> 'tr_old' LIMIT 1;"
        ),
    );
    assert_eq!(count(pg, &url, "SELECT count(*) FROM annotations"), 3);

    // The next start delivers and applies retention there: the old rows go, the new stay.
    let tap = Llmtap::start(&config, dir.path());
    let second = session(&session_names()[1]);
    for f in &second {
        assert_eq!(send_fixture(&client, &tap, f, &[]).await.status, f.status);
    }
    wait_until("old rows deleted by retention", 30, || {
        count(pg, &url, "SELECT count(*) FROM traces WHERE replica = 'elsewhere'") == 0
    });
    wait_until("the second session delivered", 30, || {
        count(pg, &url, "SELECT count(*) FROM traces") == first.len() + second.len()
    });
    assert_eq!(
        pg.psql(&url, "SELECT count(*) FROM sessions WHERE session_key = 'tr_old'")
            .trim(),
        "0"
    );
    // The old session's annotations went with it; the first session's stays.
    assert_eq!(
        pg.psql(&url, "SELECT string_agg(id, ',' ORDER BY id) FROM annotations")
            .trim(),
        "a-kept"
    );
    drop(tap);

    // A database migrated by a newer llmtap is refused, with the versions named.
    pg.psql(&url, "UPDATE llmtap_schema SET version = 99");
    let empty = tempfile::tempdir().unwrap();
    let out = llmtap_command()
        .args(["sessions", "--store", &url, "--data-dir"])
        .arg(empty.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("99") && err.contains("newer"), "{err}");
}
