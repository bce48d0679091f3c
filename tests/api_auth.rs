//! The gRPC API's bearer token, through the real binary: every RPC without the token is refused, with it works;
//! listening beyond loopback without a token refuses to start. The same token guards the proxy port's `/metrics`
//! when the proxy listens beyond loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
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

/// The gRPC API and the viewer are one router behind the same layers: either port answers both, with the same
/// security headers and credentials; the viewer's cookie opens the page and its JSON API but never the gRPC API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_port_serves_the_grpc_api_and_the_viewer_behind_the_same_checks() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let extra = "[api]\nlisten = \"127.0.0.1:0\"\ntoken = \"one-router\"\n";
    let tap = Llmtap::start(&upstream_config(&up, extra), dir.path());
    let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
    assert_eq!(send_fixture(&client(), &tap, &f, &[]).await.status, 200);
    tap.wait_for_traces(1);
    let (api_port, viewer_port) = (tap.api_addr.unwrap(), tap.viewer_addr.expect("viewer enabled"));
    assert_ne!(api_port, viewer_port);

    // The cookie, from opening the page with the token on the viewer's port.
    let opened = send(
        &client(),
        "GET",
        &format!("http://{viewer_port}/?token=one-router"),
        &[],
        vec![],
    )
    .await;
    assert_eq!(opened.status, 303);
    let set_cookie = opened.headers.get("set-cookie").unwrap().to_str().unwrap().to_owned();
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    assert!(!cookie.contains("one-router"), "{cookie}");

    for port in [api_port, viewer_port] {
        let base = format!("http://{port}");
        // The JSON API: refused without credentials, answered with the bearer token or the cookie, every answer
        // with the security headers.
        let none = send(&client(), "GET", &format!("{base}/api/sessions"), &[], vec![]).await;
        assert_eq!(none.status, 401, "{port}");
        for credentials in [("authorization", "Bearer one-router"), ("cookie", cookie.as_str())] {
            let r = send(
                &client(),
                "GET",
                &format!("{base}/api/sessions"),
                &[credentials],
                vec![],
            )
            .await;
            assert_eq!(r.status, 200, "{port} {credentials:?}");
            let sessions: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(sessions["sessions"].as_array().map(Vec::len), Some(1), "{sessions}");
        }
        for r in [&none, &opened] {
            let csp = r.headers.get("content-security-policy").unwrap().to_str().unwrap();
            assert!(csp.contains("default-src 'none'"), "{csp}");
            assert_eq!(r.headers.get("cache-control").unwrap(), "no-store");
        }
        // gRPC: the bearer token works on both ports; the cookie does not.
        let mut api = pb::llm_tap_client::LlmTapClient::connect(base.clone()).await.unwrap();
        let sessions = api
            .list_sessions(with_token(pb::ListSessionsRequest::default(), "Bearer one-router"))
            .await
            .unwrap()
            .into_inner()
            .sessions;
        assert_eq!(sessions.len(), 1, "{port}");
        let mut with_cookie = Request::new(pb::ListSessionsRequest::default());
        with_cookie.metadata_mut().insert("cookie", cookie.parse().unwrap());
        let err = api.list_sessions(with_cookie).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{port}: {err:?}");
        // A browser page elsewhere cannot post to the gRPC path either.
        let cross = send(
            &client(),
            "POST",
            &format!("{base}/llmtap.v1.LlmTap/ListSessions"),
            &[("authorization", "Bearer one-router"), ("sec-fetch-site", "cross-site")],
            vec![],
        )
        .await;
        assert_eq!(cross.status, 403, "{port}");
    }
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

/// `llmtap serve --listen 0.0.0.0:0` (as the Docker image runs), reached through 127.0.0.1; killed on drop.
struct AllInterfaces {
    child: Child,
    addr: SocketAddr,
}

impl AllInterfaces {
    fn start(config: &str, data_dir: &std::path::Path) -> AllInterfaces {
        std::fs::create_dir_all(data_dir).unwrap();
        let config_path = data_dir.join("llmtap.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = llmtap_command()
            .args(["serve", "--listen", "0.0.0.0:0", "--config"])
            .arg(&config_path)
            .arg("--data-dir")
            .arg(data_dir)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let _ = tx.send(line);
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).expect("llmtap did not start");
        let listening: SocketAddr = line.trim().rsplit("http://").next().unwrap().parse().expect(&line);
        assert!(listening.ip().is_unspecified(), "{line}");
        let addr = SocketAddr::from(([127, 0, 0, 1], listening.port()));
        AllInterfaces { child, addr }
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        send(
            &client(),
            "GET",
            &format!("http://{}{path}", self.addr),
            headers,
            vec![],
        )
        .await
    }

    fn status(&self, env: &[(&str, &str)]) -> std::process::Output {
        llmtap_command()
            .args(["status", "--addr", &self.addr.to_string()])
            .envs(env.iter().copied())
            .output()
            .unwrap()
    }
}

impl Drop for AllInterfaces {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The proxy listening beyond loopback: `/metrics` (model names, sink errors) answers only to the `[api]` token
/// as a bearer header, and `llmtap status` sends it (from its config or `LLMTAP_API_TOKEN`); without a token
/// configured it is not served there at all. Traffic and `/healthz` need no token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_beyond_loopback_answer_only_to_the_token() {
    let up = Upstream::start(ReplayOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let f = fixture("openai_chat/openllmetry__chat_basic_gzip");
    let token = "s3cret-metrics";
    let extra = format!("[api]\nlisten = \"off\"\ntoken = \"{token}\"\n");
    let tap = AllInterfaces::start(&upstream_config(&up, &extra), &dir.path().join("token"));
    let proxied = send(
        &client(),
        "POST",
        &format!("http://{}{}", tap.addr, f.client_path),
        &[("x-replay-fixture", f.name.as_str())],
        f.request.clone(),
    )
    .await;
    assert_eq!(proxied.status, f.status);
    assert_eq!(tap.get("/healthz", &[]).await.status, 200);
    for headers in [
        &[][..],
        &[("authorization", "Bearer wrong")],
        &[("authorization", token)],
    ] {
        let r = tap.get("/metrics", headers).await;
        assert_eq!(r.status, 401, "{headers:?}");
        assert!(!String::from_utf8_lossy(&r.body).contains("llmtap_"), "{headers:?}");
    }
    let bearer = format!("Bearer {token}");
    let r = tap.get("/metrics", &[("authorization", bearer.as_str())]).await;
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("llmtap_requests_total 1"));
    let refused = tap.status(&[]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("401"), "{refused:?}");
    let shown = tap.status(&[("LLMTAP_API_TOKEN", token)]);
    assert!(shown.status.success(), "{shown:?}");
    assert!(String::from_utf8_lossy(&shown.stdout).contains("llmtap_requests_total 1"));
    drop(tap);

    // No token configured: the counters stay off the network; traffic flows.
    let open = AllInterfaces::start(
        &upstream_config(&up, "[api]\nlisten = \"off\"\n"),
        &dir.path().join("open"),
    );
    let r = open.get("/metrics", &[]).await;
    assert_eq!(r.status, 403);
    assert!(!String::from_utf8_lossy(&r.body).contains("llmtap_"));
    assert_eq!(open.get("/healthz", &[]).await.status, 200);
    let proxied = send(
        &client(),
        "POST",
        &format!("http://{}{}", open.addr, f.client_path),
        &[("x-replay-fixture", f.name.as_str())],
        f.request.clone(),
    )
    .await;
    assert_eq!(proxied.status, f.status);
}
