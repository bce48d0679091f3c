//! The viewer's Replay through the real binary and a scripted upstream: refused while `[viewer] replay` is off,
//! from another site's page and for anything but JSON; served from the viewer's own page, where Debian's
//! Chromium (driven by tests/browser/replay.mjs through playwright-core) edits the model, types a key, replays,
//! and follows the link to the new call and back. Screenshots land in target/screenshots/.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use common::browser::{require_browser, run_script};
use common::scripted::Scripted;
use common::*;
use serde_json::{Value, json};

const KEY: &str = "sk-ant-viewer-replay-5e4d3c2b1a";

/// What the viewer says about replaying `call` (`GET /api/calls/{call}/replay`).
async fn replay_info(base: &str, call: &str) -> Value {
    let r = send(
        &client(),
        "GET",
        &format!("{base}/api/calls/{call}/replay"),
        &[],
        vec![],
    )
    .await;
    serde_json::from_slice(&r.body).unwrap()
}

/// One Anthropic call through llmtap, key in `x-api-key`; its stored trace.
async fn original_call(tap: &Llmtap, stream: bool) -> Value {
    let body = json!({
        "model": "claude-sonnet-4-20250514",
        "max_tokens": 40,
        "stream": stream,
        "messages": [{"role": "user", "content": "Say hi from the viewer"}],
    });
    let r = send(
        &client(),
        "POST",
        &tap.url("/anthropic/v1/messages"),
        &[
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
            ("x-api-key", "sk-ant-original-key"),
        ],
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    tap.wait_for_traces(1).remove(0)
}

async fn post(base: &str, call: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
    send(
        &client(),
        "POST",
        &format!("{base}/api/calls/{call}/replay"),
        headers,
        serde_json::to_vec(body).unwrap(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_is_refused_when_off_from_another_site_and_without_json_and_served_from_the_page() {
    let up = Scripted::start().await;
    let posted = json!({"key": KEY, "model": "claude-from-viewer"});
    let json_ct = ("content-type", "application/json");

    // Off (the default): refused, the page told so, nothing sent.
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let call = original_call(&tap, false).await["id"].as_str().unwrap().to_owned();
    let r = post(&base, &call, &[json_ct], &posted).await;
    assert_eq!(r.status, 403, "{}", String::from_utf8_lossy(&r.body));
    assert!(String::from_utf8_lossy(&r.body).contains("[viewer] replay = true"));
    let info = replay_info(&base, &call).await;
    assert_eq!(info["enabled"], false);
    assert_eq!(info["key_needed"], true);
    assert_eq!(info["key_header"], "x-api-key");
    drop(tap);
    assert_eq!(up.received().len(), 1);

    // On.
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream_config(&up, "[viewer]\nlisten = \"127.0.0.1:0\"\nreplay = true\n"),
        dir.path(),
    );
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let call = original_call(&tap, false).await["id"].as_str().unwrap().to_owned();
    assert_eq!(up.received().len(), 2);
    // From another site's page (a script there, a form there, a browser without Sec-Fetch-*), or not as JSON
    // (what a cross-site form can send without a preflight): refused, nothing sent.
    let refused: [(&[(&str, &str)], u16); 6] = [
        (
            &[
                json_ct,
                ("sec-fetch-site", "cross-site"),
                ("origin", "http://evil.example"),
            ],
            403,
        ),
        (&[json_ct, ("sec-fetch-site", "same-site")], 403),
        (&[json_ct, ("origin", "http://evil.example")], 403),
        (&[("content-type", "text/plain"), ("sec-fetch-site", "cross-site")], 403),
        (&[("content-type", "application/x-www-form-urlencoded")], 415),
        (
            &[
                ("content-type", "text/plain;charset=UTF-8"),
                ("sec-fetch-site", "same-origin"),
            ],
            415,
        ),
    ];
    for (headers, status) in refused {
        let r = post(&base, &call, headers, &posted).await;
        assert_eq!(r.status, status, "{headers:?}: {}", String::from_utf8_lossy(&r.body));
    }
    // A replay of a call with a key, without one: refused with the reason.
    let r = post(&base, &call, &[json_ct], &json!({"model": "x"})).await;
    assert_eq!(r.status, 400);
    assert_eq!(up.received().len(), 2);

    // From the viewer's own page: sent with the key, captured, linked; the answer does not echo the key.
    let r = post(
        &base,
        &call,
        &[json_ct, ("sec-fetch-site", "same-origin"), ("origin", &base)],
        &posted,
    )
    .await;
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(r.status, 200, "{text}");
    assert!(!text.contains(KEY));
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["status"], 200);
    let new_id = answer["id"].as_str().expect("the replay's capture found").to_owned();
    let received = up.received();
    assert_eq!(received.len(), 3);
    assert_eq!(received[2].headers["x-api-key"], KEY);
    let body: Value = serde_json::from_slice(&received[2].body).unwrap();
    assert_eq!(body["model"], "claude-from-viewer");
    assert_eq!(body["stream"], false);
    let info = replay_info(&base, &call).await;
    assert_eq!(info["enabled"], true);
    assert_eq!(info["replays"][0]["id"], new_id.as_str());
    tap.wait_settled();
    for path in files_under(dir.path()) {
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
            "the key is in {}",
            path.display()
        );
    }
    drop(tap);

    // With [api] token (required beyond loopback): the replay route is behind it like every other.
    let dir = tempfile::tempdir().unwrap();
    let token = "replay-viewer-token";
    let extra =
        format!("[api]\nlisten = \"off\"\ntoken = \"{token}\"\n[viewer]\nlisten = \"127.0.0.1:0\"\nreplay = true\n");
    let tap = Llmtap::start(&upstream_config(&up, &extra), dir.path());
    let base = format!("http://{}", tap.viewer_addr.unwrap());
    let call = original_call(&tap, false).await["id"].as_str().unwrap().to_owned();
    let sent = up.received().len();
    let r = post(&base, &call, &[json_ct], &posted).await;
    assert_eq!(r.status, 401);
    assert_eq!(up.received().len(), sent);
    let bearer = format!("Bearer {token}");
    let r = post(&base, &call, &[json_ct, ("authorization", &bearer)], &posted).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(up.received().len(), sent + 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn chromium_replays_a_call_with_an_edited_model_and_follows_the_links_between_the_two() {
    let chromium = require_browser();
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(
        &upstream_config(&up, "[viewer]\nlisten = \"127.0.0.1:0\"\nreplay = true\n"),
        dir.path(),
    );
    let viewer = tap.viewer_addr.expect("viewer enabled");
    let original = original_call(&tap, true).await;
    let call = original["id"].as_str().unwrap().to_owned();
    let shots = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");
    let new_model = "claude-edited-in-the-page";

    let report = run_script(
        &chromium,
        "replay.mjs",
        &[
            &format!("http://{viewer}/"),
            &call,
            new_model,
            KEY,
            &shots.display().to_string(),
        ],
    );
    assert!(report.get("error").is_none(), "{report:#}");
    assert_eq!(report["console_errors"], json!([]), "{report:#}");

    // The form started from the call as captured; the key field is a password field, emptied once sent.
    assert_eq!(report["before"]["replays"], json!([]));
    assert_eq!(report["before"]["model"], "claude-sonnet-4-20250514");
    assert_eq!(report["before"]["key_type"], "password");
    assert_eq!(report["after"]["key_left"], "");

    // What the upstream got: the page's model and key, the rest as captured (a stream again).
    let received = up.received();
    assert_eq!(received.len(), 2);
    assert_eq!(received[1].headers["x-api-key"], KEY);
    let body: Value = serde_json::from_slice(&received[1].body).unwrap();
    assert_eq!(body["model"], new_model);
    assert_eq!(body["stream"], true);

    // The new call as stored, and the page's links both ways.
    let traces = tap.wait_for_traces(2);
    let new_id = report["after"]["new_id"].as_str().unwrap();
    let new = traces
        .iter()
        .find(|t| t["id"] == new_id)
        .expect("the linked call is stored");
    assert_eq!(new["model"], new_model);
    assert_eq!(new["streamed"], true);
    assert_eq!(report["after"]["replays"], json!([new_id]));
    assert_eq!(report["replayed"]["hash"], format!("#/c/{new_id}"));
    assert_eq!(report["replayed"]["replay_of"], format!("Replay of {call}"));
    assert_eq!(report["replayed"]["replay_of_href"], format!("#/c/{call}"));
    assert!(report["replayed"]["text"].as_str().unwrap().contains(new_model));
    assert_eq!(report["original"]["hash"], format!("#/c/{call}"));
    assert_eq!(report["original"]["replays"], json!([new_id]));
    assert!(!report["storage"].as_str().unwrap().contains(KEY));
}
