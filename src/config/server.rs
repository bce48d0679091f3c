//! `[server]`: limits on the listening side. A slow or idle client must not hold a connection (and its file
//! descriptor and buffers) forever, and no number of clients may exhaust the process's file descriptors.

use std::time::Duration;

use serde::Deserialize;

use super::serde_units::{at_least_one, positive_secs, secs};

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// A client must send a request's whole header block within this time (hyper's default, 30 s). For
    /// HTTP/1.1 the clock also runs while a kept-alive connection waits for its next request.
    #[serde(rename = "header_read_timeout_secs", deserialize_with = "positive_secs")]
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed (nginx's `keepalive_timeout`, 75 s).
    #[serde(rename = "idle_timeout_secs", deserialize_with = "positive_secs")]
    pub idle_timeout: Duration,
    /// A client that sends nothing of a request body it started for this long has its connection closed
    /// (nginx's `client_body_timeout`, 60 s): a stalled upload holds its socket and an upstream connection.
    #[serde(rename = "body_read_timeout_secs", deserialize_with = "positive_secs")]
    pub body_read_timeout: Duration,
    /// A client that takes nothing of a response body for this long has its connection closed (nginx's
    /// `send_timeout`, 60 s).
    #[serde(rename = "send_timeout_secs", deserialize_with = "positive_secs")]
    pub send_timeout: Duration,
    /// Connections served at once; beyond it llmtap stops accepting until one closes (they wait in the
    /// kernel's backlog), like nginx's `worker_connections`.
    #[serde(deserialize_with = "at_least_one")]
    pub max_connections: usize,
    /// Threads of the proxy's data path (its own runtime; the API, viewer and exporters run elsewhere). One
    /// carries tens of thousands of kept-alive exchanges a second and costs least per exchange; more are for a
    /// shared gateway that needs more than one core for traffic (see `app::proxy_runtime`).
    #[serde(deserialize_with = "at_least_one")]
    pub workers: usize,
    /// After SIGTERM/SIGINT, how long in-flight exchanges may take before their connections are closed
    /// (0: close them at once).
    #[serde(rename = "shutdown_grace_secs", deserialize_with = "secs")]
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(75),
            body_read_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_connections: 4096,
            workers: 1,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}
