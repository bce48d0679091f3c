//! One client connection's task: the hyper connection, and what may end it early (idle too long, shutdown).
//!
//! The watchers (the idle timer, the shutdown and force-close tokens) are polled only when one of them woke the
//! task. A `select!` over the connection and its watchers would poll all of them each time the connection
//! wakes (several times per request), and hyper-util's graceful watcher adds one more: together ~5 µs of CPU
//! per proxied request on the bench VM (`perf record` of `llmtap-bench latency`; docs/performance.md).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// What a connection's watcher saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// No request in flight for the idle timeout: close.
    Idle,
    /// The client stopped sending a request body or taking a response body (see `limits::Stall`): close.
    Stalled,
    /// Shutdown began: finish the requests in flight, take no new ones.
    Drain,
    /// The shutdown grace is over: close now.
    Close,
}

type Watcher = Pin<Box<dyn Future<Output = Stop> + Send>>;

/// A connection future `C` under its watchers. Resolves when the connection ends, goes idle, or is closed.
pub struct Supervised<C, F> {
    conn: Pin<Box<C>>,
    /// Watches until shutdown begins.
    watcher: Watcher,
    /// Takes over once the connection drains (idle and force-close only).
    draining: Option<Watcher>,
    /// Starts the connection's graceful shutdown.
    drain: F,
    woken: Arc<WatcherWake>,
    /// The watchers' waker, and the task waker it forwards to as last stored (compared without a lock).
    watcher_waker: Waker,
    task_waker: Option<Waker>,
}

/// The waker the watchers register: marks them for polling, then wakes the connection's task.
struct WatcherWake {
    woken: AtomicBool,
    task: Mutex<Option<Waker>>,
}

impl Wake for WatcherWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        let task = self
            .task
            .lock()
            .map(|t| t.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        if let Some(task) = task {
            task.wake();
        }
    }
}

impl<C, F: FnMut(Pin<&mut C>)> Supervised<C, F> {
    /// `watcher` resolves with the first of idle, drain or close; `draining` (idle or close) replaces it after
    /// a drain, when `drain` has been called on the connection.
    pub fn new(conn: C, watcher: Watcher, draining: Watcher, drain: F) -> Supervised<C, F> {
        // Polled on the first poll: the watchers register their waker then.
        let woken = Arc::new(WatcherWake {
            woken: AtomicBool::new(true),
            task: Mutex::new(None),
        });
        Supervised {
            conn: Box::pin(conn),
            watcher,
            draining: Some(draining),
            drain,
            watcher_waker: Waker::from(woken.clone()),
            woken,
            task_waker: None,
        }
    }
}

impl<C, E, F> Future for Supervised<C, F>
where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
    F: FnMut(Pin<&mut C>) + Unpin,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if !this.task_waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            let waker = cx.waker().clone();
            match this.woken.task.lock() {
                Ok(mut t) => *t = Some(waker.clone()),
                Err(p) => *p.into_inner() = Some(waker.clone()),
            }
            this.task_waker = Some(waker);
        }
        while this.woken.woken.swap(false, Ordering::Acquire) {
            let mut watcher_cx = Context::from_waker(&this.watcher_waker);
            match this.watcher.as_mut().poll(&mut watcher_cx) {
                Poll::Pending => {}
                Poll::Ready(Stop::Idle) => {
                    tracing::debug!("Closing an idle connection");
                    return Poll::Ready(());
                }
                Poll::Ready(Stop::Close | Stop::Stalled) => return Poll::Ready(()),
                Poll::Ready(Stop::Drain) => match this.draining.take() {
                    Some(next) => {
                        (this.drain)(this.conn.as_mut());
                        this.watcher = next;
                        // The new watcher has not registered its waker yet.
                        this.woken.woken.store(true, Ordering::Release);
                    }
                    // A draining watcher never drains again; treated as closed rather than polled after the end.
                    None => return Poll::Ready(()),
                },
            }
        }
        match this.conn.as_mut().poll(cx) {
            Poll::Ready(Err(error)) => {
                tracing::debug!(%error, "Connection ended with an error");
                Poll::Ready(())
            }
            Poll::Ready(Ok(())) => Poll::Ready(()),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    fn watcher(token: CancellationToken, stop: Stop) -> Watcher {
        Box::pin(async move {
            token.cancelled().await;
            stop
        })
    }

    /// A connection that ends once `end` is cancelled.
    async fn conn(end: CancellationToken) -> Result<(), String> {
        end.cancelled().await;
        Ok(())
    }

    #[tokio::test]
    async fn drain_asks_the_connection_to_finish_and_close_ends_it() {
        let (drain, close, end) = (
            CancellationToken::new(),
            CancellationToken::new(),
            CancellationToken::new(),
        );
        let drains = Arc::new(AtomicUsize::new(0));
        let counted = drains.clone();
        let task = tokio::spawn(Supervised::new(
            conn(end.clone()),
            watcher(drain.clone(), Stop::Drain),
            watcher(close.clone(), Stop::Close),
            move |_: Pin<&mut _>| {
                counted.fetch_add(1, Ordering::Relaxed);
            },
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(drains.load(Ordering::Relaxed), 0);
        drain.cancel();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(drains.load(Ordering::Relaxed), 1, "shutdown drains the connection once");
        assert!(
            !task.is_finished(),
            "a draining connection runs until it ends or is closed"
        );
        close.cancel();
        ends(task, "close ends the connection").await;
    }

    /// Resolves once `task` has ended (at most 10 s).
    async fn ends(task: tokio::task::JoinHandle<()>, what: &str) {
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect(what)
            .expect("task");
    }

    #[tokio::test]
    async fn the_connection_ending_ends_the_task_and_idle_closes_it() {
        let end = CancellationToken::new();
        let never = CancellationToken::new();
        let task = tokio::spawn(Supervised::new(
            conn(end.clone()),
            watcher(never.clone(), Stop::Drain),
            watcher(never.clone(), Stop::Close),
            |_: Pin<&mut _>| {},
        ));
        end.cancel();
        ends(task, "ends with its connection").await;

        let idle = CancellationToken::new();
        let task = tokio::spawn(Supervised::new(
            conn(never.clone()),
            watcher(idle.clone(), Stop::Idle),
            watcher(never.clone(), Stop::Close),
            |_: Pin<&mut _>| {},
        ));
        idle.cancel();
        ends(task, "an idle connection is closed").await;
    }
}
