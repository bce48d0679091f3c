//! The pipeline thread: capture queue → process (decode, reassemble, normalize) → derive → store.
//!
//! One OS thread, off the async workers. It owns the deriver's state, so derivation needs no locks. It works in
//! passes: what the capture queue holds is processed back to back and handed to the store as one batch (one
//! wake-up of the writer per pass, not one per record). It ends when the capture queue closes (every
//! `CaptureTx` dropped, i.e. after the proxy drained), flushing the deriver's open trajectories first.

pub mod process;
pub mod secrets;

use std::sync::Arc;
use std::sync::mpsc::RecvTimeoutError;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::capture::CaptureRx;
use crate::config::DeriveConfig;
use crate::derive::Deriver;
use crate::store::{Record, StoreTx};
use crate::telemetry::Metrics;

/// At most this many exchanges go into one batch for the store (about three records each), so a long backlog
/// is committed in pieces rather than held in one growing batch.
const EXCHANGES_PER_PASS: usize = 64;

pub fn spawn(
    mut rx: CaptureRx,
    store: StoreTx,
    derive: DeriveConfig,
    metrics: Arc<Metrics>,
    live: Option<crate::api::LiveTx>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("llmtap-pipeline".into())
        .spawn(move || {
            run_in_background();
            let mut deriver = Deriver::new(derive);
            let tick = Duration::from_secs(1);
            let mut last_sweep = std::time::Instant::now();
            loop {
                // Wake up at least once a second to close idle trajectories.
                let next = rx.recv_timeout(tick);
                let now = crate::capture::now_micros();
                match next {
                    Ok(first) => {
                        // One pass: this exchange and those already queued behind it, stored as one batch.
                        let queued = std::iter::from_fn(|| rx.try_recv());
                        let mut records = Vec::new();
                        for exchange in std::iter::once(first).chain(queued).take(EXCHANGES_PER_PASS) {
                            let processed = process::process(exchange);
                            for e in &processed.errors {
                                metrics.process_error(e);
                            }
                            metrics.processed.inc();
                            records.extend(deriver.observe(processed));
                        }
                        emit(&store, &metrics, live.as_ref(), records);
                    }
                    // A second without traffic: give back what the store thread freed in our pages.
                    Err(RecvTimeoutError::Timeout) => crate::allocator::release_when_idle(),
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                // Idle closing walks every open trajectory: once a second, not once per call.
                if last_sweep.elapsed() >= tick {
                    last_sweep = std::time::Instant::now();
                    emit(&store, &metrics, live.as_ref(), deriver.close_idle(now));
                }
            }
            emit(&store, &metrics, live.as_ref(), deriver.close_all());
        })
}

fn emit(store: &StoreTx, metrics: &Metrics, live: Option<&crate::api::LiveTx>, records: Vec<Record>) {
    let live = live.filter(|l| l.receiver_count() > 0);
    for r in &records {
        if let Record::Step(s) = r {
            metrics.steps_derived.inc();
            if let Some(l) = live {
                let _ = l.send(crate::api::LiveEvent::Step(Arc::new((**s).clone())));
            }
        }
        if let (Record::Trace(t), Some(l)) = (r, live) {
            let _ = l.send(crate::api::LiveEvent::Trace(Arc::new(crate::api::trace_summary(t))));
        }
    }
    store.send(records);
}

/// Capture work must never take CPU from the data path: on a busy machine the pipeline and store threads yield
/// (nice 19), fall behind, and the bounded capture queue drops and counts instead of slowing traffic.
pub fn run_in_background() {
    // Linux: SCHED_IDLE, so a data-path thread that wakes up preempts capture work at once instead of waiting
    // for the scheduler's next decision (nice 19 only shrinks the share). The work still gets every idle
    // cycle; under sustained saturation the bounded capture queue drops and counts instead of slowing traffic.
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{
            NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy, thread_native_id,
        };
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        if set_thread_priority_and_policy(thread_native_id(), thread_priority::ThreadPriority::Min, idle).is_ok() {
            return;
        }
    }
    if let Err(error) = thread_priority::set_current_thread_priority(thread_priority::ThreadPriority::Min) {
        tracing::debug!(?error, "Could not lower the priority of a background thread");
    }
}
