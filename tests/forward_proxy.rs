//! The forward-proxy mode through the real binary: CONNECT on the proxy port, TLS terminated with a leaf from
//! llmtap's CA for intercept-list hosts (captured like base-URL mode, the host and bytes unchanged), blind
//! tunnels for everything else, `llmtap run` and `llmtap ca`, and the bad cases.
//!
//! The provider hosts cannot be reached from tests: `[forward] resolve` (the test-only address override)
//! sends them to the scripted upstream, which serves a certificate for those names under its own test CA
//! (`[forward] ca_file`). Clients see only llmtap's CA.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use bytes::Bytes;
use common::claude::*;
use common::clients::*;
use common::scripted::{SCRIPTED_TEXT, Scripted};
use common::*;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Config sending the provider hosts to `up` (and trusting its test CA on llmtap's upstream side).
fn forward_config(up: &Upstream, extra: &str) -> String {
    let port = up.addr.port();
    let mut resolve = String::new();
    for host in [
        "api.anthropic.com",
        "api.openai.com",
        "bedrock-runtime.us-east-1.amazonaws.com",
    ] {
        resolve.push_str(&format!("\"{host}\" = \"127.0.0.1:{port}\"\n"));
    }
    upstream_config(
        up,
        &format!(
            "{extra}[forward]\nca_file = \"{}\"\n[forward.resolve]\n{resolve}",
            up.ca_pem_path.display()
        ),
    )
}

fn ca_path(data_dir: &Path) -> PathBuf {
    data_dir.join("ca/llmtap-ca.pem")
}

/// `CONNECT target` on a fresh connection; the status and head of the answer, and the connection.
async fn connect(proxy: SocketAddr, target: &str, extra_headers: &str) -> (u16, String, TcpStream) {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    tcp.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra_headers}\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut tcp).await;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, head, tcp)
}

/// Reads up to the end of a response head (byte by byte: what follows belongs to the tunnel).
async fn read_head(tcp: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tcp.read(&mut byte).await.unwrap() == 0 {
            break;
        }
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A TLS client trusting only the certificates in `roots`.
fn tls_connector(roots: &[&Path]) -> tokio_rustls::TlsConnector {
    let mut store = rustls::RootCertStore::empty();
    for path in roots {
        for cert in rustls_pki_types::pem::PemObject::pem_file_iter(path).unwrap() {
            store.add(cert.unwrap()).unwrap();
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 request over `io`; status, headers, body.
async fn request_over<IO>(io: IO, req: http::Request<Full<Bytes>>) -> (u16, http::HeaderMap, Bytes)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.unwrap();
    tokio::spawn(conn);
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, body)
}

/// `llmtap run` for the test's llmtap: its config with `listen` naming the running instance.
fn run_command(tap: &Llmtap, config: &str, args: &[&str]) -> Command {
    let run_config = tap.data_dir.join("run.toml");
    std::fs::write(&run_config, format!("listen = \"{}\"\n{config}", tap.addr)).unwrap();
    let mut c = llmtap_command();
    c.arg("run")
        .arg("--config")
        .arg(&run_config)
        .arg("--data-dir")
        .arg(&tap.data_dir)
        .args(args);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdks_through_llmtap_run_keep_their_base_url_and_are_captured() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = forward_config(&up, "");
    let tap = Llmtap::start(&config, dir.path());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/forward_clients.py");
    let mut cmd = run_command(&tap, &config, &["--session", "fwd-sdk", "--"]);
    cmd.arg(python())
        .arg(script)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("ANTHROPIC_BASE_URL")
        .env("OPENAI_API_KEY", "sk-test-FWDSECRET-openai")
        .env("ANTHROPIC_API_KEY", "sk-ant-FWDSECRET-anthropic");
    let run = run_client(cmd, 60).await;
    assert!(run.stderr.contains("session fwd-sdk"), "{}", run.stderr);
    let r: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(r["openai_chat"]["content"], SCRIPTED_TEXT);
    assert_eq!(r["openai_responses_stream"]["text"], SCRIPTED_TEXT);
    assert_eq!(r["openai_responses_stream"]["final_text"], SCRIPTED_TEXT);
    assert_eq!(r["anthropic"]["text"], SCRIPTED_TEXT);
    assert_eq!(r["anthropic_stream"]["text"], SCRIPTED_TEXT);

    // The upstream saw the providers' own hosts, and every exchange is stored with the bytes it sent.
    let received = up.received();
    assert_eq!(received.len(), 4, "{}", up.dump());
    for rec in &received {
        let host = rec.authority.as_deref().unwrap_or_default();
        assert!(host == "api.openai.com" || host == "api.anthropic.com", "{host}");
        assert!(rec.headers.get("proxy-authorization").is_none());
    }
    let traces = up.assert_captured(&tap);
    for t in &traces {
        let host = t["upstream"].as_str().unwrap();
        assert!(host == "api.openai.com" || host == "api.anthropic.com", "{t:#}");
        assert_eq!(t["session_id"], "fwd-sdk", "the run's session: {t:#}");
        assert_eq!(t["headers"]["request"]["host"], host, "the real host is recorded");
    }
    let apis: Vec<&str> = traces.iter().map(|t| t["api"].as_str().unwrap()).collect();
    for api in ["openai.chat", "openai.responses", "anthropic.messages"] {
        assert!(apis.contains(&api), "{apis:?}");
    }
    assert!(tap.metric("llmtap_forward_intercepted_total") >= 2);
    assert_eq!(files_containing(&tap.data_dir, "FWDSECRET"), Vec::<PathBuf>::new());
}

const CLAUDE_KEY: &str = "sk-ant-api03-CLIENTSECRET-forward";

/// `claude -p <prompt>` through `llmtap run`, isolated from the developer's config, its base URL untouched.
fn claude_via_run(tap: &Llmtap, config: &str, bin: &Path, home: &Path, project: &Path, prompt: &str) -> Command {
    let mut cmd = run_command(tap, config, &["--"]);
    cmd.arg(bin)
        .current_dir(project)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("CLAUDE_CONFIG_DIR", home.join(".claude"))
        .env("ANTHROPIC_API_KEY", CLAUDE_KEY)
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("DISABLE_BUG_COMMAND", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("CLAUDE_CODE_DISABLE_TERMINAL_TITLE", "1")
        .args(["-p", prompt])
        // Last: `--allowedTools` takes every following argument as a tool name.
        .args(["--output-format", "json", "--allowedTools", "Bash"]);
    cmd
}

/// The session `llmtap run` printed on stderr.
fn run_session(stderr: &str) -> String {
    stderr
        .split("session ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no session in {stderr}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_through_llmtap_run_is_captured_without_a_base_url() {
    let Some(bin) = claude_binary() else {
        eprintln!("SKIP: no Claude Code build for this platform");
        return;
    };
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = forward_config(&up, "");
    let tap = Llmtap::start(&config, dir.path());
    let (home, project) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let key = CLAUDE_KEY;
    let cmd = claude_via_run(
        &tap,
        &config,
        &bin,
        home.path(),
        project.path(),
        "Say hi using the shell.",
    );
    let run = run_client(cmd, 90).await;
    eprintln!("claude -p via llmtap run: {:.1} s\n{}", run.secs, up.dump());
    let out: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(out["result"], SCRIPTED_TEXT, "{out:#}");
    let session = run_session(&run.stderr);

    let calls = up.model_calls();
    assert!(calls.iter().any(|s| s.tool.as_deref() == Some("Bash")), "{}", up.dump());
    for rec in up.received() {
        assert_eq!(
            rec.authority.as_deref(),
            Some("api.anthropic.com"),
            "the base URL was the real one"
        );
    }
    let traces = up.assert_captured(&tap);
    assert!(traces.iter().all(|t| t["upstream"] == "api.anthropic.com"));
    assert!(
        traces.iter().all(|t| t["session_id"] == session.as_str()),
        "one session for the run"
    );
    // The tool round: the Bash call's result joined to it, as in base-URL mode.
    let steps = tap.export("steps", &[]);
    let bash = steps
        .iter()
        .flat_map(|s| s["tool_calls"].as_array().cloned().unwrap_or_default())
        .find(|c| c["tool_name"] == "Bash")
        .unwrap_or_else(|| panic!("no Bash call: {steps:#?}"));
    let observed = steps
        .iter()
        .flat_map(|s| s["observations"].as_array().cloned().unwrap_or_default())
        .any(|o| o["source_call_id"] == bash["tool_call_id"]);
    assert!(observed, "the Bash call has its result: {steps:#?}");
    assert!(
        up.received()
            .iter()
            .any(|r| r.headers.get("x-api-key").is_some_and(|v| v == key))
    );
    assert_eq!(files_containing(&tap.data_dir, "CLIENTSECRET"), Vec::<PathBuf>::new());
}

/// A Task sub-agent through `llmtap run` (the scripted answers of tests/clients_claude_code.rs): the sub-agent's
/// trajectory is linked to the step that started it, as in base-URL mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_task_subagent_through_llmtap_run_is_linked_to_its_parent_step() {
    let Some(bin) = claude_binary() else {
        eprintln!("SKIP: no Claude Code build for this platform");
        return;
    };
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = forward_config(&up, "");
    let tap = Llmtap::start(&config, dir.path());
    let (home, project) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let prompt = "[[tool:Task]] Delegate saying hi to a helper.";
    let cmd = claude_via_run(&tap, &config, &bin, home.path(), project.path(), prompt);
    let run = run_client(cmd, 90).await;
    eprintln!("claude -p (Task) via llmtap run: {:.1} s\n{}", run.secs, up.dump());
    let out: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(out["result"], SCRIPTED_TEXT, "{out:#}");
    let session = run_session(&run.stderr);
    let delegated: Vec<_> = up
        .model_calls()
        .into_iter()
        .filter(|s| s.tool.as_deref() == Some("Agent") || s.tool.as_deref() == Some("Task"))
        .collect();
    assert_eq!(delegated.len(), 1, "{}", up.dump());
    let sub_calls = up
        .model_calls()
        .into_iter()
        .filter(|s| {
            s.request["messages"][0]
                .to_string()
                .contains("Run the shell command `echo hi`")
        })
        .count();
    assert_eq!(sub_calls, 2, "the sub-agent's Bash round and its answer: {}", up.dump());
    for rec in up.received() {
        assert_eq!(rec.authority.as_deref(), Some("api.anthropic.com"));
    }
    let traces = up.assert_captured(&tap);
    assert!(
        traces.iter().all(|t| t["session_id"] == session.as_str()),
        "one session for the run, the sub-agent's calls included"
    );

    assert_task_subagent_linked(&tap, delegated[0].tool.as_deref().unwrap());
    assert!(
        up.received()
            .iter()
            .any(|r| r.headers.get("x-api-key").is_some_and(|v| v == CLAUDE_KEY))
    );
    assert_eq!(files_containing(&tap.data_dir, "CLIENTSECRET"), Vec::<PathBuf>::new());
}

/// Codex CLI on its built-in OpenAI provider (no base URL, no `model_providers` entry), through `llmtap run`:
/// its Responses WebSocket to api.openai.com is intercepted inside the tunnel and captured as a turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_cli_on_its_built_in_provider_through_llmtap_run_uses_the_websocket_and_is_captured() {
    let codex = match std::env::var_os("LLMTAP_TEST_CODEX") {
        Some(p) => PathBuf::from(p),
        None => {
            node_package("@openai/codex");
            node_clients_dir().join("node_modules/.bin/codex")
        }
    };
    let up = common::ws::WsUpstream::start_tls().await;
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[api]\nlisten = \"off\"\n[forward]\nca_file = \"{}\"\n[forward.resolve]\n\"api.openai.com\" = \"{}\"\n",
        up.ca_pem_path.as_ref().unwrap().display(),
        up.addr
    );
    let tap = Llmtap::start(&config, dir.path());
    let (home, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut cmd = run_command(&tap, &config, &["--"]);
    cmd.arg(&codex)
        .args([
            "exec",
            "--skip-git-repo-check",
            "--sandbox",
            "read-only",
            "-m",
            "gpt-test",
        ])
        .args(["-c", "web_search=\"disabled\""])
        .arg("Say hi.")
        .current_dir(work.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CODEX_HOME", home.path())
        .env("OPENAI_API_KEY", "sk-test-CODEXSECRET-forward")
        .env("CODEX_API_KEY", "sk-test-CODEXSECRET-forward");
    let run = run_client(cmd, 60).await;
    let answered: u64 = run
        .stdout
        .trim()
        .strip_prefix("Answer ")
        .and_then(|n| n.trim_end_matches('.').parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "Codex did not print the scripted answer:\n{}\n{}",
                run.stdout, run.stderr
            )
        });
    let session = run
        .stderr
        .split("session ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_owned();
    let fallbacks: Vec<String> = up
        .http_log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("/responses"))
        .cloned()
        .collect();
    assert!(fallbacks.is_empty(), "Codex fell back to HTTP: {fallbacks:?}");
    let conns = up.conns();
    assert!(
        conns.iter().any(|c| c.path.ends_with("/v1/responses")),
        "the built-in provider's path"
    );
    for c in &conns {
        let host = c.headers.iter().find(|(k, _)| k == "host").map(|(_, v)| v.as_str());
        assert_eq!(host, Some("api.openai.com"), "the real host, unchanged");
    }
    assert!(
        conns
            .iter()
            .flat_map(|c| c.headers.iter())
            .any(|(k, v)| k == "authorization" && v == "Bearer sk-test-CODEXSECRET-forward"),
        "the API key login reaches the provider"
    );
    // Codex's failed `/models` calls (no DNS here) are traces too: wait for the turn's own trace, not a count.
    let id = format!("resp_{answered}");
    common::wait::poll_until("Codex's turn in the store", std::time::Duration::from_secs(20), || {
        tap.export("provider-traces", &[])
            .iter()
            .any(|t| t["response"]["id"] == id.as_str())
    });
    let traces = tap.wait_for_traces(answered as usize);
    let t = traces
        .iter()
        .find(|t| t["response"]["id"] == id.as_str())
        .unwrap_or_else(|| panic!("Codex's turn was not captured: {traces:#?}"));
    assert_eq!(t["api"], "openai.responses");
    assert_eq!(t["outcome"], "complete", "{t:#}");
    assert_eq!(t["usage"]["input"], common::ws::responses_usage(answered).0, "{t:#}");
    assert!(t["request"]["input"].to_string().contains("Say hi."), "{t:#}");
    assert!(
        traces.iter().all(|t| t["session_id"] == session.as_str()),
        "one session for the run: {traces:#?}"
    );
    assert_eq!(files_containing(&tap.data_dir, "CODEXSECRET"), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llmtap_run_starts_an_in_process_llmtap_when_none_runs() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = format!("listen = \"127.0.0.1:0\"\n{}", forward_config(&up, ""));
    let config_path = dir.path().join("run.toml");
    std::fs::write(&config_path, config).unwrap();
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut cmd = llmtap_command();
    cmd.arg("run")
        .arg("--config")
        .arg(&config_path)
        .arg("--data-dir")
        .arg(dir.path())
        .args([
            "--session",
            "inproc",
            "--",
            "curl",
            "-sS",
            "--fail",
            "https://api.anthropic.com/v1/messages",
        ])
        .args([
            "-H",
            "content-type: application/json",
            "-H",
            "x-api-key: sk-ant-INPROCSECRET",
            "-d",
            body,
        ]);
    let run = run_client(cmd, 60).await;
    assert!(run.stderr.contains("started for this run"), "{}", run.stderr);
    let answer: Value = serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(answer["content"][0]["text"], SCRIPTED_TEXT);
    // The in-process llmtap drained into the store before `run` exited.
    let out = llmtap_command()
        .args(["export", "--format", "provider-traces", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let traces: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(traces.len(), 1, "{traces:#?}");
    assert_eq!(traces[0]["session_id"], "inproc");
    assert_eq!(traces[0]["upstream"], "api.anthropic.com");
    assert_eq!(traces[0]["api"], "anthropic.messages");
    assert_eq!(files_containing(dir.path(), "INPROCSECRET"), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_off_the_list_are_tunnelled_blind() {
    let up = Scripted::start().await;
    // Another TLS server, on no list: its own certificate must reach the client untouched.
    let other = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&forward_config(&up, ""), dir.path());
    let target = format!("localhost:{}", other.addr.port());
    let (status, _, tcp) = connect(tap.addr, &target, "").await;
    assert_eq!(status, 200);
    // Trusting only the real server's certificate: a certificate minted by llmtap would fail here.
    let tls = tls_connector(&[&other.ca_pem_path])
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .expect("the client sees the real server's certificate");
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;
    let req = http::Request::post("/v1/chat/completions")
        .header("host", &target)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let (status, _, answer) = request_over(tls, req).await;
    assert_eq!(status, 200);
    let sent = other.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(answer.as_ref(), sent[0].body.as_slice(), "bytes unchanged");
    assert_eq!(other.received()[0].body.as_ref(), body.as_bytes());
    // Counted, never captured.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while tap.metric("llmtap_forward_blind_total") == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(tap.metric("llmtap_forward_blind_total"), 1);
    assert_eq!(tap.metric("llmtap_forward_intercepted_total"), 0);
    tap.wait_settled();
    assert_eq!(tap.metric("llmtap_captured_total"), 0);
    assert!(tap.export("provider-traces", &[]).is_empty());
    assert!(!ca_path(dir.path()).exists(), "no CA is made for blind tunnels");
}

/// A kept-alive HTTP/1.1 connection through a CONNECT tunnel to `host` under llmtap's CA.
async fn open_tunnel(tap: &Llmtap, host: &str) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let (status, _, tcp) = connect(tap.addr, &format!("{host}:443"), "").await;
    assert_eq!(status, 200);
    let tls = tls_connector(&[&ca_path(&tap.data_dir)])
        .connect(host.to_owned().try_into().unwrap(), tcp)
        .await
        .unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    sender
}

/// One chat completion on a kept-alive connection; its status.
async fn chat_on(sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>, extra: &[(&str, &str)]) -> u16 {
    sender.ready().await.unwrap();
    let mut req = http::Request::post("/v1/chat/completions")
        .header("host", "api.openai.com")
        .header("content-type", "application/json");
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;
    let resp = sender
        .send_request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    resp.into_body().collect().await.unwrap();
    status
}

/// An HTTP/1.1 tunnel has an upstream connection of its own: its requests follow one another on it, another
/// tunnel gets another one, and when the upstream ends it the tunnel's next request dials again, the client's
/// connection untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_tunnel_is_mirrored_by_one_upstream_connection_dialled_again_when_the_upstream_closes_it() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&forward_config(&up, ""), dir.path());
    let connections = || up.connections.load(std::sync::atomic::Ordering::SeqCst);

    let mut first = open_tunnel(&tap, "api.openai.com").await;
    for _ in 0..3 {
        assert_eq!(chat_on(&mut first, &[]).await, 200);
    }
    assert_eq!(
        connections(),
        1,
        "three requests of one tunnel, one upstream connection"
    );

    let mut second = open_tunnel(&tap, "api.openai.com").await;
    assert_eq!(chat_on(&mut second, &[]).await, 200);
    assert_eq!(connections(), 2, "another tunnel, another upstream connection");

    // The upstream ends the first tunnel's connection after this answer; the next request dials again.
    assert_eq!(chat_on(&mut first, &[("x-scripted-close", "1")]).await, 200);
    assert_eq!(chat_on(&mut first, &[]).await, 200);
    assert_eq!(connections(), 3);
    assert!(!first.is_closed(), "the client's own connection stays open");
    assert_eq!(chat_on(&mut second, &[]).await, 200);
    assert_eq!(connections(), 3);

    // Every request reached the host as the client sent it (origin form, its Host) and was captured.
    let received = up.received();
    assert_eq!(received.len(), 7);
    for r in &received {
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(r.authority.as_deref(), Some("api.openai.com"));
        assert_eq!(r.headers.get_all("host").iter().count(), 1);
    }
    let traces = tap.wait_for_traces(7);
    assert!(
        traces
            .iter()
            .all(|t| t["upstream"] == "api.openai.com" && t["outcome"] == "complete"),
        "{traces:#?}"
    );
}

/// A real SigV4 signature: botocore signs a Bedrock InvokeModel request offline (tests/sdk/sigv4.py) and sends it
/// through `llmtap run`'s HTTPS_PROXY; the upstream standing in for the AWS host recomputes the signature from the
/// bytes it received, as AWS does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigv4_signed_bedrock_request_passes_byte_for_byte() {
    let up = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = forward_config(&up, "");
    let tap = Llmtap::start(&config, dir.path());
    let host = "bedrock-runtime.us-east-1.amazonaws.com";
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/sigv4.py");
    let mut cmd = run_command(&tap, &config, &["--"]);
    cmd.arg(python()).arg(&script).arg("send");
    let run = run_client(cmd, 60).await;
    let sent: Value =
        serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}\n{}", run.stdout, run.stderr));
    // The scripted upstream knows no Bedrock path: its own answer (not llmtap's) comes back unchanged.
    let answers = up.sent();
    assert_eq!(answers.len(), 1);
    assert_eq!(sent["status"], answers[0].status);
    assert_eq!(sent["body"].as_str().unwrap().as_bytes(), answers[0].body.as_slice());

    // Every signed header reaches the provider exactly as signed, with the path (and its encoding) and body.
    let rec = &up.received()[0];
    assert_eq!(rec.authority.as_deref(), Some(host));
    assert_eq!(rec.method, "POST");
    assert_eq!(rec.path, "/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/invoke");
    let signed = sent["signed"].as_object().unwrap();
    assert!(
        signed.contains_key("X-Amz-Date") && signed.contains_key("Authorization"),
        "{signed:?}"
    );
    for (k, v) in signed {
        assert_eq!(rec.headers.get(k.as_str()).unwrap(), v.as_str().unwrap(), "{k}");
    }
    // The upstream's check: the signature recomputed from the received bytes is the one the client made.
    let received = serde_json::json!({
        "method": rec.method,
        "host": rec.authority,
        "path": rec.path,
        "headers": rec.headers.iter().map(|(k, v)| [k.as_str(), v.to_str().unwrap()]).collect::<Vec<_>>(),
        "body": std::str::from_utf8(&rec.body).unwrap(),
    });
    let mut verify = std::process::Command::new(python())
        .arg(&script)
        .arg("verify")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut verify.stdin.take().unwrap(), received.to_string().as_bytes()).unwrap();
    let out = verify.wait_with_output().unwrap();
    let check: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(check["valid"], true, "the signature survives the proxy: {check:#}");
    let signature = check["signature"].as_str().unwrap();
    assert_eq!(signature.len(), 64, "{check:#}");

    // Kept as a raw trace (no adapter knows Bedrock's invoke path), with the signature redacted.
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["upstream"], host);
    assert_eq!(traces[0]["path"], rec.path);
    assert_eq!(traces[0]["headers"]["request"]["authorization"], "REDACTED");
    assert_eq!(files_containing(dir.path(), signature), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_connects_get_clear_answers_and_are_counted() {
    let up = Scripted::start().await;
    // A TLS server whose certificate llmtap does not trust, standing in for api.openai.com.
    let untrusted = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = forward_config(&up, "").replace(
        &format!("\"api.openai.com\" = \"127.0.0.1:{}\"", up.addr.port()),
        &format!("\"api.openai.com\" = \"127.0.0.1:{}\"", untrusted.addr.port()),
    );
    let (tap, log) = Llmtap::start_capturing_log(&config, dir.path());
    tap.cli(&["ca"]);
    let ca = ca_path(dir.path());

    // A closed port: 502 with the reason, no tunnel.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let (status, head, _) = connect(tap.addr, &format!("127.0.0.1:{closed_port}"), "").await;
    assert_eq!(status, 502, "{head}");
    assert_eq!(tap.metric("llmtap_forward_connect_errors_total"), 1);

    // Malformed CONNECT lines: 400, never a tunnel.
    for line in [
        "CONNECT api.openai.com HTTP/1.1",
        "CONNECT /v1/chat HTTP/1.1",
        "CONNECT  HTTP/1.1",
    ] {
        let mut tcp = TcpStream::connect(tap.addr).await.unwrap();
        tcp.write_all(format!("{line}\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let head = read_head(&mut tcp).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{line:?} -> {head:?}");
    }

    // The upstream's certificate fails: a clear 502 to the client, and the trace kept with its request.
    let (status, _, tcp) = connect(tap.addr, "api.openai.com:443", "").await;
    assert_eq!(status, 200);
    let tls = tls_connector(&[&ca])
        .connect("api.openai.com".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;
    let req = http::Request::post("/v1/chat/completions")
        .header("host", "api.openai.com")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let (status, _, answer) = request_over(tls, req).await;
    assert_eq!(status, 502);
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(answer["error"]["type"], "llmtap_upstream_unreachable");
    assert!(untrusted.received().is_empty());
    let traces = tap.wait_for_traces(1);
    assert_eq!(traces[0]["outcome"], "upstream_error");
    assert_eq!(traces[0]["upstream"], "api.openai.com");
    assert_eq!(traces[0]["request"]["messages"][0]["content"], "hi", "{:#}", traces[0]);

    // A client that does not trust llmtap's CA: its handshake fails, counted, logged once.
    for _ in 0..3 {
        let (status, _, tcp) = connect(tap.addr, "api.anthropic.com:443", "").await;
        assert_eq!(status, 200);
        let refused = tls_connector(&[&up.ca_pem_path])
            .connect("api.anthropic.com".try_into().unwrap(), tcp)
            .await;
        assert!(refused.is_err(), "a client without llmtap's CA refuses its certificate");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while tap.metric("llmtap_forward_handshake_failures_total") < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(tap.metric("llmtap_forward_handshake_failures_total"), 3);
    let logged = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("refused llmtap's certificate"))
        .count();
    assert_eq!(logged, 1, "logged once");
    assert!(up.received().is_empty(), "nothing reached the upstream");
}

#[test]
fn ca_command_prints_path_and_fingerprint_and_rotates() {
    let dir = tempfile::tempdir().unwrap();
    let ca = |args: &[&str]| {
        let out = llmtap_command()
            .arg("ca")
            .args(args)
            .arg("--data-dir")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let fingerprint = |text: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix("SHA-256:"))
            .unwrap()
            .trim()
            .to_owned()
    };
    let first = ca(&[]);
    assert!(first.contains("(created now)"));
    assert!(first.contains(&ca_path(dir.path()).display().to_string()));
    assert!(first.contains("NODE_EXTRA_CA_CERTS") && first.contains("update-ca-certificates"));
    let again = ca(&[]);
    assert!(!again.contains("(created now)"));
    assert_eq!(fingerprint(&first), fingerprint(&again));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let key = dir.path().join("ca/llmtap-ca-key.pem");
        assert_eq!(std::fs::metadata(key).unwrap().permissions().mode() & 0o777, 0o600);
    }
    let rotated = ca(&["--rotate"]);
    assert_ne!(fingerprint(&rotated), fingerprint(&first));
}

/// A TLS server for `api.openai.com` that accepts a WebSocket upgrade and echoes what follows. Returns its
/// address and the PEM file of its self-signed certificate.
async fn websocket_echo_server(dir: &Path) -> (SocketAddr, PathBuf) {
    let cert = rcgen::generate_simple_self_signed(vec!["api.openai.com".to_owned()]).unwrap();
    let pem = dir.join("ws-ca.pem");
    std::fs::write(&pem, cert.cert.pem()).unwrap();
    let key = rustls_pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper::service::service_fn(|mut req: http::Request<hyper::body::Incoming>| async move {
                    let upgrade = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        if let Ok(upgraded) = upgrade.await {
                            let (mut r, mut w) = tokio::io::split(TokioIo::new(upgraded));
                            let _ = tokio::io::copy(&mut r, &mut w).await;
                        }
                    });
                    let resp = http::Response::builder()
                        .status(101)
                        .header("connection", "upgrade")
                        .header("upgrade", "websocket")
                        .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
                        .body(http_body_util::Empty::<Bytes>::new())
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .with_upgrades()
                    .await;
            });
        }
    });
    (addr, pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrades_on_intercepted_hosts_are_relayed() {
    let dir = tempfile::tempdir().unwrap();
    let (ws, ws_ca) = websocket_echo_server(dir.path()).await;
    let config = format!(
        "[api]\nlisten = \"off\"\n[forward]\nca_file = \"{}\"\n[forward.resolve]\n\"api.openai.com\" = \"{ws}\"\n",
        ws_ca.display()
    );
    let tap = Llmtap::start(&config, &dir.path().join("data"));
    tap.cli(&["ca"]);
    let (status, _, tcp) = connect(tap.addr, "api.openai.com:443", "").await;
    assert_eq!(status, 200);
    let ca = ca_path(&tap.data_dir);
    let tls = tls_connector(&[&ca])
        .connect("api.openai.com".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn.with_upgrades());
    let req = http::Request::get("/v1/sockets/echo?x=1")
        .header("host", "api.openai.com")
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 101);
    assert_eq!(resp.headers()["sec-websocket-accept"], "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    let mut upgraded = TokioIo::new(hyper::upgrade::on(resp).await.unwrap());
    // A masked WebSocket text frame, as bytes: the relay passes them through unread.
    let frame = [0x81u8, 0x84, 1, 2, 3, 4, b'p' ^ 1, b'i' ^ 2, b'n' ^ 3, b'g' ^ 4];
    upgraded.write_all(&frame).await.unwrap();
    let mut echoed = [0u8; 10];
    tokio::time::timeout(std::time::Duration::from_secs(10), upgraded.read_exact(&mut echoed))
        .await
        .expect("echo within 10 s")
        .unwrap();
    assert_eq!(echoed, frame);
    // The socket is captured as base-URL mode captures it: a path no adapter reads is kept raw, under the
    // intercepted host's label, once the socket closes.
    let close = [0x88u8, 0x80, 9, 9, 9, 9];
    upgraded.write_all(&close).await.unwrap();
    drop(upgraded);
    let traces = tap.wait_for_traces(1);
    let t = traces
        .iter()
        .find(|t| t["path"] == "/v1/sockets/echo?x=1")
        .unwrap_or_else(|| panic!("the tunnel's socket is kept raw: {traces:#?}"));
    assert_eq!(t["api"], "other", "{t:#}");
    assert_eq!(t["upstream"], "openai", "{t:#}");
    assert_eq!(t["request"].as_str(), Some("ping\n"), "{t:#}");
}

/// `HTTP_PROXY` (set by `llmtap run`): plain http:// requests in absolute form. The OpenAI SDK's calls to a host on
/// the intercept list (`[forward] intercept`) are forwarded with their `Host` and bytes and captured in the run's
/// session; a host off the list is forwarded, counted and never stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_through_http_proxy_is_captured_on_intercepted_hosts_and_relayed_blind_elsewhere() {
    let up = Scripted::start_plain().await;
    let other = Scripted::start_plain().await;
    let dir = tempfile::tempdir().unwrap();
    let config = upstream_config(
        &up,
        &format!(
            "[forward]\nintercept = [\"llm.internal\"]\n[forward.resolve]\n\"llm.internal\" = \"{}\"\n\"other.internal\" = \"{}\"\n",
            up.addr, other.addr
        ),
    );
    let tap = Llmtap::start(&config, dir.path());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/forward_plain_http.py");
    let mut cmd = run_command(&tap, &config, &["--session", "fwd-plain", "--"]);
    cmd.arg(python())
        .arg(script)
        .args(["llm.internal", "other.internal"])
        .env_remove("OPENAI_BASE_URL")
        .env("OPENAI_API_KEY", "sk-test-PLAINSECRET-openai");
    let run = run_client(cmd, 60).await;
    let r: Value =
        serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {} {}", run.stdout, run.stderr));
    assert_eq!(r["openai_chat"]["content"], SCRIPTED_TEXT);
    assert_eq!(r["openai_stream"]["text"], SCRIPTED_TEXT);
    assert_eq!(r["blind"]["status"], 200);

    // The upstream saw the client's own Host, and no proxy credentials.
    let received = up.received();
    assert_eq!(received.len(), 2, "{}", up.dump());
    for rec in &received {
        assert_eq!(rec.headers.get("host").unwrap(), "llm.internal");
        assert!(rec.headers.get("proxy-authorization").is_none());
        assert_eq!(rec.path, "/v1/chat/completions");
    }
    // Bytes unchanged both ways, usage exact, in the run's session, the real host recorded.
    let traces = up.assert_captured(&tap);
    assert_eq!(traces.len(), 2);
    for t in &traces {
        assert_eq!(t["api"], "openai.chat", "{t:#}");
        assert_eq!(t["upstream"], "llm.internal", "{t:#}");
        assert_eq!(t["session_id"], "fwd-plain", "{t:#}");
        assert_eq!(t["headers"]["request"]["host"], "llm.internal");
    }
    // The host off the list: forwarded byte for byte, counted, not captured.
    let sent = other.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(r["blind"]["body"].as_str().unwrap().as_bytes(), sent[0].body.as_slice());
    assert_eq!(other.received()[0].headers.get("host").unwrap(), "other.internal");
    assert_eq!(tap.metric("llmtap_forward_intercepted_total"), 2);
    assert_eq!(tap.metric("llmtap_forward_blind_total"), 1);
    tap.wait_settled();
    assert_eq!(
        tap.export("provider-traces", &[]).len(),
        2,
        "the blind call is not stored"
    );
    assert_eq!(files_containing(&tap.data_dir, "PLAINSECRET"), Vec::<PathBuf>::new());
}

/// Raw absolute-form requests on loopback: an http:// request line is forwarded without credentials (the same
/// trust as base-URL mode; beyond loopback the token rule is CONNECT's, see the unit tests of `intercept`), an
/// https:// one is refused (clients send CONNECT for those) and counted, and base-URL requests still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_requests_on_the_proxy_port() {
    let up = Scripted::start_plain().await;
    let resolve = format!(
        "[forward]\nintercept = [\"llm.internal\"]\n[forward.resolve]\n\"llm.internal\" = \"{}\"\n",
        up.addr
    );
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&upstream_config(&up, &resolve), dir.path());
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;
    let send = |uri: &'static str| {
        let proxy = tap.addr;
        async move {
            let mut tcp = TcpStream::connect(proxy).await.unwrap();
            let req = format!(
                "POST {uri} HTTP/1.1\r\nHost: llm.internal\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            tcp.write_all(req.as_bytes()).await.unwrap();
            read_head(&mut tcp).await
        }
    };
    let status = |head: &str| head.split(' ').nth(1).unwrap_or_default().to_owned();
    let head = send("http://llm.internal/v1/chat/completions").await;
    assert_eq!(status(&head), "200", "{head}");
    let head = send("https://llm.internal/v1/chat/completions").await;
    assert_eq!(status(&head), "400", "{head}");
    assert_eq!(up.received().len(), 1, "only the http:// request reached the upstream");
    assert_eq!(tap.metric("llmtap_forward_refused_total"), 1);
    assert_eq!(tap.metric("llmtap_forward_intercepted_total"), 1);
    assert_eq!(up.assert_captured(&tap).len(), 1);
}

/// A tunnel is the client connection it came on: it keeps that connection's slot under `max_connections`, so
/// another client waits until it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intercepted_tunnel_counts_against_max_connections() {
    let up = Upstream::start(ReplayOptions {
        event_delay: std::time::Duration::from_millis(20),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tap = Llmtap::start(&forward_config(&up, "[server]\nmax_connections = 1\n"), dir.path());
    let (status, _, tcp) = connect(tap.addr, "api.openai.com:443", "").await;
    assert_eq!(status, 200);
    let tls = tls_connector(&[&ca_path(dir.path())])
        .connect("api.openai.com".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    let conn = tokio::spawn(conn);
    let stream_req = || {
        http::Request::post("/v1/chat/completions")
            .header("host", "api.openai.com")
            .header("x-replay-scenario", "slow-stream")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"count"}]}"#,
            )))
            .unwrap()
    };
    let first = sender.send_request(stream_req()).await.unwrap();
    assert_eq!(first.status(), 200);
    first.into_body().collect().await.unwrap();

    // Another client while the tunnel is open: it waits in the backlog.
    let healthz = tokio::spawn({
        let url = tap.url("/healthz");
        async move { client().get(url.parse().unwrap()).await.map(|r| r.status().as_u16()) }
    });
    // A whole stream through the tunnel (~0.8 s of events) while the other client waits.
    sender.ready().await.unwrap();
    let second = sender.send_request(stream_req()).await.unwrap();
    let text = second.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).contains("[DONE]"));
    assert!(!healthz.is_finished(), "the tunnel holds the only connection slot");

    // The tunnel closes: its slot goes to the waiting client.
    drop(sender);
    let _ = conn.await;
    let answered = tokio::time::timeout(std::time::Duration::from_secs(10), healthz).await;
    assert_eq!(answered.expect("served once the tunnel closed").unwrap().unwrap(), 200);
}

/// SIGTERM drains an intercepted tunnel as it drains a base-URL connection: a stream in flight through it
/// finishes, is captured complete, and llmtap then exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_stream_in_flight_through_a_tunnel_finish() {
    let up = Upstream::start(ReplayOptions {
        event_delay: std::time::Duration::from_millis(50),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut tap = Llmtap::start(&forward_config(&up, ""), dir.path());
    let (status, _, tcp) = connect(tap.addr, "api.openai.com:443", "").await;
    assert_eq!(status, 200);
    let tls = tls_connector(&[&ca_path(dir.path())])
        .connect("api.openai.com".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::post("/v1/chat/completions")
        .header("host", "api.openai.com")
        .header("x-replay-scenario", "slow-stream")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"count"}]}"#,
        )))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));
    // Shut down while the stream is in flight (it has ~2 s to go).
    Command::new("kill")
        .arg("-TERM")
        .arg(tap.pid().to_string())
        .status()
        .unwrap();
    let rest = body
        .collect()
        .await
        .expect("the stream completes after SIGTERM")
        .to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("tok39") && text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(tap.terminate().success());
    let out = llmtap_command()
        .args(["export", "--format", "provider-traces", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let traces: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(traces.len(), 1, "{traces:#?}");
    assert_eq!(traces[0]["outcome"], "complete");
    assert_eq!(traces[0]["upstream"], "api.openai.com");
}
