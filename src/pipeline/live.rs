//! The pipeline's live feed: every step and call as derivation finishes it, for whoever listens (the gRPC API's
//! `Subscribe` today). A broadcast channel: a listener that falls behind misses events, never slows the
//! pipeline; with nobody listening, nothing is built.

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
