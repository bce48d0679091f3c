//! Secrets through the real binary: credentials in headers (any spelling, both directions), query names, the
//! path and the JSON body reach the provider but never the store, its WAL, the log or any export; a proxy's
//! credentials are not forwarded to the provider at all.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Stdio;

use common::*;
use llmtap::api::pb;
use serde_json::Value;

/// Every secret value sent, each unique so that a leak names itself.
const HEADER_SECRETS: &[(&str, &str)] = &[
    ("x_api_key", "leak-underscore-3f9a1c"),
    ("ocp-apim-subscription-key", "leak-apim-8b2e77"),
    ("x-functions-key", "leak-functions-51d0aa"),
    ("x-access-key", "leak-access-c4e913"),
    ("X-Tenant-Id", "leak-configured-0e6b52"),
    ("authorization", "Bearer leak-bearer-7aa1f0"),
];
const RESPONSE_SECRET: &str = "leak-response-session-92c4d1";
const BODY_SECRET: &str = "leak-body-api-key-66f2b8";
const PATH_KEY: &str = "sk-proj-leakpathsegment0123456789abcdef";
const QUERY_SECRETS: &[(&str, &str)] = &[
    ("api-key", "leak-query-apikey-1a2b3c"),
    ("client_secret", "leak-query-client-4d5e6f"),
    ("password", "leak-query-password-7a8b9c"),
    ("x-goog-api-key", "leak-query-goog-0d1e2f"),
    ("%6Bey", "leak-query-encoded-key-3a4b5c"),
];

fn all_secrets() -> Vec<&'static str> {
    let mut s: Vec<&str> = HEADER_SECRETS.iter().map(|(_, v)| *v).collect();
    s.extend(QUERY_SECRETS.iter().map(|(_, v)| *v));
    s.extend([RESPONSE_SECRET, BODY_SECRET, PATH_KEY, "leak-bearer-7aa1f0"]);
    s
}

fn assert_no_secret(place: &str, text: &[u8]) {
    let text = String::from_utf8_lossy(text);
    for secret in all_secrets() {
        assert!(!text.contains(secret), "{place} holds the secret {secret:?}");
    }
}

async fn grpc_export(tap: &Llmtap) -> Vec<u8> {
    let request = pb::ExportRequest {
        format: "provider-traces".into(),
        ..Default::default()
    };
    api_export(&mut api_client(tap).await, request).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_anywhere_in_a_request_reach_the_provider_but_nothing_llmtap_keeps() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("llmtap.log");
    let log = std::fs::File::create(&log_path).unwrap();
    // `x-replay-response-header` is the test's instruction to the upstream and holds the response secret
    // itself: configured as secret too, so that only what the provider sends back is under test.
    let config = upstream_config(
        &up,
        "[capture]\nredact_headers = [\"x-tenant-id\", \"x-replay-response-header\"]\n",
    );
    // Debug logging: whatever llmtap logs about an exchange is checked too.
    let tap = Llmtap::start_with_stderr(&config, dir.path(), &[("RUST_LOG", "debug")], Stdio::from(log));

    let f = fixture("openai_chat/openllmetry__reasoning_tokens");
    let mut body: Value = serde_json::from_slice(&f.request).unwrap();
    body["api_key"] = BODY_SECRET.into();
    let query: Vec<String> = QUERY_SECRETS.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let url = tap.url(&format!(
        "/openai/keys/{PATH_KEY}/v1/chat/completions?{}&debug=1",
        query.join("&")
    ));
    let response_header = format!("x-upstream-session-key: {RESPONSE_SECRET}");
    let mut headers = vec![
        ("content-type", "application/json"),
        ("x-replay-fixture", f.name.as_str()),
        ("x-replay-response-header", response_header.as_str()),
    ];
    headers.extend_from_slice(HEADER_SECRETS);
    let reply = send(&client(), "POST", &url, &headers, body.to_string().into_bytes()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.headers["x-upstream-session-key"], RESPONSE_SECRET,
        "the client gets the provider's headers unchanged"
    );

    // Forwarding is untouched: the provider gets every credential, in the headers, path, query and body.
    let received = up.received().pop().unwrap();
    for (name, value) in HEADER_SECRETS {
        assert_eq!(received.headers[&name.to_ascii_lowercase()], *value, "{name} forwarded");
    }
    assert!(received.path.contains(PATH_KEY) && received.path.contains("leak-query-encoded-key-3a4b5c"));
    assert!(String::from_utf8_lossy(&received.body).contains(BODY_SECRET));

    let traces = tap.wait_for_traces(1);
    let t = &traces[0];
    // What was kept says where the secrets were (so the checks below cannot pass on an empty store).
    let header =
        |direction: &str, name: &str| -> Option<String> { t["headers"][direction][name].as_str().map(str::to_owned) };
    for (name, _) in HEADER_SECRETS {
        let name = name.to_ascii_lowercase();
        assert_eq!(header("request", &name).as_deref(), Some("REDACTED"), "{name}");
    }
    assert_eq!(
        header("response", "x-upstream-session-key").as_deref(),
        Some("REDACTED")
    );
    // Rate-limit counters match the rule ("tokens") but are documented as kept.
    assert!(
        header("response", "x-ratelimit-remaining-tokens").is_some_and(|v| v != "REDACTED"),
        "{}",
        t["headers"]["response"]
    );
    assert_eq!(t["request"]["api_key"], "REDACTED");
    assert_eq!(
        t["request"]["messages"], body["messages"],
        "the rest of the body is kept"
    );
    let path = t["path"].as_str().unwrap();
    assert!(path.starts_with("/keys/REDACTED/v1/chat/completions?"), "{path}");
    assert!(path.contains("%6Bey=REDACTED") && path.ends_with("&debug=1"), "{path}");

    assert_no_secret(
        "export --format provider-traces",
        tap.cli(&["export", "--format", "provider-traces"]).as_bytes(),
    );
    assert_no_secret("traces --json", tap.cli(&["traces", "--json"]).as_bytes());
    assert_no_secret(
        "export --format steps",
        tap.cli(&["export", "--format", "steps"]).as_bytes(),
    );
    assert_no_secret("gRPC Export", &grpc_export(&tap).await);
    // The store's files as they are on disk while llmtap runs (the rows are in the WAL until a checkpoint).
    for file in ["llmtap.sqlite", "llmtap.sqlite-wal"] {
        if let Ok(bytes) = std::fs::read(dir.path().join(file)) {
            assert_no_secret(file, &bytes);
        }
    }
    assert_no_secret("llmtap's log", &std::fs::read(&log_path).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_authorization_is_not_forwarded_to_the_provider() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, ""), dir.path());
    let f = fixture("openai_chat/openllmetry__reasoning_tokens");
    let reply = send_fixture(
        &client(),
        &tap,
        &f,
        &[
            ("proxy-authorization", "Basic bGVhazpwcm94eQ=="),
            ("authorization", "Bearer sk-provider"),
        ],
    )
    .await;
    assert_eq!(reply.status, 200);
    let received = up.received().pop().unwrap();
    assert!(
        received.headers.get("proxy-authorization").is_none(),
        "the provider got the proxy's credentials"
    );
    assert_eq!(
        received.headers["authorization"], "Bearer sk-provider",
        "its own are forwarded"
    );
}
