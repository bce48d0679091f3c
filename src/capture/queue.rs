//! The capture queue: a bounded channel from the data path to the pipeline thread, built so that a worker
//! almost never makes a system call to hand an exchange over.
//!
//! A blocking `recv` on a channel makes every send wake the receiver: a `futex` call on the worker and, when
//! the pipeline's CPU is idle, an inter-processor interrupt — in a VM a trip through the hypervisor. Measured on
//! the 2-vCPU bench machine, skipping those wakes took ~4 µs off capture's added p50 at 500 req/s.
//!
//! So the pipeline waits in two ways:
//! - **polling** while traffic flows (an exchange in the last [`ACTIVE_WINDOW`]): it drains the queue, then
//!   sleeps [`POLL_INTERVAL`]. Senders only push; they find nobody to wake.
//! - **asleep** once traffic has stopped: it raises the doorbell's `sleeping` flag and parks. The first send
//!   after that (made from the worker's park hook, after the response is written — see [`super::handoff`])
//!   lowers the flag and unparks it.
//!
//! Cost: an exchange reaches the pipeline up to [`POLL_INTERVAL`] later than with a blocking receive, and the
//! pipeline makes at most three empty polls after the last exchange ([`ACTIVE_WINDOW`]). So under steady
//! traffic (one exchange per window or more: above ~17 a second) no send wakes anyone, and a sparse caller (an
//! agent calling every few seconds) costs one wake per exchange, as a blocking receive would, plus three timer
//! wake-ups of a background thread; an idle llmtap never polls. (A one-second window was tried first: 500 empty
//! wake-ups per exchange for a sparse caller.)
//!
//! Why 20 ms and not less: on a 2-core machine the pipeline's and the store's work shows up in the data path's
//! latency even at the lowest priority (a worker woken on a core they were using starts later and on cold
//! caches). Each poll that finds work is a pass whose records reach the store as one batch (one wake-up of
//! the writer). At 500 req/s, 2 ms polls made 3.1 background context switches per exchange and cost the
//! pipeline and store threads 82 + 178 µs of CPU per exchange; 20 ms polls with the store's 50 ms group commit:
//! 0.7 switches and 52 + 114 µs (`perf stat --per-thread`, 3,000 requests 2 ms apart), and capture's added p50
//! fell by ~4 µs (`llmtap-bench latency`, binaries alternated). Capture-to-store delay is at most ~70 ms, plus, with
//! the spill on, a 100 ms look at the machine before work that follows a quiet spell (`background::YieldToDataPath`).
//! With the spill thread as the receiver, 4 ms polls (exchanges freed sooner, less memory in flight) cost the
//! same CPU per exchange as 20 ms in forward mode's saturated rounds.
//!
//! The queue is bounded twice: by exchanges (`capture.queue_capacity`) and by the body and header bytes they
//! hold (`capture.queue_bytes`), so a store that falls behind on multi-megabyte requests cannot grow llmtap's
//! memory without limit. An exchange that does not fit is dropped from capture and counted (traffic is never
//! slowed); one larger than the whole byte budget is still taken when the queue is empty. The bytes waiting are
//! the `llmtap_capture_queue_bytes` gauge. With the spill on, the receiver is the spill thread rather than the
//! pipeline, and an exchange it cannot hand on goes to disk before anything is dropped (see [`super::spill`]).
//!
//! No lost wake-up: the pipeline sets `sleeping`, then looks at the queue once more before parking; a sender
//! pushes, then reads `sleeping`. Both sides put a `SeqCst` fence between their write and their read, so at
//! least one of them sees the other's write: either the pipeline finds the exchange, or the sender sees the flag
//! and unparks (an unpark before the park makes the park return at once).

use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::RawExchange;
use super::budget::Budget;
use super::conversation::{DroppedConversations, Marks};
use crate::config::CaptureConfig;
use crate::telemetry::Metrics;

/// How long the pipeline sleeps between polls while traffic flows.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// How long after the last exchange the pipeline keeps polling before it parks until woken: three polls.
pub const ACTIVE_WINDOW: Duration = Duration::from_millis(60);

/// How a sender finds a parked pipeline.
#[derive(Default)]
struct Doorbell {
    sleeping: AtomicBool,
    /// The receiving thread, known from its first receive (before it can ever set `sleeping`).
    receiver: OnceLock<Thread>,
}

impl Doorbell {
    /// Wake the receiver if it is parked. An atomic load when it is not.
    fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed)
            && self.sleeping.swap(false, Ordering::AcqRel)
            && let Some(thread) = self.receiver.get()
        {
            thread.unpark();
        }
    }
}

/// The data path's only handle on the pipeline. The proxy shares one behind an `Arc` (an exchange in flight
/// holds one reference: one atomic add, where a clone of this struct was three); threads that send on their
/// own clone it.
#[derive(Clone)]
pub struct CaptureTx {
    /// std's bounded channel: `try_send` never blocks or allocates per call. `None` only inside `drop`.
    tx: Option<mpsc::SyncSender<RawExchange>>,
    doorbell: Arc<Doorbell>,
    /// `metrics.capture_queue_bytes` is the one count of captured bytes held, in flight and queued (see
    /// [`super::budget`]): the taps charge bodies as they keep them, a send charges the rest.
    budget: Budget,
    /// Where a drop notes its conversation, so that the rest of it is dropped too (see [`super::conversation`]).
    dropped: Arc<DroppedConversations>,
}

impl CaptureTx {
    /// The queue bounded by `capture.queue_capacity` exchanges and `capture.queue_bytes` bytes.
    pub fn channel(config: &CaptureConfig, metrics: Arc<Metrics>) -> (CaptureTx, CaptureRx) {
        let (tx, rx) = mpsc::sync_channel(config.queue_capacity);
        let doorbell = Arc::new(Doorbell::default());
        let dropped = Arc::new(DroppedConversations::default());
        let rx = CaptureRx {
            rx,
            doorbell: doorbell.clone(),
            active_until: None,
            dropped: dropped.clone(),
            marks: Marks::new(DEFAULT_MARK_LIFETIME),
            metrics: metrics.clone(),
        };
        let tx = CaptureTx {
            tx: Some(tx),
            doorbell,
            budget: Budget::new(metrics, config.queue_bytes),
            dropped,
        };
        (tx, rx)
    }

    /// Hand one exchange to the pipeline. Never blocks: a full (or closed) queue drops and counts.
    pub fn try_send(&self, mut exchange: RawExchange) {
        let rest = exchange.uncharged_bytes();
        if rest > 0 && !self.budget.reserve(&mut exchange.charge, rest) {
            // Dropping the exchange gives back what its taps had charged.
            self.dropped.note(&exchange);
            self.budget.metrics().capture_dropped();
            return;
        }
        let Some(tx) = self.tx.as_ref() else {
            self.budget.metrics().capture_dropped();
            return;
        };
        match tx.try_send(exchange) {
            Ok(()) => {
                self.budget.metrics().captured.inc();
                self.doorbell.ring();
            }
            Err(mpsc::TrySendError::Full(exchange) | mpsc::TrySendError::Disconnected(exchange)) => {
                self.dropped.note(&exchange);
                self.budget.metrics().capture_dropped();
            }
        }
    }

    /// The capture budget, for the taps to charge bodies as they keep them.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// [`CaptureTx::try_send`] once this worker thread runs out of work (see [`super::handoff`]): never before
    /// the response's last bytes are written to the client.
    pub fn send_when_idle(self: Arc<Self>, exchange: RawExchange) {
        super::handoff::defer(self, exchange);
    }

    /// The receiver is not parked: a send now wakes nobody. (It may park right after this is read; the send's
    /// doorbell still wakes it then.)
    pub(super) fn receiver_awake(&self) -> bool {
        !self.doorbell.sleeping.load(Ordering::Relaxed)
    }

    /// For tests: as if the receiver had just parked (`true`) or woken (`false`).
    #[cfg(test)]
    pub(super) fn set_receiver_parked(&self, parked: bool) {
        self.doorbell.sleeping.store(parked, Ordering::SeqCst);
    }

    /// The metrics the queue counts into, for the data path's own counts.
    pub fn metrics(&self) -> &Metrics {
        self.budget.metrics()
    }
}

impl Drop for CaptureTx {
    /// The last sender going away must reach a parked receiver, which then sees the queue disconnected: the
    /// sender is dropped first, then the bell rung (ringing first could let the receiver look, still find the
    /// queue connected, and park again with nobody left to wake it).
    fn drop(&mut self) {
        drop(self.tx.take());
        self.doorbell.ring();
    }
}

/// The pipeline's end of the queue.
pub struct CaptureRx {
    rx: mpsc::Receiver<RawExchange>,
    doorbell: Arc<Doorbell>,
    /// Poll (rather than park) until then: an exchange arrived recently.
    active_until: Option<Instant>,
    /// Conversations that lost an exchange: their later exchanges are dropped here (see
    /// [`super::conversation`]).
    dropped: Arc<DroppedConversations>,
    marks: Marks,
    metrics: Arc<Metrics>,
}

/// How long a dropped conversation's mark lives after its last exchange unless [`CaptureRx::set_mark_lifetime`]
/// says otherwise: derivation's default idle timeout.
const DEFAULT_MARK_LIFETIME: Duration = Duration::from_secs(30 * 60);

impl CaptureRx {
    /// The next exchange, waiting at most `timeout` for one (`Timeout`), or `Disconnected` once every sender
    /// is gone and the queue is empty.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<RawExchange, RecvTimeoutError> {
        let _ = self.doorbell.receiver.get_or_init(std::thread::current);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exchange) = self.try_take()? {
                return Ok(exchange);
            }
            let now = Instant::now();
            if now >= deadline {
                // Quiet: count the conversations whose last exchange was dropped.
                let new = self.marks.absorb(&self.dropped);
                self.metrics.capture_dropped_trajectories.add(new);
                return Err(RecvTimeoutError::Timeout);
            }
            let left = deadline - now;
            if self.active_until.is_some_and(|until| now < until) {
                std::thread::sleep(left.min(POLL_INTERVAL));
                continue;
            }
            self.doorbell.sleeping.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            match self.try_take() {
                Ok(None) => std::thread::park_timeout(left),
                taken => {
                    self.doorbell.sleeping.store(false, Ordering::Relaxed);
                    if let Some(exchange) = taken? {
                        return Ok(exchange);
                    }
                }
            }
            self.doorbell.sleeping.store(false, Ordering::Relaxed);
        }
    }

    /// The next exchange if one is queued right now, without waiting (a closed queue shows on the next
    /// [`CaptureRx::recv_timeout`]).
    pub fn try_recv(&mut self) -> Option<RawExchange> {
        self.try_take().ok().flatten()
    }

    /// Everything queued right now, without waiting.
    pub fn drain(&mut self) -> Vec<RawExchange> {
        std::iter::from_fn(|| self.try_recv()).collect()
    }

    /// Drop an exchange taken from this queue that cannot go further (the spill is full): counted as a
    /// capture drop, and its conversation's later exchanges are dropped too.
    pub fn drop_exchange(&self, exchange: RawExchange) {
        self.dropped.note(&exchange);
        self.metrics.capture_dropped();
    }

    /// A dropped conversation's mark lives until it has been quiet this long (`derive.idle_timeout`: then
    /// derivation would have closed its trajectory).
    pub fn set_mark_lifetime(&mut self, lifetime: Duration) {
        self.marks.set_lifetime(lifetime);
    }

    /// The next queued exchange that does not belong to a conversation capture already lost part of.
    fn try_take(&mut self) -> Result<Option<RawExchange>, RecvTimeoutError> {
        loop {
            match self.rx.try_recv() {
                Ok(exchange) => {
                    self.active_until = Some(Instant::now() + ACTIVE_WINDOW);
                    let verdict = self.marks.check(&self.dropped, &exchange);
                    self.metrics.capture_dropped_trajectories.add(verdict.new_trajectories);
                    if verdict.drop {
                        self.metrics.capture_dropped();
                        continue;
                    }
                    return Ok(Some(exchange));
                }
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            }
        }
    }
}

impl super::Source for CaptureRx {
    fn recv_timeout(&mut self, timeout: Duration) -> Result<RawExchange, RecvTimeoutError> {
        CaptureRx::recv_timeout(self, timeout)
    }

    fn try_recv(&mut self) -> Option<RawExchange> {
        CaptureRx::try_recv(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(exchanges: usize) -> CaptureConfig {
        CaptureConfig {
            queue_capacity: exchanges,
            queue_bytes: u64::MAX / 2,
            ..CaptureConfig::default()
        }
    }

    /// One receive with a 30 s timeout on its own thread: what it got and how long it waited.
    fn receive_once(mut rx: CaptureRx) -> std::thread::JoinHandle<(Result<u128, RecvTimeoutError>, Duration)> {
        std::thread::spawn(move || {
            let started = Instant::now();
            let got = rx.recv_timeout(Duration::from_secs(30)).map(|e| e.id.as_u128());
            (got, started.elapsed())
        })
    }

    /// A receiver parked with a long timeout is woken by the first send, well before the timeout.
    #[test]
    fn a_parked_receiver_is_woken_by_a_send() {
        let (tx, rx) = CaptureTx::channel(&limits(8), Arc::new(Metrics::default()));
        let receiver = receive_once(rx);
        // Let it reach the parked state (it has had no traffic, so it does not poll).
        std::thread::sleep(Duration::from_millis(100));
        tx.try_send(RawExchange::for_test(1));
        let (got, waited) = receiver.join().expect("receiver");
        assert_eq!(got, Ok(1));
        assert!(
            waited < Duration::from_secs(10),
            "woken by the send, not the timeout: {waited:?}"
        );
    }

    /// Dropping the last sender wakes a parked receiver, which reports the queue closed at once.
    #[test]
    fn a_parked_receiver_sees_the_last_sender_go() {
        let (tx, rx) = CaptureTx::channel(&limits(8), Arc::new(Metrics::default()));
        let receiver = receive_once(rx);
        std::thread::sleep(Duration::from_millis(100));
        let clone = tx.clone();
        drop(tx);
        drop(clone);
        let (got, waited) = receiver.join().expect("receiver");
        assert_eq!(got, Err(RecvTimeoutError::Disconnected));
        assert!(waited < Duration::from_secs(10), "woken by the drop: {waited:?}");
    }

    fn holding(id: u128, bytes: usize) -> RawExchange {
        let mut e = RawExchange::for_test(id);
        e.request.body = [bytes::Bytes::from(vec![b'x'; bytes])].into();
        e
    }

    /// The byte budget: what does not fit is dropped and counted, room comes back as the pipeline takes
    /// exchanges, and one exchange larger than the whole budget still gets through an empty queue.
    #[test]
    fn the_byte_budget_drops_what_does_not_fit_and_frees_room_on_receive() {
        let metrics = Arc::new(Metrics::default());
        let config = CaptureConfig {
            queue_bytes: 10_000,
            ..limits(100)
        };
        let (tx, mut rx) = CaptureTx::channel(&config, metrics.clone());
        tx.try_send(holding(1, 4_000));
        tx.try_send(holding(2, 4_000));
        tx.try_send(holding(3, 4_000));
        assert_eq!(metrics.captured.get(), 2);
        assert_eq!(metrics.capture_dropped.get(), 1, "the third would make 12,000 bytes");
        assert_eq!(metrics.capture_queue_bytes.get(), 8_000);

        assert_eq!(rx.recv_timeout(Duration::from_secs(1)).map(|e| e.id.as_u128()), Ok(1));
        assert_eq!(metrics.capture_queue_bytes.get(), 4_000);
        tx.try_send(holding(4, 4_000));
        assert_eq!(metrics.captured.get(), 3, "room again after a receive");

        let ids: Vec<u128> = rx.drain().into_iter().map(|e| e.id.as_u128()).collect();
        assert_eq!(ids, [2, 4]);
        assert_eq!(metrics.capture_queue_bytes.get(), 0);

        tx.try_send(holding(5, 50_000));
        assert_eq!(metrics.captured.get(), 4, "an oversized exchange passes an empty queue");
        tx.try_send(holding(6, 10));
        assert_eq!(metrics.capture_dropped.get(), 2, "but nothing joins it over budget");
        assert_eq!(rx.drain().len(), 1);
        assert_eq!(metrics.capture_queue_bytes.get(), 0);
    }

    /// Many senders, a receiver that alternates between polling and parking: every exchange arrives, none
    /// waits for the receiver's timeout (a lost wake-up would show as a stall of the full timeout).
    #[test]
    fn no_exchange_is_lost_or_left_waiting() {
        let (tx, mut rx) = CaptureTx::channel(&limits(10_000), Arc::new(Metrics::default()));
        let senders: Vec<_> = (0..4)
            .map(|s| {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for i in 0..500 {
                        tx.try_send(RawExchange::for_test(s * 1_000 + i));
                        if i % 100 == 0 {
                            // Pauses shorter and longer than the active window: the receiver both polls and parks.
                            let pause = if i % 200 == 0 {
                                3 * ACTIVE_WINDOW
                            } else {
                                ACTIVE_WINDOW / 2
                            };
                            std::thread::sleep(pause);
                        }
                    }
                })
            })
            .collect();
        drop(tx);
        let mut got = 0;
        let mut slowest = Duration::ZERO;
        loop {
            let t = Instant::now();
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(_) => got += 1,
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => panic!("stalled with {got} received"),
            }
            slowest = slowest.max(t.elapsed());
        }
        for s in senders {
            s.join().expect("sender");
        }
        assert_eq!(got, 2_000);
        assert!(slowest < Duration::from_secs(10), "slowest wait {slowest:?}");
    }
}
