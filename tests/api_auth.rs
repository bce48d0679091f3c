//! The gRPC API's bearer token, through the real binary: every RPC without the token is refused, with it works;
//! listening beyond loopback without a token refuses to start.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use llmtap::api::pb;
use tonic::Request;

fn with_token<T>(msg: T, value: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert("authorization", value.parse().unwrap());
    r
}

async fn check_token(tap: &Llmtap, token: &str) {
    let mut api = api_client(tap).await;
    let bearer = format!("Bearer {token}");
    for presented in [None, Some("Bearer wrong"), Some(token), Some("Bearer ")] {
        let req = match presented {
            Some(v) => with_token(pb::ListSessionsRequest::default(), v),
            None => Request::new(pb::ListSessionsRequest::default()),
        };
        let err = api.list_sessions(req).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{presented:?}: {err:?}");
    }
    let err = api
        .export(pb::ExportRequest {
            format: "steps".into(),
            ..Default::default()
        })
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let err = api
        .subscribe(pb::SubscribeRequest::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(tap.metric("llmtap_api_unauthenticated_total") >= 6);

    // With the token: queries and streams work, and see what was captured.
    let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
    assert_eq!(send_fixture(&client(), tap, &f, &[]).await.status, 200);
    tap.wait_for_traces(1);
    let sessions = api
        .list_sessions(with_token(pb::ListSessionsRequest::default(), &bearer))
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(sessions.len(), 1);
    let request = pb::ExportRequest {
        format: "steps".into(),
        ..Default::default()
    };
    let bytes = api_export(&mut api, with_token(request, &bearer)).await;
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        tap.cli(&["export", "--format", "steps"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_token_from_config_is_required_on_every_rpc() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let extra = "[api]\nlisten = \"127.0.0.1:0\"\ntoken = \"s3cret-config\"\n";
    let tap = Llmtap::start(&upstream_config(&up, extra), dir.path());
    check_token(&tap, "s3cret-config").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_token_from_the_environment_is_required_on_every_rpc() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start_with_env(
        &upstream_config(&up, ""),
        dir.path(),
        &[("LLMTAP_API_TOKEN", "s3cret-env")],
    );
    check_token(&tap, "s3cret-env").await;
}

/// `llmtap serve` with `[api] listen` beyond loopback: refuses to start without a token, starts with one.
#[test]
fn api_beyond_loopback_without_a_token_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("llmtap.toml");
    std::fs::write(&config, "[api]\nlisten = \"0.0.0.0:0\"\n").unwrap();
    let mut child = Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("LLMTAP_API_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("llmtap serve started with a token-less API on 0.0.0.0");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(
        stderr.contains("without a token") && stderr.contains("0.0.0.0"),
        "{stderr}"
    );

    // With a token the same listen address is accepted.
    let tap = Llmtap::start("[api]\nlisten = \"0.0.0.0:0\"\ntoken = \"t\"\n", &dir.path().join("ok"));
    assert!(tap.api_addr.is_some());
}
