//! A call's cost in US dollars, split by kind of token, and sums of costs (steps, trajectories, sessions).
//!
//! The type lives in the model because every layer carries it: the pipeline prices a call (`crate::cost`),
//! derivation sums it, the store keeps it, the CLI, API, metrics and exporters show it.

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

/// A cost in US dollars, by kind of token. The five parts are disjoint and add up to `total` exactly.
///
/// Amounts are `rust_decimal::Decimal` dollars: prices are decimal numbers (e.g. $0.075 per million tokens), so a
/// single token can cost 0.000000075 USD; integer micro-dollars would round that away and per-part rounding would
/// stop the parts from adding up. A decimal with 28 significant digits holds every such product exactly.
/// Serialized as strings ("0.0012345") so JSON consumers do not round them through a float either.
///
/// An unknown cost is never a zero `CostBreakdown`: it is the absence of one (`Option::None`, JSON null, a NULL
/// column, "unknown" in a table).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostBreakdown {
    /// Prompt tokens that were neither read from nor written to a cache.
    #[serde(with = "rust_decimal::serde::str")]
    pub input: Decimal,
    #[serde(with = "rust_decimal::serde::str")]
    pub cache_read: Decimal,
    #[serde(with = "rust_decimal::serde::str")]
    pub cache_write: Decimal,
    /// Generated tokens other than reasoning.
    #[serde(with = "rust_decimal::serde::str")]
    pub output: Decimal,
    #[serde(with = "rust_decimal::serde::str")]
    pub reasoning: Decimal,
    #[serde(with = "rust_decimal::serde::str")]
    pub total: Decimal,
}

impl CostBreakdown {
    /// The total as a float, for metrics and OTLP attributes (which carry doubles). Lossy; keep `total` for sums.
    pub fn total_f64(&self) -> f64 {
        rust_decimal::prelude::ToPrimitive::to_f64(&self.total).unwrap_or(f64::NAN)
    }

    /// Part by part; `None` on overflow (beyond 7.9e28 dollars).
    pub fn checked_add(&self, other: &CostBreakdown) -> Option<CostBreakdown> {
        Some(CostBreakdown {
            input: self.input.checked_add(other.input)?,
            cache_read: self.cache_read.checked_add(other.cache_read)?,
            cache_write: self.cache_write.checked_add(other.cache_write)?,
            output: self.output.checked_add(other.output)?,
            reasoning: self.reasoning.checked_add(other.reasoning)?,
            total: self.total.checked_add(other.total)?,
        })
    }

    /// The parts in a fixed order with their names, for columns, proto fields and attributes.
    pub fn parts(&self) -> [(&'static str, Decimal); 5] {
        [
            ("input", self.input),
            ("cache_read", self.cache_read),
            ("cache_write", self.cache_write),
            ("output", self.output),
            ("reasoning", self.reasoning),
        ]
    }

    /// The total for people: dollars with at least 2 and at most 6 decimals (`$0.0123`, `$1.50`).
    pub fn display_total(&self) -> String {
        display_usd(self.total)
    }
}

/// `$` and the amount rounded to 6 decimals (half away from zero, as people round), trailing zeros dropped down to 2 decimals.
pub fn display_usd(amount: Decimal) -> String {
    let mut d = amount
        .round_dp_with_strategy(6, rust_decimal::RoundingStrategy::MidpointAwayFromZero)
        .normalize();
    if d.scale() < 2 {
        d.rescale(2);
    }
    format!("${d}")
}

/// The cost of several calls (a trajectory, a session): the sum of those with a known cost, and how many had none.
/// `usd` is `None` when no call had a known cost; with `unpriced_calls > 0` the sum is a lower bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostSum {
    #[serde(default)]
    pub usd: Option<CostBreakdown>,
    #[serde(default)]
    pub unpriced_calls: u32,
}

impl CostSum {
    /// Count one call: its cost, or `None` when it had no known cost.
    pub fn add_call(&mut self, cost: Option<&CostBreakdown>) {
        match cost {
            Some(c) => {
                let sum = match &self.usd {
                    Some(s) => s.checked_add(c),
                    None => Some(*c),
                };
                // An overflowing sum is no longer known.
                match sum {
                    Some(s) => self.usd = Some(s),
                    None => self.unpriced_calls += 1,
                }
            }
            None => self.unpriced_calls += 1,
        }
    }

    pub fn merge(&mut self, other: &CostSum) {
        self.unpriced_calls += other.unpriced_calls;
        if let Some(c) = &other.usd {
            self.add_call(Some(c));
        }
    }

    /// For tables: `$0.0123`, `≥$0.0123` when some calls had no price, `unknown` when none had one.
    pub fn display(&self) -> String {
        match (&self.usd, self.unpriced_calls) {
            (None, _) => "unknown".to_owned(),
            (Some(c), 0) => c.display_total(),
            (Some(c), _) => format!("≥{}", c.display_total()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    fn usd(total: &str) -> CostBreakdown {
        let t = Decimal::from_str(total).unwrap_or_default();
        CostBreakdown {
            input: t,
            total: t,
            ..Default::default()
        }
    }

    #[test]
    fn amounts_show_between_two_and_six_decimals() {
        assert_eq!(display_usd(Decimal::from_str("0.0123").unwrap_or_default()), "$0.0123");
        assert_eq!(display_usd(Decimal::from_str("1.5").unwrap_or_default()), "$1.50");
        assert_eq!(
            display_usd(Decimal::from_str("0.000000075").unwrap_or_default()),
            "$0.00"
        );
        assert_eq!(
            display_usd(Decimal::from_str("0.0000015").unwrap_or_default()),
            "$0.000002"
        );
    }

    #[test]
    fn a_sum_is_unknown_without_any_priced_call_and_a_lower_bound_with_some_unpriced() {
        let mut s = CostSum::default();
        s.add_call(None);
        assert_eq!(s.display(), "unknown");
        s.add_call(Some(&usd("0.5")));
        s.add_call(Some(&usd("0.25")));
        assert_eq!(s.usd.map(|c| c.total), Decimal::from_str("0.75").ok());
        assert_eq!(s.unpriced_calls, 1);
        assert_eq!(s.display(), "≥$0.75");
        let mut all = CostSum::default();
        all.merge(&s);
        all.merge(&s);
        assert_eq!(all.usd.map(|c| c.total), Decimal::from_str("1.5").ok());
        assert_eq!(all.unpriced_calls, 2);
    }
}
