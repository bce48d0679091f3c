//! `llmtap serve`'s log as a person and as a log shipper get it, through the real binary: plain text on a pipe
//! (no ANSI escapes), colour on a terminal (script(1) gives it a pseudo-terminal, as tests/cost_live.rs does for
//! `tail`), and with `log_format = "json"` one JSON object per line with its level and message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// No API or viewer: nothing but the proxy's port, which the test harness picks.
const QUIET: &str = "[api]\nlisten = \"off\"\n[viewer]\nlisten = \"off\"\n";
const SHUTDOWN: &str = "Shutdown signal received";

/// The log's lines once one satisfies `done` (the reader thread may still be draining the pipe when llmtap has
/// exited), or fail after 20 s.
fn lines_once(log: &Arc<Mutex<Vec<String>>>, done: impl Fn(&str) -> bool) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let lines = log.lock().unwrap().clone();
        if lines.iter().any(|l| done(l)) {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "the awaited line never came; the log:\n{}",
            lines.join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn serve_logs_plain_text_to_a_pipe() {
    let dir = tempfile::tempdir().unwrap();
    // NO_COLOR empty counts as unset: only the pipe keeps colour out.
    let (mut tap, log) =
        Llmtap::start_capturing_log_with_env(QUIET, dir.path(), &[("RUST_LOG", "info"), ("NO_COLOR", "")]);
    assert!(tap.terminate().success());
    let lines = lines_once(&log, |l| l.contains(SHUTDOWN));
    assert!(lines.iter().any(|l| l.contains("Started")), "{lines:?}");
    for line in &lines {
        assert!(!line.contains('\x1b'), "an escape code in a piped log: {line:?}");
    }
}

#[test]
fn serve_logs_one_json_object_per_line_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!("log_format = \"json\"\n{QUIET}");
    let (mut tap, log) = Llmtap::start_capturing_log_with_env(&config, dir.path(), &[("RUST_LOG", "info")]);
    assert!(tap.terminate().success());
    let lines = lines_once(&log, |l| l.contains(SHUTDOWN));
    let events: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON object ({e}): {l:?}")))
        .collect();
    for e in &events {
        assert!(e["level"].is_string() && e["message"].is_string(), "{e}");
        assert!(e["timestamp"].is_string(), "{e}");
    }
    let started = events
        .iter()
        .find(|e| e["message"] == "Started")
        .expect("the start event");
    assert_eq!(started["level"], "INFO");
    assert_eq!(
        started["listen"],
        tap.addr.to_string(),
        "the event's fields sit beside the message: {started}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["message"].as_str().unwrap().starts_with(SHUTDOWN)),
        "{events:?}"
    );
}

#[test]
fn serve_logs_in_colour_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("llmtap.toml");
    std::fs::write(&config_path, QUIET).unwrap();
    // script(1) runs the command with stdout and stderr on a pty; `exec` keeps the shell's pid for llmtap.
    let serve = format!(
        "echo pid $$; exec {} serve --listen 127.0.0.1:0 --config {} --data-dir {}",
        bin(),
        config_path.display(),
        dir.path().display()
    );
    let mut in_pty = Command::new("script");
    in_pty.args(["-q", "-f", "-e", "-c", &serve, "/dev/null"]);
    clean_env(&mut in_pty).env_remove("NO_COLOR").env("RUST_LOG", "info");
    let mut child = in_pty.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                return;
            }
            sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        let shown = text.lock().unwrap().clone();
        if shown.contains("Started") {
            let pid = shown.split("pid ").nth(1).and_then(|r| r.split_whitespace().next());
            break pid.expect("the shell's pid").to_owned();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("llmtap did not start on the terminal:\n{shown}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert!(
        child.wait().unwrap().success(),
        "script(1) passes on llmtap's exit status"
    );
    reader.join().unwrap();
    let shown = text.lock().unwrap().clone();
    let started = shown.lines().find(|l| l.contains("Started")).unwrap();
    assert!(
        started.contains("\x1b["),
        "a log on a terminal is coloured: {started:?}"
    );
    let shutdown = shown.lines().find(|l| l.contains(SHUTDOWN));
    assert!(shutdown.is_some_and(|l| l.contains("\x1b[")), "{shown:?}");
}

/// With JSON logs, the error that stops `serve` (here: its port is taken) is a JSON event too.
#[test]
fn a_fatal_error_is_a_json_event_too() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("llmtap.toml");
    std::fs::write(&config_path, format!("log_format = \"json\"\n{QUIET}")).unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = llmtap_command()
        .args([
            "serve",
            "--listen",
            &taken.local_addr().unwrap().to_string(),
            "--config",
        ])
        .arg(&config_path)
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    let events: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON object ({e}): {l:?}")))
        .collect();
    let last = events.last().expect("the error is logged");
    assert_eq!(last["level"], "ERROR", "{stderr}");
    assert_eq!(last["message"], "llmtap stopped", "{stderr}");
    assert!(last["error"].as_str().is_some_and(|e| !e.is_empty()), "{stderr}");
}
