//! The capture spill: when the pipeline falls behind, exchanges wait on disk instead of being dropped.
//!
//! With `capture.spill_bytes` > 0 a spill thread sits between the capture queue and the pipeline. It is the
//! queue's only consumer and the data path never sees it: `CaptureTx::try_send` stays one non-blocking push
//! (no disk I/O, no lock on the workers). The thread routes each exchange:
//!
//! - **direct** while nothing is spilled: into an in-memory handoff to the pipeline (a bounded channel of
//!   `capture.queue_capacity` exchanges). The exchange is moved, not copied; nothing touches the disk.
//! - **to disk** once the handoff is full: appended to the spill (see [`segments`]). From then on *every*
//!   exchange goes to the disk until the spill is empty again, and the thread feeds the handoff from the
//!   spill, oldest first. So the pipeline sees exchanges in exactly the order the thread received them, which
//!   derivation needs (a tool result links to the call before it).
//! - **dropped** once the spill would hold more than `capture.spill_bytes`: as a full queue drops without a
//!   spill (by whole conversation, counted in `llmtap_capture_dropped_total`).
//!
//! The intake queue keeps the data path's wake-free handoff (see [`super::queue`]): the thread polls it
//! every 20 ms while traffic flows. It needs room for one poll interval at the proxy's top rate (~17k
//! exchanges/s: ~340), so it holds at least [`INTAKE_CAPACITY`] whatever `capture.queue_capacity` says;
//! `capture.queue_bytes` still bounds the bytes held in memory by both queues together (exchanges keep their
//! budget charge until processed; records read back from disk are not charged, and at most one segment of
//! them is in memory).
//!
//! Restart: segments a previous run left are the oldest exchanges and go to the pipeline before any new one
//! (while the spill is not empty, new exchanges are appended behind them). At shutdown the thread still routes
//! what the intake holds, then ends without waiting for the backlog, which may take minutes to process: it
//! stays on disk (the segment being handed out resumes at its cursor, see [`segments`]) and the next start
//! processes it first.

pub mod record;
pub mod redact;
pub mod segments;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TrySendError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{CaptureRx, RawExchange, Source};
use crate::telemetry::Metrics;
pub use redact::BodyRedaction;
pub use segments::{Segments, SpillError};

/// The least the intake queue holds with the spill on (see the module doc).
pub const INTAKE_CAPACITY: usize = 4096;
/// While the spill holds records: how often the thread looks for room in the handoff when no traffic wakes
/// it. At the pipeline's ~2k exchanges/s, 5 ms is ~10 exchanges: a handoff of the default 4096 never runs dry.
const REFILL_INTERVAL: Duration = Duration::from_millis(5);
/// Idle: how long one wait on the intake lasts (the stop token is checked between waits).
const TICK: Duration = Duration::from_secs(1);
/// While stopping: how long the intake must stay empty before the thread ends.
const STOPPING_POLL: Duration = Duration::from_millis(20);
/// At most this many exchanges are routed between two refills of the handoff, so that a steady stream into
/// the intake cannot starve the pipeline.
const ROUTE_BATCH: usize = 256;

/// The pipeline's end of the spill stage.
pub struct SpillRx {
    rx: mpsc::Receiver<RawExchange>,
    /// Exchanges in the handoff (see [`Stage::queued`]).
    queued: Arc<AtomicUsize>,
}

impl SpillRx {
    fn took(&self, got: RawExchange) -> RawExchange {
        self.queued.fetch_sub(1, Ordering::AcqRel);
        got
    }
}

impl Source for SpillRx {
    fn recv_timeout(&mut self, timeout: Duration) -> Result<RawExchange, RecvTimeoutError> {
        self.rx.recv_timeout(timeout).map(|e| self.took(e))
    }

    fn try_recv(&mut self) -> Option<RawExchange> {
        self.rx.try_recv().ok().map(|e| self.took(e))
    }
}

struct Stage {
    intake: CaptureRx,
    handoff: mpsc::SyncSender<RawExchange>,
    capacity: usize,
    /// Exchanges in the handoff: incremented here before a send, decremented by the pipeline as it takes
    /// one. This thread is the only sender, so `capacity - queued` exchanges can be sent without one being
    /// refused: records are taken from the spill (moving its cursor) only when they can all be handed over.
    queued: Arc<AtomicUsize>,
    segments: Segments,
    /// Exchanges appended to the spill whose records are not written yet (see [`Segments::flush`]). They are
    /// kept until the write succeeds, so that a failed write drops them as a full spill does: counted, and by
    /// conversation.
    unwritten: Vec<RawExchange>,
    limit: u64,
    metrics: Arc<Metrics>,
    /// Applied to a request body before it is written (see [`redact`]).
    redaction: BodyRedaction,
    /// The pipeline is gone (it never goes before this thread unless it panicked): drop everything.
    pipeline_gone: bool,
}

/// Open the spill under `dir` and start its thread between `intake` and the pipeline. The pipeline ends when
/// the returned receiver reports `Disconnected`: after `stop` is cancelled and the intake is empty.
pub fn spawn(
    intake: CaptureRx,
    dir: &Path,
    handoff_capacity: usize,
    limit: u64,
    redaction: BodyRedaction,
    metrics: Arc<Metrics>,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(SpillRx, JoinHandle<()>), SpillError> {
    let segments = Segments::open(dir)?;
    metrics.capture_spill_bytes.set(segments.bytes());
    if !segments.is_empty() {
        tracing::info!(
            bytes = segments.bytes(),
            "Capture spill holds exchanges from a previous run; processing them before new traffic"
        );
    }
    let capacity = handoff_capacity.max(1);
    let (handoff, rx) = mpsc::sync_channel(capacity);
    let queued = Arc::new(AtomicUsize::new(0));
    let mut stage = Stage {
        intake,
        handoff,
        capacity,
        queued: queued.clone(),
        segments,
        unwritten: Vec::new(),
        limit,
        metrics,
        redaction,
        pipeline_gone: false,
    };
    let thread = std::thread::Builder::new()
        .name("llmtap-spill".into())
        // Unlike the pipeline and the store, this thread keeps the normal priority: it is what makes capture
        // lossless when the machine is saturated. At `SCHED_IDLE` it would get no CPU while the proxy's workers
        // have work: the intake would fill within a poll or two and drop exchanges with the spill nearly empty.
        // Its work per exchange is small (a move into the handoff, or an encoding into the batch each routing
        // pass writes with one write), and it runs once per poll interval, not once per exchange.
        .spawn(move || stage.run(&stop))
        .map_err(|source| SpillError::Io {
            path: dir.to_owned(),
            source,
        })?;
    Ok((SpillRx { rx, queued }, thread))
}

impl Stage {
    fn run(&mut self, stop: &tokio_util::sync::CancellationToken) {
        loop {
            let stopping = stop.is_cancelled();
            if !stopping {
                self.refill();
            }
            let wait = if stopping {
                STOPPING_POLL
            } else if self.segments.is_empty() {
                TICK
            } else {
                REFILL_INTERVAL
            };
            match self.intake.recv_timeout(wait) {
                Ok(first) => {
                    self.route(first);
                    for _ in 1..ROUTE_BATCH {
                        let Some(next) = self.intake.try_recv() else { break };
                        self.route(next);
                    }
                    self.write_spilled();
                }
                Err(RecvTimeoutError::Timeout) if stopping => break,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        // What is in memory of the segment being handed out is still on disk past its cursor; the open
        // segment is flushed.
        self.write_spilled();
        if let Err(e) = self.segments.sync() {
            self.metrics.capture_spill_error(&e);
        }
        self.publish();
    }

    /// Hand spilled exchanges to the pipeline, oldest first, as many as the handoff has room for.
    fn refill(&mut self) {
        let room = self.capacity.saturating_sub(self.queued.load(Ordering::Acquire));
        if room == 0 || self.segments.is_empty() {
            return;
        }
        self.write_spilled();
        let metrics = self.metrics.clone();
        let mut on_error = |e: SpillError| metrics.capture_spill_error(&e);
        for exchange in self.segments.take(room, &mut on_error) {
            self.send(exchange);
        }
        self.publish();
    }

    /// Into the handoff, which has room (see [`Stage::queued`]).
    fn send(&mut self, exchange: RawExchange) {
        if self.pipeline_gone {
            return self.intake.drop_exchange(exchange);
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        match self.handoff.try_send(exchange) {
            Ok(()) => {}
            Err(TrySendError::Full(exchange)) => {
                // Cannot happen (this thread is the only sender and counted the room); dropped, not lost
                // silently, if it ever does.
                self.queued.fetch_sub(1, Ordering::AcqRel);
                self.intake.drop_exchange(exchange);
            }
            Err(TrySendError::Disconnected(exchange)) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                self.pipeline_gone = true;
                self.intake.drop_exchange(exchange);
            }
        }
    }

    /// One exchange from the intake: straight to the pipeline while nothing is spilled and it has room, else
    /// to the spill, else dropped.
    fn route(&mut self, mut exchange: RawExchange) {
        if self.pipeline_gone {
            self.intake.drop_exchange(exchange);
            return;
        }
        if self.segments.is_empty() && self.queued.load(Ordering::Acquire) < self.capacity {
            return self.send(exchange);
        }
        // Nothing reaches the disk with a credential in it (headers and query were redacted on the data path).
        self.redaction.apply(&mut exchange.request);
        match self.segments.append(&exchange, self.limit) {
            Ok(_) => {
                self.unwritten.push(exchange);
                if self.segments.wants_flush() {
                    self.write_spilled();
                }
            }
            Err(SpillError::Full) => self.intake.drop_exchange(exchange),
            Err(e) => {
                self.metrics.capture_spill_error(&e);
                self.intake.drop_exchange(exchange);
            }
        }
    }

    /// Write the records appended since the last write: their exchanges are spilled, or dropped if the write
    /// fails.
    fn write_spilled(&mut self) {
        match self.segments.flush() {
            // Dropping the exchanges gives their bytes back to the in-memory budget: they are on disk now.
            Ok(()) => {
                self.metrics.capture_spilled.add(self.unwritten.len() as u64);
                self.unwritten.clear();
            }
            Err(e) => {
                self.metrics.capture_spill_error(&e);
                for exchange in self.unwritten.drain(..) {
                    self.intake.drop_exchange(exchange);
                }
            }
        }
        self.publish();
    }

    fn publish(&self) {
        self.metrics.capture_spill_bytes.set(self.segments.bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::CaptureTx;
    use crate::config::CaptureConfig;

    /// A running stage over `dir`: the data path's end, the pipeline's end, the thread and its stop token.
    struct Running {
        tx: CaptureTx,
        rx: SpillRx,
        thread: JoinHandle<()>,
        stop: tokio_util::sync::CancellationToken,
    }

    impl Running {
        fn start(dir: &Path, handoff: usize, limit: u64, metrics: &Arc<Metrics>) -> Running {
            let config = CaptureConfig {
                queue_capacity: INTAKE_CAPACITY,
                ..CaptureConfig::default()
            };
            let (tx, intake) = CaptureTx::channel(&config, metrics.clone());
            let stop = tokio_util::sync::CancellationToken::new();
            let redaction = BodyRedaction {
                redact: crate::pipeline::secrets::redact_json,
                cap: 1 << 20,
            };
            let (rx, thread) =
                spawn(intake, dir, handoff, limit, redaction, metrics.clone(), stop.clone()).expect("spawn");
            Running { tx, rx, thread, stop }
        }

        fn stop(self) {
            self.stop.cancel();
            self.thread.join().expect("stage");
        }
    }

    /// Waits up to 20 s for `done`.
    fn wait_for(done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !done() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A pipeline slower than the traffic: the stage spills, and the pipeline still receives every exchange
    /// once, in the order they were sent, while direct and spilled exchanges alternate.
    #[test]
    fn a_slow_pipeline_gets_every_exchange_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let metrics = Arc::new(Metrics::default());
        let Running {
            tx,
            mut rx,
            thread,
            stop,
        } = Running::start(dir.path(), 3, u64::MAX, &metrics);
        let sender = std::thread::spawn(move || {
            for id in 0..600u128 {
                tx.try_send(RawExchange::for_test(id));
                if id % 150 == 0 {
                    // Pauses let the spill drain, so that later exchanges go direct again.
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
            // Kept until the end: the last sender going makes the stage stop (leaving any backlog on disk).
            tx
        });
        let mut got = Vec::new();
        while got.len() < 600 {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(e) => got.push(e.id.as_u128()),
                Err(e) => panic!("{e:?} after {}", got.len()),
            }
            if got.len() % 7 == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let tx = sender.join().expect("sender");
        assert_eq!(got, (0..600).collect::<Vec<_>>());
        assert!(metrics.capture_spilled.get() > 0, "the slow pipeline made it spill");
        assert_eq!(metrics.capture_dropped.get(), 0);
        stop.cancel();
        drop(tx);
        thread.join().expect("stage");
        assert_eq!(metrics.capture_spill_bytes.get(), 0);
        assert!(matches!(
            rx.recv_timeout(Duration::from_secs(5)),
            Err(RecvTimeoutError::Disconnected)
        ));
    }

    /// Exchanges left in the spill at shutdown are the first the next start hands to the pipeline, before
    /// newer traffic.
    #[test]
    fn a_restart_hands_out_the_previous_runs_spill_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let metrics = Arc::new(Metrics::default());
        let first = Running::start(dir.path(), 2, u64::MAX, &metrics);
        for id in 0..20u128 {
            first.tx.try_send(RawExchange::for_test(id));
        }
        // Nobody receives: two go to the handoff (lost with it, as the in-memory queue is), the rest spill.
        wait_for(|| metrics.capture_spilled.get() >= 18);
        first.stop();
        let mut second = Running::start(dir.path(), 2, u64::MAX, &metrics);
        second.tx.try_send(RawExchange::for_test(100));
        let got: Vec<u128> = (0..19)
            .map(|_| {
                second
                    .rx
                    .recv_timeout(Duration::from_secs(20))
                    .expect("exchange")
                    .id
                    .as_u128()
            })
            .collect();
        assert_eq!(got, (2..20).chain([100]).collect::<Vec<_>>());
        second.stop();
    }

    /// A credential in a request body never reaches the spill's files; the pipeline still gets the body.
    #[test]
    fn a_credential_in_a_spilled_request_body_is_redacted_before_the_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let metrics = Arc::new(Metrics::default());
        let running = Running::start(dir.path(), 1, u64::MAX, &metrics);
        let body = br#"{"model":"m","api_key":"sk-spill-secret-4242","messages":[{"role":"user","content":"hi"}]}"#;
        for id in 0..20u128 {
            let mut e = RawExchange::for_test(id);
            e.request.body.push(bytes::Bytes::from_static(body));
            running.tx.try_send(e);
        }
        wait_for(|| metrics.capture_spilled.get() >= 19);
        assert!(metrics.capture_spilled.get() >= 19, "spilled");
        let mut on_disk = Vec::new();
        for entry in std::fs::read_dir(dir.path()).expect("dir") {
            on_disk.extend(std::fs::read(entry.expect("entry").path()).expect("read"));
        }
        let found = |needle: &[u8]| on_disk.windows(needle.len()).any(|w| w == needle);
        assert!(found(br#""api_key":"REDACTED""#), "the spilled records are there");
        assert!(!found(b"sk-spill-secret-4242"), "the secret reached the spill");
        running.stop();
    }

    /// Beyond `capture.spill_bytes`, exchanges are dropped and counted as a full queue drops them.
    #[test]
    fn a_full_spill_drops_and_counts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let metrics = Arc::new(Metrics::default());
        let running = Running::start(dir.path(), 1, 2_000, &metrics);
        for id in 0..100u128 {
            let mut e = RawExchange::for_test(id);
            e.meta.session = Some(format!("s{id}"));
            running.tx.try_send(e);
        }
        let handled = || metrics.capture_spilled.get() + metrics.capture_dropped.get();
        wait_for(|| handled() >= 99);
        assert!(metrics.capture_spilled.get() > 0);
        assert!(metrics.capture_dropped.get() > 0);
        assert_eq!(handled(), 99, "one in the handoff");
        assert!(metrics.capture_spill_bytes.get() <= 2_000);
        running.stop();
    }
}
