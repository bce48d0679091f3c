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
