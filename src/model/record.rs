//! What derivation produces and the store keeps: one pipeline pass yields records, written in one batch.

use super::step::{Step, TrajectorySummary};
use super::trace::ProviderTrace;

#[derive(Debug, Clone)]
pub enum Record {
    Trace(Box<ProviderTrace>),
    /// A step, new or updated with late facts (observations, classification): upserted by id.
    Step(Box<Step>),
    Trajectory(Box<TrajectorySummary>),
}
