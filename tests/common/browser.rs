//! The browser tests' shared setup: Chromium and playwright-core (both installed by `scripts/test.sh`).

use std::path::PathBuf;

/// Where the browser scripts and their `node_modules` live.
pub fn browser_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// The Chromium to drive (`$CHROMIUM`, else Debian's); fails the test with how to install what is missing.
pub fn require_browser() -> String {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        std::path::Path::new(&chromium).exists(),
        "{chromium} is missing: run scripts/test.sh (it installs Debian's chromium)"
    );
    assert!(
        browser_dir().join("node_modules/playwright-core").exists(),
        "tests/browser/node_modules is missing: run scripts/test.sh (it runs npm ci there)"
    );
    chromium
}

/// Run `tests/browser/<script>` with `args` against `chromium` and return the JSON it printed after `REPORT `
/// (the scripts only act and look; the tests assert). The script must exit successfully and report.
pub fn run_script<S: AsRef<std::ffi::OsStr>>(chromium: &str, script: &str, args: &[S]) -> serde_json::Value {
    let out = std::process::Command::new("node")
        .arg(browser_dir().join(script))
        .args(args)
        .env("CHROMIUM", chromium)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "{script} failed");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let report = stdout
        .lines()
        .find_map(|l| l.strip_prefix("REPORT "))
        .unwrap_or_else(|| panic!("{script} printed no report: {stdout}"));
    serde_json::from_str(report).unwrap()
}
