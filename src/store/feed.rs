//! The commit feed: every step and call the store writer has just committed, for whoever listens (the gRPC
//! API's `Subscribe`, the viewer's live events), published after the commit so that a listener that reads the
//! store on an event finds the record there. A broadcast channel: a listener that falls behind misses events
//! (and is told how many), never slows the writer; with nobody listening, nothing is built. The export log and
//! the sinks' cursors remain the catch-up path after a restart or an overflow.

use std::sync::Arc;

use tokio::sync::broadcast;

use crate::model::step::Step;
use crate::model::trace::TraceHead;

#[derive(Debug, Clone)]
pub enum LiveEvent {
    Step(Arc<Step>),
    Trace(Arc<TraceHead>),
}

pub type LiveTx = broadcast::Sender<LiveEvent>;

pub fn live_channel() -> LiveTx {
    broadcast::channel(4096).0
}

/// What the store writer publishes after each commit: every committed step and call for live listeners, and a
/// count of commits that sinks wait on instead of polling the store (they then read the export log behind their
/// cursor, which stays the catch-up path after a restart).
#[derive(Clone)]
pub struct CommitFeed {
    pub live: LiveTx,
    pub commits: Arc<tokio::sync::watch::Sender<u64>>,
}

impl CommitFeed {
    pub fn new(live: LiveTx) -> CommitFeed {
        CommitFeed {
            live,
            commits: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// A sink's view of the commit count.
    pub fn commits(&self) -> tokio::sync::watch::Receiver<u64> {
        self.commits.subscribe()
    }
}
