//! What keeps one client from holding resources forever: a per-connection idle watchdog and the bookkeeping
//! it needs (requests in flight on a connection). The header-read timeout is hyper's own; the connection limit
//! is a semaphore in the accept loop (see `Proxy::serve`).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// Requests in flight on one connection and when it last had none.
pub struct ConnActivity {
    active: AtomicUsize,
    /// Milliseconds after `base` at which `active` last became 0.
    idle_since_ms: AtomicU64,
    base: Instant,
}

impl ConnActivity {
    pub fn new() -> Arc<ConnActivity> {
        Arc::new(ConnActivity {
            active: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            base: Instant::now(),
        })
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

/// A response body that holds its request's [`ActiveGuard`] until hyper drops it (sent, or the client left).
pub struct GuardedBody<B> {
    inner: B,
    _active: ActiveGuard,
}

impl<B> GuardedBody<B> {
    pub fn new(inner: B, active: ActiveGuard) -> GuardedBody<B> {
        GuardedBody { inner, _active: active }
    }
}

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
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
