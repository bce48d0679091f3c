//! The pipeline thread: capture queue → process (decode, reassemble, normalize) → price → derive → store.
//!
//! One OS thread, off the async workers, fed by the capture queue or, with the spill on, by the spill thread
//! in front of it (see `capture::spill`). It owns the deriver's state, so derivation needs no locks. It works in
//! passes: what the capture queue holds is processed back to back and handed to the store as one batch (one
//! wake-up of the writer per pass, not one per record). It ends when the capture queue closes (every
//! `CaptureTx` dropped, i.e. after the proxy drained), flushing the deriver's open trajectories first.

pub mod pricing;
pub mod process;
pub mod secrets;

use crate::background::{YieldToDataPath, run_in_background};

use std::sync::Arc;
use std::sync::mpsc::RecvTimeoutError;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::capture::{RawExchange, Source};
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
    /// With the capture spill on: its `capture.spill_bytes`. The pipeline then waits while the data path
    /// needs the CPU, as long as the spill is less than half full (see `background::deferral`).
    pub spill_limit: Option<u64>,
}

/// `rx` is the capture queue, or the spill stage's handoff when the spill is on (`capture::spill`).
pub fn spawn(
    mut rx: impl Source + 'static,
    store: StoreTx,
    settings: Settings,
    metrics: Arc<Metrics>,
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
                spill_limit,
            } = settings;
            let mut deriver = Deriver::new(derive);
            let tick = Duration::from_secs(1);
            let mut last_sweep = std::time::Instant::now();
            let mut spill_room = spill_limit.map(|limit| SpillRoom::new(limit, &metrics));
            let mut yielding = YieldToDataPath::default();
            loop {
                // Wake up at least once a second to close idle trajectories; when stopping, look often so that
                // the thread ends as soon as the queue is empty.
                let wait = if stop.is_cancelled() { STOPPING_POLL } else { tick };
                let next = rx.recv_timeout(wait);
                if next.is_ok()
                    && let Some(room) = spill_room.as_mut()
                {
                    // Holding the oldest exchange, the rest waiting behind it in order. Stopping: no more waiting.
                    while !stop.is_cancelled()
                        && let Some(pause) = yielding.pause(|| room.allows_waiting(&metrics))
                    {
                        metrics.pipeline_deferred_ms.add(pause.as_millis() as u64);
                        std::thread::sleep(pause);
                    }
                }
                let now = crate::capture::now_micros();
                match next {
                    Ok(first) => {
                        // One pass: this exchange and those already queued behind it, stored as one batch.
                        let mut records = Vec::new();
                        let mut exchanges = 0;
                        let mut pass = Pass::new(first);
                        while let Some(exchange) = pass.next(&mut rx) {
                            record_exchange(&metrics, &exchange);
                            let mut processed = process::process(exchange, body_cap);
                            pass.derived(processed.trace.body_bytes());
                            // The decoded bodies it made are freed by now.
                            process::release_if_large(processed.trace.body_bytes() as usize);
                            pricing::price(&prices, &mut processed.trace, processed.call.as_ref(), &metrics);
                            for e in &processed.errors {
                                if let process::ProcessError::DecodedOverCap { .. } = e {
                                    metrics.capture_truncated.inc();
                                } else {
                                    metrics.process_error(e);
                                }
                            }
                            exchanges += 1;
                            records.extend(deriver.observe(processed.trace, processed.call));
                        }
                        emit(&store, &metrics, records);
                        // Counted once their records are with the writer: processed equal to captured and
                        // nothing pending in the store means everything captured is committed.
                        metrics.processed.add(exchanges);
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
                    emit(&store, &metrics, deriver.close_idle(now));
                    metrics.derive_open_trajectories.set(deriver.open_trajectories() as u64);
                }
            }
            emit(&store, &metrics, deriver.close_all());
            metrics.derive_open_trajectories.set(0);
        })
}

/// Whether the pipeline may leave exchanges in the spill for another window: the spill is less than half
/// full, and no spill write failed since the last look (a failing disk drops what is routed to it).
struct SpillRoom {
    limit: u64,
    errors_seen: u64,
}

impl SpillRoom {
    fn new(limit: u64, metrics: &Metrics) -> SpillRoom {
        SpillRoom {
            limit,
            errors_seen: metrics.capture_spill_errors.get(),
        }
    }

    fn allows_waiting(&mut self, metrics: &Metrics) -> bool {
        let errors = metrics.capture_spill_errors.get();
        let no_new_errors = errors == self.errors_seen;
        self.errors_seen = errors;
        no_new_errors && metrics.capture_spill_bytes.get() < self.limit / 2
    }
}

/// The exchanges of one pass: `first`, then those already queued behind it, until the pass holds
/// [`EXCHANGES_PER_PASS`] exchanges or [`BYTES_PER_PASS`] bytes: captured, and the bodies derived from them. The
/// derived bytes count because a body may decode to far more than was captured (a compressed body inflates up
/// to `capture.max_body_bytes`): counting only captured bytes let one pass gather fifteen 0.3 MB compression
/// bombs, each decoded to the cap, before any of it went to the store. Each exchange is taken from the queue
/// only when the one before it has been processed.
struct Pass {
    first: Option<RawExchange>,
    taken: usize,
    bytes: u64,
}

impl Pass {
    fn new(first: RawExchange) -> Pass {
        Pass {
            first: Some(first),
            taken: 0,
            bytes: 0,
        }
    }

    fn next(&mut self, rx: &mut impl Source) -> Option<RawExchange> {
        let exchange = match self.first.take() {
            Some(first) => first,
            None if self.taken < EXCHANGES_PER_PASS && self.bytes < BYTES_PER_PASS => rx.try_recv()?,
            None => return None,
        };
        self.taken += 1;
        self.bytes += exchange.held_bytes();
        Some(exchange)
    }

    /// The last exchange taken was processed into bodies of `bytes` bytes.
    fn derived(&mut self, bytes: u64) {
        self.bytes += bytes;
    }
}

/// Hand a pass's records to the store writer (which publishes them on the commit feed once committed).
fn emit(store: &StoreTx, metrics: &Metrics, records: Vec<Record>) {
    let steps = records.iter().filter(|r| matches!(r, Record::Step(_))).count();
    metrics.steps_derived.add(steps as u64);
    store.send(records);
}

/// Per-upstream count, failures and duration of a captured exchange, from what capture recorded (the data
/// path neither times nor counts per upstream). Failed: the upstream failed or answered 4xx/5xx.
fn record_exchange(metrics: &Metrics, exchange: &RawExchange) {
    let failed =
        exchange.outcome == crate::model::exchange::Outcome::UpstreamError || exchange.status.is_some_and(|s| s >= 400);
    let micros = exchange.timings.end.saturating_sub(exchange.timings.start).max(0);
    metrics.record_exchange(&exchange.upstream, failed, micros as f64 / 1e6);
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::mpsc::RecvTimeoutError;

    use super::*;

    struct Queued(VecDeque<RawExchange>);

    impl Source for Queued {
        fn recv_timeout(&mut self, _: Duration) -> Result<RawExchange, RecvTimeoutError> {
            self.0.pop_front().ok_or(RecvTimeoutError::Disconnected)
        }

        fn try_recv(&mut self) -> Option<RawExchange> {
            self.0.pop_front()
        }
    }

    fn exchange(n: u128, body_bytes: usize) -> RawExchange {
        let mut e = RawExchange::for_test(n);
        e.request.body.push(bytes::Bytes::from(vec![b'x'; body_bytes]));
        e
    }

    /// The passes `rx` makes, by exchange id; each exchange derives `derived(id)` body bytes.
    fn passes_deriving(mut rx: Queued, derived: impl Fn(u128) -> u64) -> Vec<Vec<u128>> {
        let mut out = Vec::new();
        while let Ok(first) = rx.recv_timeout(Duration::ZERO) {
            let mut pass = Pass::new(first);
            let mut ids = Vec::new();
            while let Some(e) = pass.next(&mut rx) {
                ids.push(e.id.as_u128());
                pass.derived(derived(e.id.as_u128()));
            }
            out.push(ids);
        }
        out
    }

    fn passes(rx: Queued) -> Vec<Vec<u128>> {
        passes_deriving(rx, |_| 0)
    }

    #[test]
    fn a_pass_ends_at_the_bytes_its_exchanges_decoded_to() {
        // Small on the wire, 3 MiB once decoded (a compressed body): 2 per pass, not 64.
        let bombs = Queued((1..=5).map(|n| exchange(n, 100)).collect());
        assert_eq!(passes_deriving(bombs, |_| 3 << 20), [vec![1, 2], vec![3, 4], vec![5]]);
    }

    #[test]
    fn the_pipeline_may_leave_work_in_the_spill_only_while_it_is_less_than_half_full_and_healthy() {
        let metrics = Metrics::default();
        let mut room = SpillRoom::new(1000, &metrics);
        assert!(room.allows_waiting(&metrics));
        metrics.capture_spill_bytes.set(499);
        assert!(room.allows_waiting(&metrics));
        metrics.capture_spill_bytes.set(500);
        assert!(!room.allows_waiting(&metrics), "half full");
        metrics.capture_spill_bytes.set(10);
        metrics.capture_spill_errors.inc();
        assert!(
            !room.allows_waiting(&metrics),
            "a spill write failed since the last look"
        );
        assert!(room.allows_waiting(&metrics), "no new failure since");
    }

    #[test]
    fn a_pass_ends_at_its_exchange_count_or_its_bytes_and_keeps_the_order() {
        let small = Queued((1..=150).map(|n| exchange(n, 100)).collect());
        let lens: Vec<usize> = passes(small).iter().map(Vec::len).collect();
        assert_eq!(
            lens,
            [EXCHANGES_PER_PASS, EXCHANGES_PER_PASS, 150 - 2 * EXCHANGES_PER_PASS]
        );

        let mib = 1 << 20;
        let large = Queued(
            [3 * mib, 3 * mib, 3 * mib, mib, 9 * mib, 1]
                .iter()
                .zip(1..)
                .map(|(&b, n)| exchange(n, b))
                .collect(),
        );
        // 3 + 3 MiB passes the bound, 3 + 1 MiB reaches it; an exchange larger than the bound is a pass of its own.
        assert_eq!(passes(large), [vec![1, 2], vec![3, 4], vec![5], vec![6]]);
    }
}
