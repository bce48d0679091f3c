//! Real agent clients for the tests: where `scripts/test.sh` installed them (npm packages in
//! `tests/clients/node_modules`, Python packages in `.venv`) and how to run one with a deadline.

use std::time::Instant;

use super::*;

/// `tests/clients`: the committed package.json / package-lock.json and, once installed, node_modules.
pub fn node_clients_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// An installed npm package's directory; fails with the install command when it is missing.
pub fn node_package(name: &str) -> PathBuf {
    let dir = node_clients_dir().join("node_modules").join(name);
    assert!(
        dir.join("package.json").exists(),
        "{name} is not installed: run scripts/test.sh (or `npm ci --prefix tests/clients`)"
    );
    dir
}

/// The virtualenv's Python (`LLMTAP_TEST_PYTHON` overrides), with the packages of tests/sdk/requirements.txt.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("LLMTAP_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "the client tests need the Python packages of tests/sdk/requirements.txt: run scripts/test.sh (creates .venv) or set LLMTAP_TEST_PYTHON"
    );
    venv
}

/// The output of a client run.
pub struct Run {
    pub stdout: String,
    pub stderr: String,
    pub secs: f64,
}

/// Run `command` to its end (killed after `limit_secs`), on a blocking thread; panics with its output when it
/// fails or times out.
pub async fn run_client(mut command: Command, limit_secs: u64) -> Run {
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let killer = std::thread::spawn(move || {
            if done_rx.recv_timeout(Duration::from_secs(limit_secs)).is_err() {
                let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
            }
        });
        let out = child.wait_with_output().unwrap();
        let _ = done_tx.send(());
        let _ = killer.join();
        out
    })
    .await
    .unwrap();
    let run = Run {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        secs: started.elapsed().as_secs_f64(),
    };
    assert!(
        out.status.success(),
        "client failed ({:?}, {:.1} s):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        run.secs,
        run.stdout,
        run.stderr
    );
    run
}

/// Every file under `dir` that contains `needle` (to prove a secret was stored nowhere).
pub fn files_containing(dir: &Path, needle: &str) -> Vec<PathBuf> {
    super::files_under(dir)
        .into_iter()
        .filter(|path| std::fs::read(path).is_ok_and(|b| String::from_utf8_lossy(&b).contains(needle)))
        .collect()
}
