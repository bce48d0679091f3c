//! A real PostgreSQL server for the tests: one per test process, started on first use, one database per test.
//!
//! The binaries are Debian's `postgresql` package (scripts/test.sh installs it): `initdb` on PATH, else the
//! highest `/usr/lib/postgresql/*/bin`. The server lives in a fresh directory under
//! `$TMPDIR/llmtap-pg-tests/`, named after the test process (pid and start time), and listens on 127.0.0.1 on
//! a free port and on a unix socket in that directory, with trust authentication for the `postgres` user and
//! durability off (fsync, synchronous commit, full-page writes) for speed.
//!
//! PostgreSQL refuses to run as root: when the tests run as root (CI), initdb, postgres and pg_ctl run as the
//! `postgres` system user that the Debian package creates (through `setpriv`), over a directory chown'ed to it.
//!
//! Cleanup without a destructor (statics are never dropped): postgres runs under a small shell wrapper whose
//! watchdog sends it a fast shutdown and removes its directory once the test process is gone; and starting a
//! server first stops and removes what earlier test processes left behind if that watchdog died with them.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The shared PostgreSQL server of a test process.
pub struct Postgres {
    bin: PathBuf,
    /// `Some(name)` when the server runs as that system user (the tests run as root).
    run_as: Option<String>,
    /// The run directory (data, socket dir, log), removed by the watchdog when the test process exits.
    dir: PathBuf,
    port: u16,
    /// The wrapper (postgres and its watchdog) while the server runs.
    child: Mutex<Option<Child>>,
    databases: AtomicUsize,
}

/// The shared server of this test process, started on first use.
pub fn server() -> &'static Postgres {
    static SERVER: OnceLock<Postgres> = OnceLock::new();
    SERVER.get_or_init(Postgres::launch)
}

/// Watchdog around postgres: `$1` is the test process, `$2` the run directory, the rest the command. Exits
/// with postgres; when the test process is gone, shuts postgres down (fast) and removes the run directory.
const WRAPPER: &str = r#"owner=$1; run=$2; shift 2
"$@" &
pg=$!
( while [ -e "/proc/$owner" ]; do sleep 1; done
  kill -INT "$pg" 2>/dev/null
  while kill -0 "$pg" 2>/dev/null; do sleep 0.2; done
  rm -rf "$run" ) &
watch=$!
wait "$pg"
status=$?
if [ -e "/proc/$owner" ]; then kill "$watch" 2>/dev/null; fi
exit $status
"#;

const START_TIMEOUT: Duration = Duration::from_secs(60);

impl Postgres {
    fn launch() -> Postgres {
        let bin = bin_dir();
        let base = std::env::temp_dir().join("llmtap-pg-tests");
        std::fs::create_dir_all(&base).unwrap_or_else(|e| panic!("creating {}: {e}", base.display()));
        // Shared like /tmp: any user's test runs keep their directories here.
        let _ = std::fs::set_permissions(&base, std::os::unix::fs::PermissionsExt::from_mode(0o1777));
        remove_stale_servers(&base);

        let me = std::process::id();
        let dir = tempfile::Builder::new()
            .prefix(&format!("run-{me}-{}-", start_time(me).unwrap_or(0)))
            .tempdir_in(&base)
            .unwrap_or_else(|e| panic!("creating a run directory in {}: {e}", base.display()))
            .keep();
        let run_as = if effective_uid() == 0 {
            Some("postgres".to_owned())
        } else {
            None
        };
        std::fs::create_dir(dir.join("sock")).unwrap();
        if let Some(user) = &run_as {
            let (uid, gid) = (id_of(user, "-u"), id_of(user, "-g"));
            for d in [dir.clone(), dir.join("sock")] {
                std::os::unix::fs::chown(&d, Some(uid), Some(gid))
                    .unwrap_or_else(|e| panic!("chown {} to {user}: {e}", d.display()));
            }
        }

        let mut pg = Postgres {
            bin,
            run_as,
            dir,
            port: 0,
            child: Mutex::new(None),
            databases: AtomicUsize::new(0),
        };
        let out = pg
            .command("initdb")
            .arg("-D")
            .arg(pg.dir.join("data"))
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .unwrap_or_else(|e| panic!("running initdb: {e}"));
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // A free port can be taken by someone else between choosing and binding it: try a few.
        let mut last_error = String::new();
        for _ in 0..5 {
            pg.port = free_port();
            match pg.try_start() {
                Ok(()) => return pg,
                Err(e) => last_error = e,
            }
        }
        panic!("PostgreSQL did not start: {last_error}");
    }

    /// A new empty database with a unique name; returns its URL: postgres://postgres@127.0.0.1:PORT/NAME
    pub fn database(&self, label: &str) -> String {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let mut clean: String = label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        clean.truncate(40);
        let name = format!("t_{clean}_{n}");
        self.psql(&self.url("postgres"), &format!("CREATE DATABASE \"{name}\""));
        self.url(&name)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stop the server (fast shutdown) and wait until the port refuses connections.
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut wrapper) = child.take() else {
            return;
        };
        let out = self
            .command("pg_ctl")
            .arg("stop")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "-w", "-t", "60"])
            .output()
            .unwrap_or_else(|e| panic!("running pg_ctl: {e}"));
        assert!(
            out.status.success(),
            "pg_ctl stop failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The wrapper exits with postgres.
        let _ = wrapper.wait();
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_ok() {
            assert!(Instant::now() < deadline, "port {} still accepts after stop", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Start it again on the same port and data dir; returns when it accepts connections.
    pub fn start(&self) {
        self.try_start()
            .unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
    }

    /// Run SQL with psql against a database URL and return stdout (-At, tab-separated), panicking with psql's
    /// stderr on failure.
    pub fn psql(&self, url: &str, sql: &str) -> String {
        use std::io::Write;
        let mut child = Command::new(self.tool("psql"))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-F",
                "\t",
                "-v",
                "ON_ERROR_STOP=1",
                "-f",
                "-",
                "-d",
                url,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("running psql: {e}"));
        let mut stdin = child.stdin.take().unwrap();
        let sql = sql.to_owned();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(sql.as_bytes());
        });
        let out = child.wait_with_output().unwrap_or_else(|e| panic!("running psql: {e}"));
        let _ = writer.join();
        assert!(
            out.status.success(),
            "psql {url} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The path of a PostgreSQL program: the chosen bin directory, else PATH.
    fn tool(&self, name: &str) -> PathBuf {
        let p = self.bin.join(name);
        if p.exists() {
            return p;
        }
        on_path(name).unwrap_or_else(|| panic!("{name} is neither in {} nor on PATH", self.bin.display()))
    }

    /// A server-side program (initdb, postgres, pg_ctl), as the server's user.
    fn command(&self, name: &str) -> Command {
        let program = self.tool(name);
        let mut cmd = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={user}"))
                    .arg(format!("--regid={user}"))
                    .arg("--init-groups")
                    .arg("--")
                    .arg(program);
                c
            }
            None => Command::new(program),
        };
        // The test's working directory may not be readable by the server's user.
        cmd.current_dir(&self.dir);
        cmd
    }

    fn try_start(&self) -> Result<(), String> {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if child.is_some() {
            return Ok(());
        }
        let log_path = self.dir.join("postgres.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("opening {}: {e}", log_path.display()))?;
        let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
        let postgres = self.command("postgres");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(WRAPPER)
            .arg("llmtap-pg-wrapper")
            .arg(std::process::id().to_string())
            .arg(&self.dir)
            .arg(postgres.get_program())
            .args(postgres.get_args())
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-h", "127.0.0.1", "-k"])
            .arg(self.dir.join("sock"))
            .args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=200",
            ])
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let mut wrapper = cmd.spawn().map_err(|e| format!("spawning postgres: {e}"))?;
        let log_tail = || {
            let all = std::fs::read(&log_path).unwrap_or_default();
            String::from_utf8_lossy(all.get(log_start as usize..).unwrap_or_default()).into_owned()
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = wrapper.try_wait() {
                return Err(format!(
                    "postgres exited ({status}) on port {}:\n{}",
                    self.port,
                    log_tail()
                ));
            }
            let ready = Command::new(self.tool("pg_isready"))
                .args([
                    "-q",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                    "-d",
                    "postgres",
                ])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                *child = Some(wrapper);
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = Command::new("kill").arg("-INT").arg(wrapper.id().to_string()).status();
                let _ = wrapper.kill();
                let _ = wrapper.wait();
                return Err(format!("not ready after {START_TIMEOUT:?}:\n{}", log_tail()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The directory of the PostgreSQL programs: `initdb`'s on PATH, else the highest `/usr/lib/postgresql/*/bin`.
fn bin_dir() -> PathBuf {
    if let Some(initdb) = on_path("initdb") {
        let real = std::fs::canonicalize(&initdb).unwrap_or(initdb);
        if let Some(dir) = real.parent() {
            return dir.to_owned();
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .unwrap_or_else(|| panic!("no PostgreSQL: initdb is neither on PATH nor in /usr/lib/postgresql/*/bin (scripts/test.sh installs Debian's postgresql)"))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("choosing a free port: {e}"))
}

/// The effective uid of this process (from /proc: no libc here).
fn effective_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or_else(|| panic!("no effective uid in /proc/self/status"))
}

/// `id -u user` or `id -g user`.
fn id_of(user: &str, which: &str) -> u32 {
    let out = Command::new("id")
        .args([which, user])
        .output()
        .unwrap_or_else(|e| panic!("running id: {e}"));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or_else(|_| {
        panic!(
            "no user {user} to run PostgreSQL as (root cannot; Debian's postgresql package creates it): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A process's start time (clock ticks since boot), which tells it apart from a later one with the same pid.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22; the fields after the command name's closing parenthesis start at field 3.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Stop and remove the servers of test processes that are gone (their watchdog died with them).
fn remove_stale_servers(base: &Path) {
    for entry in std::fs::read_dir(base).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut parts = name.strip_prefix("run-").unwrap_or_default().split('-');
        let (Some(Ok(owner)), Some(Ok(started))) =
            (parts.next().map(str::parse::<u32>), parts.next().map(str::parse::<u64>))
        else {
            continue;
        };
        if start_time(owner) == Some(started) {
            continue; // a running test process's server
        }
        let dir = entry.path();
        let pid = std::fs::read_to_string(dir.join("data/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse::<u32>().ok());
        if let Some(pid) = pid {
            let is_postgres = std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("postgres"));
            if is_postgres {
                let _ = Command::new("kill").args(["-INT", &pid.to_string()]).status();
                let deadline = Instant::now() + Duration::from_secs(10);
                while alive(pid) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                if alive(pid) {
                    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
