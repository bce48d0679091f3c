//! When the data path hands an exchange to the pipeline: at once while the receiver is awake, after the response
//! is on the wire when sending would have to wake it.
//!
//! hyper drops a response body as soon as it has encoded the last frame, before it writes those bytes to the
//! socket; the tap finishes in that drop. A send that wakes a parked receiver from there puts a futex wake, and
//! that thread starting on the other core, in front of the client's last bytes (`strace -f` of a worker:
//! `recvfrom` upstream, `futex(FUTEX_WAKE)`, then `writev` to the client). A task spawned instead landed in the
//! worker's LIFO slot but, when that slot was taken, woke the other worker first — another futex in the same place.
//!
//! So while the receiver is parked (traffic had stopped, see [`super::queue`]), finished exchanges wait in a short
//! per-thread list that the runtime's `on_thread_park` hook ([`send_pending`]) empties when the worker has nothing
//! left to run — every write of that round done. While the receiver is awake (it polls under steady traffic) a
//! send wakes nobody, so the exchange goes at once, behind whatever the list still held: holding it would only
//! keep its memory longer, with nothing to gain. The list is sent as soon as it holds [`MAX_PENDING`] exchanges.
//! A thread that has never parked (not a hooked runtime worker: tests, blocking threads, other runtimes) sends at
//! once. Pending exchanges are sent when the list is dropped too, so a worker that exits (runtime shutdown) loses
//! nothing.

use std::cell::RefCell;
use std::sync::Arc;

use super::{CaptureTx, RawExchange};

/// At most this many exchanges wait on one worker.
pub const MAX_PENDING: usize = 32;

thread_local! {
    /// `None` until this thread's first park: only then is it known that `send_pending` will run here.
    static PENDING: RefCell<Option<Vec<PendingSend>>> = const { RefCell::new(None) };
}

/// One exchange waiting to be sent; sends when dropped, so every path out of the list sends exactly once.
struct PendingSend {
    tx: Arc<CaptureTx>,
    exchange: Option<RawExchange>,
}

impl Drop for PendingSend {
    fn drop(&mut self) {
        if let Some(exchange) = self.exchange.take() {
            self.tx.try_send(exchange);
        }
    }
}

pub(super) fn defer(tx: Arc<CaptureTx>, exchange: RawExchange) {
    let send_now = tx.receiver_awake();
    let item = PendingSend {
        tx,
        exchange: Some(exchange),
    };
    // Not a hooked worker (or the thread is exiting): `item` is dropped here and sends at once.
    let _ = PENDING.try_with(|pending| {
        if let Ok(mut pending) = pending.try_borrow_mut()
            && let Some(list) = pending.as_mut()
        {
            list.push(item);
            if send_now || list.len() >= MAX_PENDING {
                list.clear();
            }
        }
    });
}

/// The runtime's `on_thread_park` hook: send what this worker deferred, and mark it as a worker that parks.
pub fn send_pending() {
    let _ = PENDING.try_with(|pending| {
        if let Ok(mut pending) = pending.try_borrow_mut() {
            // Clearing drops (sends) each one; a send never defers, so nothing re-enters this list.
            pending.get_or_insert_with(|| Vec::with_capacity(MAX_PENDING)).clear();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::CaptureRx;
    use crate::config::CaptureConfig;
    use crate::telemetry::Metrics;

    fn channel() -> (Arc<CaptureTx>, CaptureRx) {
        let config = CaptureConfig {
            queue_capacity: 100,
            ..CaptureConfig::default()
        };
        let (tx, rx) = CaptureTx::channel(&config, Arc::new(Metrics::default()));
        (Arc::new(tx), rx)
    }

    fn received(rx: &mut CaptureRx) -> Vec<u128> {
        rx.drain().into_iter().map(|e| e.id.as_u128()).collect()
    }

    /// The list is per thread: each test starts on a thread that has never parked.
    fn on_fresh_thread(test: impl FnOnce() + Send + 'static) {
        std::thread::spawn(test).join().expect("test thread");
    }

    #[test]
    fn a_thread_that_never_parked_sends_at_once() {
        on_fresh_thread(|| {
            let (tx, mut rx) = channel();
            tx.send_when_idle(RawExchange::for_test(1));
            assert_eq!(received(&mut rx), [1]);
        });
    }

    #[test]
    fn a_worker_holds_exchanges_until_it_parks_and_keeps_their_order() {
        on_fresh_thread(worker_holds_until_park);
    }

    fn worker_holds_until_park() {
        let (tx, mut rx) = channel();
        tx.set_receiver_parked(true);
        send_pending(); // this thread is now a worker whose park hook runs
        tx.clone().send_when_idle(RawExchange::for_test(1));
        tx.clone().send_when_idle(RawExchange::for_test(2));
        assert!(received(&mut rx).is_empty(), "nothing is sent before the worker parks");
        send_pending();
        assert_eq!(received(&mut rx), [1, 2]);
        send_pending();
        assert!(received(&mut rx).is_empty(), "each exchange is sent once");
    }

    #[test]
    fn while_the_receiver_is_awake_a_worker_sends_at_once_behind_what_it_held() {
        on_fresh_thread(awake_receiver_gets_sends_at_once);
    }

    fn awake_receiver_gets_sends_at_once() {
        let (tx, mut rx) = channel();
        send_pending();
        tx.set_receiver_parked(true);
        tx.clone().send_when_idle(RawExchange::for_test(1));
        assert!(received(&mut rx).is_empty(), "held while the receiver is parked");
        tx.set_receiver_parked(false);
        tx.clone().send_when_idle(RawExchange::for_test(2));
        assert_eq!(
            received(&mut rx),
            [1, 2],
            "sent without a park, in the order they finished"
        );
        tx.send_when_idle(RawExchange::for_test(3));
        assert_eq!(received(&mut rx), [3]);
    }

    #[test]
    fn a_busy_worker_sends_a_full_list_without_parking() {
        on_fresh_thread(busy_worker_sends_full_list);
    }

    fn busy_worker_sends_full_list() {
        let (tx, mut rx) = channel();
        tx.set_receiver_parked(true);
        send_pending();
        for i in 0..MAX_PENDING - 1 {
            tx.clone().send_when_idle(RawExchange::for_test(i as u128));
        }
        assert!(received(&mut rx).is_empty());
        tx.send_when_idle(RawExchange::for_test(999));
        assert_eq!(received(&mut rx).len(), MAX_PENDING);
    }

    #[test]
    fn a_worker_that_exits_sends_what_it_held() {
        let (tx, mut rx) = channel();
        on_fresh_thread(move || {
            tx.set_receiver_parked(true);
            send_pending();
            tx.send_when_idle(RawExchange::for_test(7));
        });
        assert_eq!(received(&mut rx), [7]);
    }
}
