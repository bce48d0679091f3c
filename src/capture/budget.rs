//! One budget for every captured byte held in memory: bodies as the taps keep them while an exchange is in
//! flight, then whole exchanges waiting in the capture queue, until the pipeline has processed them.
//!
//! Counting only the queue let each in-flight exchange buffer up to its cap before anything was counted: 24
//! concurrent 30 MB uploads held ~1 GiB with a 16 MiB budget. Every kept byte is charged when it is kept and
//! released when the capture holding it is dropped (processed, refused by the queue, or abandoned with its
//! request), so the gauge is exact whatever path an exchange takes.

use std::sync::Arc;

use crate::telemetry::Metrics;

/// The shared budget (`capture.queue_bytes`); the gauge is `Metrics::capture_queue_bytes`.
#[derive(Clone)]
pub struct Budget {
    metrics: Arc<Metrics>,
    max: u64,
}

impl Budget {
    pub fn new(metrics: Arc<Metrics>, max: u64) -> Budget {
        Budget { metrics, max }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// `capture.queue_bytes`.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Bytes charged now, by every holder.
    pub fn held(&self) -> u64 {
        self.metrics.capture_queue_bytes.get()
    }

    /// Charge `bytes` whatever the budget holds, for memory that exists already and must be kept (the bodies the
    /// pipeline decoded, waiting for the store): until they are given back, the data path finds the budget spent
    /// and cuts what it captures, so that what capture holds in all stays near `capture.queue_bytes`.
    pub fn charge(&self, bytes: u64) -> Charge {
        self.metrics.capture_queue_bytes.add(bytes);
        Charge {
            bytes,
            gauge: Some(self.metrics.clone()),
        }
    }

    /// Charge `bytes` to `charge` if they fit. A capture that would take the budget past its limit is refused,
    /// except when nothing else is held (one oversized exchange still gets through an idle llmtap).
    pub fn reserve(&self, charge: &mut Charge, bytes: u64) -> bool {
        let before = self.metrics.capture_queue_bytes.fetch_add(bytes);
        if before > 0 && before + bytes > self.max {
            self.metrics.capture_queue_bytes.sub(bytes);
            return false;
        }
        charge.bytes += bytes;
        if charge.gauge.is_none() {
            charge.gauge = Some(self.metrics.clone());
        }
        true
    }
}

/// Bytes charged to the budget by one capture; given back when it is dropped.
#[derive(Debug, Default)]
pub struct Charge {
    bytes: u64,
    gauge: Option<Arc<Metrics>>,
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(gauge) = &self.gauge {
            gauge.capture_queue_bytes.sub(self.bytes);
        }
    }
}

/// A copy of a capture holds no charge: only the original gives its bytes back.
impl Clone for Charge {
    fn clone(&self) -> Charge {
        Charge::default()
    }
}

impl PartialEq for Charge {
    fn eq(&self, _: &Charge) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_refused_past_the_limit_and_given_back_on_drop() {
        let metrics = Arc::new(Metrics::default());
        let budget = Budget::new(metrics.clone(), 100);
        let mut a = Charge::default();
        assert!(
            budget.reserve(&mut a, 150),
            "an idle budget takes one oversized capture"
        );
        let mut b = Charge::default();
        assert!(!budget.reserve(&mut b, 1), "then nothing more");
        drop(a);
        assert_eq!(metrics.capture_queue_bytes.get(), 0);
        assert!(budget.reserve(&mut b, 60));
        let mut c = Charge::default();
        assert!(budget.reserve(&mut c, 40));
        assert!(!budget.reserve(&mut c, 1));
        let copy = c.clone();
        drop(copy);
        assert_eq!(metrics.capture_queue_bytes.get(), 100, "a copy gives nothing back");
        drop((b, c));
        assert_eq!(metrics.capture_queue_bytes.get(), 0);
    }
}
