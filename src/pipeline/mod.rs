//! The pipeline thread: capture queue → process (decode, reassemble, normalize) → price → derive → store.
//!
//! One OS thread, off the async workers, fed by the capture queue or, with the spill on, by the spill thread
//! in front of it (see `capture::spill`). It owns the deriver's state, so derivation needs no locks. It works in
//! passes: what the capture queue holds is processed back to back and handed to the store as one batch (one
//! wake-up of the writer per pass, not one per record). It ends when the capture queue closes (every
//! `CaptureTx` dropped, i.e. after the proxy drained), flushing the deriver's open trajectories first.

pub mod live;
pub mod pricing;
pub mod process;
pub mod secrets;

use crate::background::run_in_background;

use std::sync::Arc;
use std::sync::mpsc::RecvTimeoutError;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::capture::Source;
use crate::config::DeriveConfig;
use crate::derive::Deriver;
use crate::store::{Record, StoreTx};
use crate::telemetry::Metrics;

/// At most this many exchanges go into one batch for the store (about three records each), so a long backlog
/// is committed in pieces rather than held in one growing batch.
const EXCHANGES_PER_PASS: usize = 64;
/// A pass also ends once its exchanges held this many captured bytes: the store's channel holds a fixed number
/// of batches (`store::write`), so this bounds what waits there when bodies are large.
const BYTES_PER_PASS: u64 = 4 << 20;
/// While stopping: how long the queue must stay empty before the thread ends.
const STOPPING_POLL: Duration = Duration::from_millis(20);

/// What the pipeline thread works with besides its channels.
pub struct Settings {
    pub derive: DeriveConfig,
    /// `capture.max_body_bytes`: the most a body may decode to.
    pub body_cap: usize,
    pub prices: crate::cost::CostTable,
}

/// `rx` is the capture queue, or the spill stage's handoff when the spill is on (`capture::spill`).
pub fn spawn(
    mut rx: impl Source + 'static,
    store: StoreTx,
    settings: Settings,
    metrics: Arc<Metrics>,
    live: Option<live::LiveTx>,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("llmtap-pipeline".into())
        .spawn(move || {
            run_in_background();
            let Settings {
                derive,
                body_cap,
                prices,
            } = settings;
            let mut deriver = Deriver::new(derive);
            let tick = Duration::from_secs(1);
            let mut last_sweep = std::time::Instant::now();
            loop {
                // Wake up at least once a second to close idle trajectories; when stopping, look often so that
                // the thread ends as soon as the queue is empty.
                let wait = if stop.is_cancelled() { STOPPING_POLL } else { tick };
                let next = rx.recv_timeout(wait);
                let now = crate::capture::now_micros();
                match next {
                    Ok(first) => {
                        // One pass: this exchange and those already queued behind it, stored as one batch.
                        let mut records = Vec::new();
                        let (mut taken, mut bytes) = (0, 0);
                        let mut next = Some(first);
                        while let Some(exchange) = next.take() {
                            taken += 1;
                            bytes += exchange.held_bytes();
                            if taken < EXCHANGES_PER_PASS && bytes < BYTES_PER_PASS {
                                next = rx.try_recv();
                            }
                            let mut processed = process::process(exchange, body_cap);
                            pricing::price(&prices, &mut processed.trace, processed.call.as_ref(), &metrics);
                            for e in &processed.errors {
                                if let process::ProcessError::DecodedOverCap { .. } = e {
                                    metrics.capture_truncated.inc();
                                } else {
                                    metrics.process_error(e);
                                }
                            }
                            metrics.processed.inc();
                            records.extend(deriver.observe(processed.trace, processed.call));
                        }
                        emit(&store, &metrics, live.as_ref(), records);
                    }
                    // Shutdown: senders may outlive the grace period (a hung upstream on an HTTP/2 stream whose
                    // connection is gone), so the queue's being empty ends the thread, not its closing.
                    Err(RecvTimeoutError::Timeout) if stop.is_cancelled() => break,
                    // A second without traffic: give back what the store thread freed in our pages.
                    Err(RecvTimeoutError::Timeout) => crate::allocator::release_when_idle(),
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                // Idle closing walks every open trajectory: once a second, not once per call.
                if last_sweep.elapsed() >= tick {
                    last_sweep = std::time::Instant::now();
                    emit(&store, &metrics, live.as_ref(), deriver.close_idle(now));
                    metrics.derive_open_trajectories.set(deriver.open_trajectories() as u64);
                }
            }
            emit(&store, &metrics, live.as_ref(), deriver.close_all());
            metrics.derive_open_trajectories.set(0);
        })
}

fn emit(store: &StoreTx, metrics: &Metrics, live: Option<&live::LiveTx>, records: Vec<Record>) {
    let live = live.filter(|l| l.receiver_count() > 0);
    for r in &records {
        if let Record::Step(s) = r {
            metrics.steps_derived.inc();
            if let Some(l) = live {
                let _ = l.send(live::LiveEvent::Step(Arc::new((**s).clone())));
            }
        }
        if let (Record::Trace(t), Some(l)) = (r, live) {
            let _ = l.send(live::LiveEvent::Trace(Arc::new(t.head())));
        }
    }
    store.send(records);
}
