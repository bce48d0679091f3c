//! A byte bound on what waits for the store writer: batches in its channel and the group it is gathering.
//!
//! The channel holds a fixed number of pipeline passes (`write::QUEUED_BATCHES`), and a pass ends at 4 MiB of
//! captured bytes, but one exchange can hold far more (bodies up to `capture.max_body_bytes` each way), so a
//! count alone does not bound memory. Each batch takes a [`Held`] share of [`InFlight`]'s budget before it is
//! sent, and gives it back when the writer drops it, after the batch is committed. The pipeline waits while the
//! budget is spent; a batch larger than the whole budget still goes when nothing else is held, so it cannot
//! wait forever.
//!
//! The same bytes count against the capture budget (`capture.queue_bytes`, [`Budget`]) when one is shared: a
//! body can decode to far more than was captured (a 0.3 MB compressed body inflates to `capture.max_body_bytes`),
//! and those decoded bodies waiting for the writer were held outside every bound but this one. Shared, the
//! pipeline also waits while the capture budget is spent (and it holds something here, which the writer will
//! give back), and the data path cuts what it captures while the writer is behind.

use std::sync::{Arc, Condvar, Mutex, PoisonError};

use crate::capture::budget::{Budget, Charge};
use crate::model::record::Record;

pub struct InFlight {
    held: Mutex<u64>,
    released: Condvar,
    max: u64,
    capture: Option<Budget>,
}

impl InFlight {
    pub fn new(max: u64) -> Arc<InFlight> {
        InFlight::sharing(max, None)
    }

    /// [`InFlight::new`], with what it holds counted against the capture budget too (see the module comment).
    pub fn sharing(max: u64, capture: Option<Budget>) -> Arc<InFlight> {
        Arc::new(InFlight {
            held: Mutex::new(0),
            released: Condvar::new(),
            max,
            capture,
        })
    }

    fn over(&self, held: u64, bytes: u64) -> bool {
        held + bytes > self.max || self.capture.as_ref().is_some_and(|b| b.held() + bytes > b.max())
    }

    /// A share of the budget for `records`, once it fits (blocking the caller until then).
    pub fn hold(self: &Arc<Self>, records: &[Record]) -> Held {
        let bytes = records.iter().map(Record::body_bytes).sum();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        while *held > 0 && self.over(*held, bytes) {
            held = self.released.wait(held).unwrap_or_else(PoisonError::into_inner);
        }
        *held += bytes;
        Held {
            bytes,
            budget: self.clone(),
            _capture: self.capture.as_ref().map(|b| b.charge(bytes)),
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        *self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One batch's share of [`InFlight`] (and of the capture budget, when shared); given back when dropped.
pub struct Held {
    bytes: u64,
    budget: Arc<InFlight>,
    _capture: Option<Charge>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.budget.held.lock().unwrap_or_else(PoisonError::into_inner);
        *held -= self.bytes;
        self.budget.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::model::exchange::Api;
    use crate::model::json::JsonText;

    fn batch(body_bytes: usize) -> Vec<Record> {
        let mut trace = crate::derive::testkit::trace(Api::OpenAiChat, 0, 1);
        trace.request = JsonText::from_redacted(format!("\"{}\"", "x".repeat(body_bytes - 2)));
        trace.response = JsonText::default();
        trace.raw_response = None;
        vec![Record::Trace(Box::new(trace))]
    }

    #[test]
    fn a_batch_waits_while_the_budget_is_spent_and_goes_once_a_share_is_given_back() {
        let budget = InFlight::new(1000);
        let first = budget.hold(&batch(600));
        let second = budget.hold(&batch(300));
        assert_eq!(budget.bytes(), 900);
        let (done, finished) = mpsc::channel();
        let waiting = {
            let budget = budget.clone();
            std::thread::spawn(move || {
                let third = budget.hold(&batch(200));
                done.send(()).unwrap();
                third
            })
        };
        // Still waiting however long it is given: 900 + 200 is over the budget.
        assert!(finished.recv_timeout(Duration::from_millis(200)).is_err());
        drop(second);
        finished
            .recv_timeout(Duration::from_secs(30))
            .expect("the third batch goes once 300 bytes are back");
        let third = waiting.join().unwrap();
        assert_eq!(budget.bytes(), 800);
        drop((first, third));
        assert_eq!(budget.bytes(), 0);
    }

    #[test]
    fn shared_with_the_capture_budget_batches_are_charged_to_it_and_wait_while_it_is_spent() {
        let metrics = std::sync::Arc::new(crate::telemetry::Metrics::default());
        let capture = Budget::new(metrics.clone(), 1000);
        let budget = InFlight::sharing(1 << 30, Some(capture.clone()));
        let first = budget.hold(&batch(600));
        assert_eq!(metrics.capture_queue_bytes.get(), 600, "charged to the capture budget");
        let mut data_path = Charge::default();
        assert!(
            !capture.reserve(&mut data_path, 500),
            "the data path finds the budget spent by bodies waiting for the writer"
        );
        let (done, finished) = mpsc::channel();
        let waiting = {
            let budget = budget.clone();
            std::thread::spawn(move || {
                let second = budget.hold(&batch(500));
                done.send(()).unwrap();
                second
            })
        };
        assert!(finished.recv_timeout(Duration::from_millis(200)).is_err());
        drop(first);
        finished
            .recv_timeout(Duration::from_secs(30))
            .expect("the second batch goes once the first is given back");
        let second = waiting.join().unwrap();
        assert_eq!(metrics.capture_queue_bytes.get(), 500);
        drop(second);
        assert_eq!(metrics.capture_queue_bytes.get(), 0);
    }

    #[test]
    fn a_batch_larger_than_the_budget_goes_when_nothing_else_is_held() {
        let budget = InFlight::new(100);
        let big = budget.hold(&batch(5000));
        assert_eq!(budget.bytes(), 5000);
        drop(big);
        let _again = budget.hold(&batch(5000));
    }
}
