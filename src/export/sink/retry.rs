//! When to send a failed batch again: jittered exponential backoff (backon), or the destination's own delay
//! (HTTP `Retry-After`, gRPC `RetryInfo`) capped at `retry_max`, so that a server asking for a day cannot hold
//! spans for a day.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Below this, a retry is a busy loop against a destination that answered at once.
const MIN_WAIT: Duration = Duration::from_millis(10);

#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub initial: Duration,
    pub max: Duration,
}

impl RetryPolicy {
    /// A fresh schedule (one per batch). backon's jitter adds up to 100% of the delay, so it is built on half
    /// the configured delays: each wait falls in [d/2, d) with d = min(initial · 2ⁿ, max), never above `max`.
    pub fn schedule(&self) -> Schedule {
        let backoff = ExponentialBuilder::default()
            .with_min_delay(self.initial / 2)
            .with_max_delay(self.max / 2)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build();
        Schedule { backoff, max: self.max }
    }
}

pub struct Schedule {
    backoff: ExponentialBackoff,
    max: Duration,
}

impl Schedule {
    /// The wait before the next attempt: the server's delay if it gave one (capped at `max`), else the next
    /// backoff step. A server delay still advances the schedule: the spec says to wait it, then back off.
    pub fn next_wait(&mut self, server_delay: Option<Duration>) -> Duration {
        let ours = self.backoff.next().unwrap_or(self.max);
        server_delay.map_or(ours, |d| d.min(self.max)).max(MIN_WAIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_stays_under_the_cap() {
        let policy = RetryPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(1000),
        };
        let mut s = policy.schedule();
        let waits: Vec<Duration> = (0..8).map(|_| s.next_wait(None)).collect();
        assert!(
            waits[0] >= Duration::from_millis(50) && waits[0] < Duration::from_millis(100),
            "{waits:?}"
        );
        assert!(waits[2] >= Duration::from_millis(200), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= policy.max), "{waits:?}");
    }

    #[test]
    fn a_server_delay_is_honoured_up_to_retry_max() {
        let policy = RetryPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
        };
        let mut s = policy.schedule();
        assert_eq!(s.next_wait(Some(Duration::from_secs(2))), Duration::from_secs(2));
        assert_eq!(s.next_wait(Some(Duration::from_secs(86_400))), Duration::from_secs(30));
        assert_eq!(s.next_wait(Some(Duration::ZERO)), MIN_WAIT);
    }
}
