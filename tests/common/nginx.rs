//! Real nginx in front of llmtap replicas, as `config/nginx/llmtap.conf` ships (session affinity) or without its
//! `hash` line (round-robin), on a free loopback port with every path in a test directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

const NGINX_TEMPLATE: &str = include_str!("../../config/nginx/llmtap.conf");

/// nginx from Debian's package (scripts/test.sh installs nginx-light when missing).
pub fn nginx_bin() -> PathBuf {
    let found = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .or_else(|| which("nginx"));
    found.unwrap_or_else(|| panic!("nginx is not installed: run scripts/test.sh (it installs nginx-light)"))
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.exists())
}

/// SIGTERM to the master, then wait: it stops its workers (SIGKILL would orphan them, holding the port).
fn terminate(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Nginx {
    child: Child,
    port: u16,
    dir: PathBuf,
}

#[derive(Clone, Copy, PartialEq)]
pub enum Balance {
    /// config/nginx/llmtap.conf as shipped.
    Affinity,
    /// The same file without its `hash` line: nginx's default round-robin.
    RoundRobin,
}

/// config/nginx/llmtap.conf with the replicas' loopback addresses and a free listen port.
fn render(replicas: &[SocketAddr], port: u16, balance: Balance) -> String {
    let mut conf = NGINX_TEMPLATE.to_owned();
    let mut swap = |from: &str, to: &str| {
        assert!(conf.contains(from), "config/nginx/llmtap.conf has no `{from}`");
        conf = conf.replace(from, to);
    };
    for (i, r) in replicas.iter().enumerate() {
        swap(&format!("server llmtap-{i}:8787 "), &format!("server {r} "));
    }
    swap("listen 8080;", &format!("listen 127.0.0.1:{port};"));
    if balance == Balance::RoundRobin {
        swap("hash $llmtap_session consistent;", "");
    }
    conf
}

impl Nginx {
    /// nginx in its own directory under `dir`, balancing over `replicas`; returns once it listens.
    pub async fn start(replicas: &[SocketAddr], balance: Balance, dir: &Path) -> Nginx {
        let port = free_port();
        let dir = dir.join(format!("nginx-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("llmtap.conf"), render(replicas, port, balance)).unwrap();
        // The main context a distribution's nginx.conf would provide, with every path in the temp dir; the access
        // log records which replicas nginx tried for each request.
        let d = dir.display();
        let main = format!(
            "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  log_format replicas '$http_x_llmtap_session|$upstream_addr|$status';\n  \
             access_log {d}/access.log replicas;\n  client_body_temp_path {d}/client_body;\n  \
             proxy_temp_path {d}/proxy;\n  include {d}/llmtap.conf;\n}}\n"
        );
        std::fs::write(dir.join("nginx.conf"), main).unwrap();
        let child = Command::new(nginx_bin())
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .spawn()
            .unwrap();
        let nginx = Nginx { child, port, dir };
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nginx did not listen: {}",
                nginx.dir.display()
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        nginx
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// (session, upstream addresses tried, status) per request.
    pub fn access_log(&self) -> Vec<(String, String, String)> {
        std::fs::read_to_string(self.dir.join("access.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let mut f = l.splitn(3, '|').map(str::to_owned);
                (f.next().unwrap(), f.next().unwrap(), f.next().unwrap())
            })
            .collect()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM to the master: it stops its workers (SIGKILL would orphan them, holding the port).
        terminate(&mut self.child);
    }
}
