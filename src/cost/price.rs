//! One model's prices (USD per million tokens, optionally tiered) and the arithmetic that turns a `Usage` into a
//! cost breakdown.
//!
//! The rules are genai-prices' (its `ModelPrice.calc_price`), restated for llmtap's `Usage`:
//! - `Usage.input` includes cache reads and writes: uncached input = input − cache_read − cache_write.
//! - A cache read/write without its own price is charged at the input price; reasoning without its own price at
//!   the output price (genai-prices prices the "leaf" counts the same way: an unpriced subset stays in its parent).
//! - Tiers are cliffs chosen by the whole prompt (`Usage.input`, cache included): above a tier's `start`, every
//!   token of that kind pays the tier's price, not just the tokens above the threshold.

use rust_decimal::Decimal;
use serde::Deserialize;

pub use crate::model::cost::CostBreakdown;
use crate::model::usage::Usage;

/// A price per million tokens, flat or tiered by prompt size.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Price {
    Flat(Decimal),
    Tiered { base: Decimal, tiers: Vec<Tier> },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Tier {
    /// The tier applies when the prompt has strictly more than this many tokens.
    pub start: u64,
    pub price: Decimal,
}

impl Price {
    /// The price per million tokens for a prompt of `prompt_tokens` (cache included).
    pub fn per_mtok(&self, prompt_tokens: u64) -> Decimal {
        match self {
            Price::Flat(p) => *p,
            // The highest tier whose threshold the prompt exceeds; tiers are not guaranteed sorted in the data.
            Price::Tiered { base, tiers } => tiers
                .iter()
                .filter(|t| prompt_tokens > t.start)
                .max_by_key(|t| t.start)
                .map_or(*base, |t| t.price),
        }
    }

    fn is_valid(&self) -> bool {
        match self {
            Price::Flat(p) => !p.is_sign_negative(),
            Price::Tiered { base, tiers } => {
                !base.is_sign_negative() && tiers.iter().all(|t| !t.price.is_sign_negative())
            }
        }
    }
}

/// The token prices llmtap can use (the keys data/prices.json keeps; see scripts/update-prices.py).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrices {
    pub input_mtok: Option<Price>,
    pub cache_read_mtok: Option<Price>,
    pub cache_write_mtok: Option<Price>,
    pub output_mtok: Option<Price>,
    pub output_reasoning_mtok: Option<Price>,
}

impl ModelPrices {
    /// Every price present is non-negative.
    pub fn is_valid(&self) -> bool {
        [
            &self.input_mtok,
            &self.cache_read_mtok,
            &self.cache_write_mtok,
            &self.output_mtok,
            &self.output_reasoning_mtok,
        ]
        .into_iter()
        .flatten()
        .all(Price::is_valid)
    }
}

/// Why a call has no cost. Never reported as zero: a missing price is not a free call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnknownCost {
    #[error("provider {provider:?} is not in the price table")]
    Provider { provider: String },
    #[error("model {model:?} has no price for provider {provider:?}")]
    Model { provider: String, model: String },
    #[error("model {model_id:?} has {tokens} {kind} tokens but no price for them")]
    MissingPrice {
        model_id: String,
        kind: &'static str,
        tokens: u64,
    },
    #[error("usage is inconsistent: {what}")]
    InconsistentUsage { what: String },
    #[error("cost of model {model_id:?} overflows")]
    Overflow { model_id: String },
}

const PER: u64 = 1_000_000;

/// Price `usage` with `prices`. `model_id` only labels errors.
pub fn breakdown(prices: &ModelPrices, usage: &Usage, model_id: &str) -> Result<CostBreakdown, UnknownCost> {
    let cache_read = usage.cache_read.unwrap_or(0);
    let cache_write = usage.cache_write.unwrap_or(0);
    let reasoning = usage.reasoning.unwrap_or(0);
    let uncached = usage
        .input
        .checked_sub(cache_read)
        .and_then(|rest| rest.checked_sub(cache_write))
        .ok_or_else(|| UnknownCost::InconsistentUsage {
            what: format!(
                "cache reads ({cache_read}) + cache writes ({cache_write}) exceed the input ({})",
                usage.input
            ),
        })?;
    let plain_output = usage
        .output
        .checked_sub(reasoning)
        .ok_or_else(|| UnknownCost::InconsistentUsage {
            what: format!("reasoning ({reasoning}) exceeds the output ({})", usage.output),
        })?;

    // A model whose kept prices are all absent (e.g. priced only per audio hour) prices nothing llmtap sees.
    if prices.input_mtok.is_none() && prices.output_mtok.is_none() {
        return Err(UnknownCost::MissingPrice {
            model_id: model_id.to_owned(),
            kind: "any",
            tokens: usage.total(),
        });
    }

    let prompt = usage.input;
    let part = |kind: &'static str, tokens: u64, own: &Option<Price>, parent: &Option<Price>| {
        if tokens == 0 {
            return Ok(Decimal::ZERO);
        }
        let price = own
            .as_ref()
            .or(parent.as_ref())
            .ok_or_else(|| UnknownCost::MissingPrice {
                model_id: model_id.to_owned(),
                kind,
                tokens,
            })?;
        // tokens × $/Mtok ÷ 10⁶: dividing by a power of ten only moves the decimal point, so this is exact.
        price
            .per_mtok(prompt)
            .checked_mul(Decimal::from(tokens))
            .and_then(|x| x.checked_div(Decimal::from(PER)))
            .ok_or_else(|| UnknownCost::Overflow {
                model_id: model_id.to_owned(),
            })
    };
    let input = part("input", uncached, &prices.input_mtok, &None)?;
    let cache_read = part("cache read", cache_read, &prices.cache_read_mtok, &prices.input_mtok)?;
    let cache_write = part("cache write", cache_write, &prices.cache_write_mtok, &prices.input_mtok)?;
    let output = part("output", plain_output, &prices.output_mtok, &None)?;
    let reasoning = part(
        "reasoning",
        reasoning,
        &prices.output_reasoning_mtok,
        &prices.output_mtok,
    )?;
    let total = [input, cache_read, cache_write, output, reasoning]
        .into_iter()
        .try_fold(Decimal::ZERO, Decimal::checked_add)
        .ok_or_else(|| UnknownCost::Overflow {
            model_id: model_id.to_owned(),
        })?;
    Ok(CostBreakdown {
        input,
        cache_read,
        cache_write,
        output,
        reasoning,
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn d(s: &str) -> Decimal {
        Decimal::from_str(s).unwrap()
    }

    fn flat(s: &str) -> Option<Price> {
        Some(Price::Flat(d(s)))
    }

    #[test]
    fn tiers_are_cliffs_on_the_whole_prompt() {
        let p = Price::Tiered {
            base: d("1.25"),
            tiers: vec![Tier {
                start: 200_000,
                price: d("2.5"),
            }],
        };
        assert_eq!(p.per_mtok(200_000), d("1.25"));
        assert_eq!(p.per_mtok(200_001), d("2.5"));
    }

    #[test]
    fn unpriced_subsets_fall_back_to_their_parent_price() {
        let prices = ModelPrices {
            input_mtok: flat("2"),
            output_mtok: flat("8"),
            ..Default::default()
        };
        let usage = Usage {
            input: 1_000,
            output: 500,
            cache_read: Some(400),
            cache_write: None,
            reasoning: Some(100),
        };
        let c = breakdown(&prices, &usage, "m").unwrap();
        // 600 × 2 / 1e6, 400 × 2 / 1e6, 400 × 8 / 1e6, 100 × 8 / 1e6
        assert_eq!(c.input, d("0.0012"));
        assert_eq!(c.cache_read, d("0.0008"));
        assert_eq!(c.output, d("0.0032"));
        assert_eq!(c.reasoning, d("0.0008"));
        assert_eq!(c.total, d("0.006"));
    }

    #[test]
    fn tokens_without_any_applicable_price_make_the_cost_unknown() {
        let prices = ModelPrices {
            input_mtok: flat("2"),
            ..Default::default()
        };
        let usage = Usage {
            input: 10,
            output: 3,
            ..Default::default()
        };
        assert!(matches!(
            breakdown(&prices, &usage, "m"),
            Err(UnknownCost::MissingPrice {
                kind: "output",
                tokens: 3,
                ..
            })
        ));
    }

    #[test]
    fn subsets_larger_than_their_total_are_inconsistent() {
        let prices = ModelPrices {
            input_mtok: flat("2"),
            output_mtok: flat("8"),
            ..Default::default()
        };
        let usage = Usage {
            input: 10,
            output: 3,
            cache_read: Some(11),
            ..Default::default()
        };
        assert!(matches!(
            breakdown(&prices, &usage, "m"),
            Err(UnknownCost::InconsistentUsage { .. })
        ));
    }
}
