//! Percentiles and formatting for the benchmark's printed figures.

use std::time::Duration;

pub struct Summary {
    sorted: Vec<Duration>,
}

impl Summary {
    pub fn of(samples: &mut [Duration]) -> Summary {
        samples.sort();
        Summary {
            sorted: samples.to_vec(),
        }
    }

    pub fn pct(&self, p: f64) -> Duration {
        if self.sorted.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.sorted.len() as f64 - 1.0) * p).round() as usize;
        self.sorted[i.min(self.sorted.len() - 1)]
    }

    pub fn p50_us(&self) -> String {
        fmt_us(self.pct(0.50))
    }
    pub fn p90_us(&self) -> String {
        fmt_us(self.pct(0.90))
    }
    pub fn p99_us(&self) -> String {
        fmt_us(self.pct(0.99))
    }
}

pub fn fmt_us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

/// Signed difference in microseconds, for "added latency" figures.
pub fn fmt_delta_us(a: Duration, b: Duration) -> String {
    format!("{:+.1} us", (a.as_secs_f64() - b.as_secs_f64()) * 1e6)
}

pub fn fmt_rate(r: f64) -> String {
    if r >= 1000.0 {
        format!("{:.1}k", r / 1000.0)
    } else {
        format!("{r:.0}")
    }
}
