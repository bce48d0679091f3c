//! Upgraded sockets (WebSocket relays) outlive the HTTP exchange that opened them: once both sides have switched
//! protocols, hyper lets go of the client's connection and the relay goes on as a task of its own. Here those
//! tasks are kept track of, as the accept loop keeps track of connections:
//! - each keeps the `max_connections` slot of the connection it came on ([`ConnSlot`], which the accept loop
//!   puts on every upgrade request), so open sockets count against the limit as the connections they were;
//! - they are counted: `llmtap_websockets_total`, and `llmtap_websockets_open` while they relay;
//! - at shutdown they are closed once the HTTP connections have drained (at the latest when the grace is over),
//!   and the proxy returns only after that, so their capture (cut short, marked) reaches the pipeline before it
//!   stops.
//!
//! Why closed rather than waited for: a socket has no end of request that a proxy sees (Codex keeps its
//! Responses socket open between turns), so waiting for it would hold every shutdown for the whole grace. A turn
//! that is still streaming when llmtap stops is captured as far as it went and marked truncated.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::telemetry::Metrics;

/// The `max_connections` slot of the connection an upgrade request came on: held by the socket while it lives.
#[derive(Clone)]
pub struct ConnSlot(pub Arc<tokio::sync::OwnedSemaphorePermit>);

pub struct Sockets {
    tasks: TaskTracker,
    close: CancellationToken,
    metrics: Arc<Metrics>,
}

/// Counts one open socket while it lives.
struct Open(Arc<Metrics>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.websockets_open.sub(1);
    }
}

impl Sockets {
    pub fn new(metrics: Arc<Metrics>) -> Sockets {
        Sockets {
            tasks: TaskTracker::new(),
            close: CancellationToken::new(),
            metrics,
        }
    }

    /// Runs one socket's relay until it ends or the sockets are closed. `slot` is held until then.
    pub fn spawn(&self, slot: Option<ConnSlot>, relay: impl Future<Output = ()> + Send + 'static) {
        self.metrics.websockets.inc();
        self.metrics.websockets_open.add(1);
        let open = Open(self.metrics.clone());
        let close = self.close.clone();
        self.tasks.spawn(async move {
            let (_open, _slot) = (open, slot);
            tokio::select! {
                _ = relay => {}
                // Dropping the relay drops both connections and the capture taps (whose socket ends marked).
                _ = close.cancelled() => {}
            }
        });
    }

    /// Closes every open socket (and any opened from now on) and waits until their tasks have let go of them.
    pub async fn close(&self) {
        self.close.cancel();
        self.tasks.close();
        // A relay's drop is synchronous; the bound only guards against a task that never gets polled again.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.tasks.wait()).await;
    }
}
