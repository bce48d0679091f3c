//! What keeps one client from holding resources forever: a per-connection idle watchdog, a stall watchdog (a
//! client that stops sending a request body, or stops taking a response body), and the bookkeeping they need
//! (requests in flight on a connection, bodies waiting on the client, frames moved). The header-read timeout is
//! hyper's own; the connection limit is a semaphore in the accept loop (see `Proxy::serve`).
//!
//! The data path's share of the stall watchdog is a relaxed atomic add or two per frame; the watchdog samples
//! the count a few times per timeout, so no timer is armed or reset per frame.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// Requests in flight on one connection and when it last had none; bodies waiting on the client.
pub struct ConnActivity {
    active: AtomicUsize,
    /// Milliseconds after `base` at which `active` last became 0.
    idle_since_ms: AtomicU64,
    base: Instant,
    /// Body frames moved on the connection, either way (the stall watchdog only looks whether it changed).
    progress: AtomicU64,
    /// Request bodies waiting for the client's next bytes.
    reading: AtomicUsize,
    /// Response bodies waiting for the client to take the frame it was given.
    sending: AtomicUsize,
}

/// What the stall watchdog saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// The client sent nothing of a request body for the body-read timeout.
    Reading,
    /// The client took nothing of a response body for the send timeout.
    Sending,
}

impl ConnActivity {
    pub fn new() -> Arc<ConnActivity> {
        Arc::new(ConnActivity {
            active: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            base: Instant::now(),
            progress: AtomicU64::new(0),
            reading: AtomicUsize::new(0),
            sending: AtomicUsize::new(0),
        })
    }

    /// Resolves once a body has waited on the client with nothing moving on the connection: a request body for
    /// `read`, a response body for `send`. Checked a few times per timeout (so it fires within an eighth of
    /// the timeout after it is due); any frame moved on the connection restarts both clocks.
    pub async fn stalled(&self, read: Duration, send: Duration) -> Stall {
        let tick = (read.min(send) / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let mut seen = self.progress.load(Ordering::Relaxed);
        let mut sampled = Instant::now();
        // Since when (a sample with nothing moved since) each kind of body has been waiting.
        let (mut reading_since, mut sending_since): (Option<Instant>, Option<Instant>) = (None, None);
        loop {
            tokio::time::sleep(tick).await;
            let now = Instant::now();
            let progress = self.progress.load(Ordering::Relaxed);
            let moved = progress != seen;
            seen = progress;
            let waiting = |count: &AtomicUsize, since: Option<Instant>| {
                (!moved && count.load(Ordering::Relaxed) > 0).then(|| since.unwrap_or(sampled))
            };
            reading_since = waiting(&self.reading, reading_since);
            sending_since = waiting(&self.sending, sending_since);
            sampled = now;
            if reading_since.is_some_and(|t| now >= t + read) {
                return Stall::Reading;
            }
            if sending_since.is_some_and(|t| now >= t + send) {
                return Stall::Sending;
            }
        }
    }

    /// A frame moved on the connection.
    #[inline]
    fn moved(&self) {
        self.progress.fetch_add(1, Ordering::Relaxed);
    }

    /// A request started; the guard ends it when dropped (with its response body, or with the handler if the
    /// client left first).
    pub fn begin(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(self.clone())
    }

    /// Resolves once the connection has had no request in flight for `idle`.
    pub async fn idle_for(&self, idle: Duration) {
        loop {
            let next_check = if self.active.load(Ordering::Relaxed) == 0 {
                let since = self.base + Duration::from_millis(self.idle_since_ms.load(Ordering::Relaxed));
                let deadline = since + idle;
                if Instant::now() >= deadline && self.active.load(Ordering::Relaxed) == 0 {
                    return;
                }
                deadline
            } else {
                Instant::now() + idle
            };
            tokio::time::sleep_until(next_check).await;
        }
    }
}

pub struct ActiveGuard(Arc<ConnActivity>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        let activity = &self.0;
        let elapsed = u64::try_from(activity.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        // Set before the count drops, so the watchdog never sees 0 in flight with a stale idle time.
        activity.idle_since_ms.store(elapsed, Ordering::Relaxed);
        activity.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that holds its request's [`ActiveGuard`] until hyper drops it (sent, or the client left), and
/// tells the stall watchdog when a frame it handed out has not been taken yet: hyper asks for the next frame
/// only once the last one is on its way to the client.
pub struct GuardedBody<B> {
    inner: B,
    active: ActiveGuard,
    /// A frame was handed out and hyper has not asked for the next (counted in `ConnActivity::sending`).
    handed_out: bool,
}

impl<B> GuardedBody<B> {
    pub fn new(inner: B, active: ActiveGuard) -> GuardedBody<B> {
        GuardedBody {
            inner,
            active,
            handed_out: false,
        }
    }

    fn taken(&mut self) {
        if self.handed_out {
            self.handed_out = false;
            self.active.0.sending.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<B> Drop for GuardedBody<B> {
    fn drop(&mut self) {
        self.taken();
    }
}

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        this.taken();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            let activity = &this.active.0;
            activity.moved();
            this.handed_out = true;
            activity.sending.fetch_add(1, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body as the client sends it, telling the stall watchdog while it waits for the client's next
/// bytes (it was asked for a frame and has none yet).
pub struct ClientBody<B> {
    inner: B,
    activity: Arc<ConnActivity>,
    /// Counted in `ConnActivity::reading`.
    waiting: bool,
}

impl<B> ClientBody<B> {
    pub fn new(inner: B, activity: Arc<ConnActivity>) -> ClientBody<B> {
        ClientBody {
            inner,
            activity,
            waiting: false,
        }
    }

    fn set_waiting(&mut self, waiting: bool) {
        if waiting != self.waiting {
            self.waiting = waiting;
            if waiting {
                self.activity.reading.fetch_add(1, Ordering::Relaxed);
            } else {
                self.activity.reading.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl<B> Drop for ClientBody<B> {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

impl<B> Body for ClientBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Pending => this.set_waiting(true),
            Poll::Ready(frame) => {
                if frame.is_some() {
                    this.activity.moved();
                }
                this.set_waiting(false);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real time, short durations: only lower bounds are asserted (a timer never fires early), and the upper
    // bound is a generous deadline, so a slow machine cannot make it fail.
    #[tokio::test]
    async fn idle_counts_from_the_last_request_and_never_while_one_is_in_flight() {
        let activity = ConnActivity::new();
        let guard = activity.begin();
        let idle = Duration::from_millis(100);
        let watch = activity.idle_for(idle);
        tokio::pin!(watch);
        assert!(
            tokio::time::timeout(Duration::from_millis(400), &mut watch)
                .await
                .is_err(),
            "a request in flight is never idle, however long it takes"
        );
        drop(guard);
        let ended = Instant::now();
        tokio::time::timeout(Duration::from_secs(30), watch)
            .await
            .expect("idle once nothing is in flight");
        assert!(
            Instant::now() >= ended + idle,
            "idle is measured from the end of the last request"
        );
    }
}
