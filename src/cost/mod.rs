//! What a call cost, in US dollars.
//!
//! # Where the prices come from
//! `data/prices.json`, embedded at build time (`include_str!`) and parsed once on first use. It is a trimmed copy
//! of the price data of pydantic's [genai-prices](https://github.com/pydantic/genai-prices) (MIT), taken from
//! its PyPI wheel by `scripts/update-prices.py`; `data/prices.PROVENANCE.md` records the version, licence and
//! date, and what was dropped. llmtap never downloads prices at run time.
//!
//! To refresh: `python3 scripts/update-prices.py` (or `--version X.Y.Z`), then `cargo test --test cost`, and
//! commit `data/` together.
//!
//! # How a call is priced
//! The lookup follows genai-prices: the provider by id or its `provider_match` clause (llmtap's
//! `gen_ai.provider.name`: `openai`, `anthropic`, `gcp.gemini`, or an OpenAI-compatible upstream's name such as
//! `groq` or `openrouter`), then the model by its match clauses against the lowercased name the response
//! reported (also with a compact `-YYYYMMDD` date rewritten `-YYYY-MM-DD`, and the provider's fallback providers,
//! e.g. Azure → OpenAI), then the price period in effect at the call's time (dated price changes, off-peak
//! windows), then tiers by prompt size. User overrides ([`CostTable::with_overrides`]) are tried first.
//! An unknown provider name is not guessed from the model name: a self-hosted `gpt-oss` is not OpenAI's.
//!
//! # Units
//! Prices are USD per million tokens; costs are [`rust_decimal::Decimal`] dollars (see [`CostBreakdown`] for
//! why not integer micro-dollars). The parts of a breakdown are disjoint, following `Usage`'s convention
//! (`input` includes cache reads and writes, `output` includes reasoning), and add up to `total` exactly.
//!
//! # Unknown
//! A call whose provider or model is not in the table (nor in the overrides), or that has tokens of a kind the
//! model has no price for, or whose usage is inconsistent, has an unknown cost: [`UnknownCost`], never zero.
//! Callers leave the cost out (no attribute, NULL column) rather than record $0.

mod matcher;
mod overrides;
mod price;
mod table;

use std::path::Path;

pub use overrides::OverrideError;
pub use price::{CostBreakdown, UnknownCost};
pub use table::{Source, TableError};

use crate::model::exchange::UnixMicros;
use crate::model::usage::Usage;

/// Why a cost table could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CostTableError {
    #[error(transparent)]
    Table(#[from] TableError),
    #[error(transparent)]
    Overrides(#[from] OverrideError),
}

/// Which price a cost was computed with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "from", rename_all = "snake_case")]
pub enum PricedBy {
    /// The embedded table: genai-prices' model id (e.g. `claude-sonnet-4-5`).
    Table { model_id: String },
    /// A user override: its `model` as written.
    Override { model: String },
}

/// A call's cost and the price it used.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Cost {
    #[serde(flatten)]
    pub usd: CostBreakdown,
    pub priced_by: PricedBy,
}

/// The embedded price table plus the user's overrides. Cheap to clone; build it once at startup.
#[derive(Debug, Clone)]
pub struct CostTable {
    data: &'static table::PriceData,
    overrides: Vec<overrides::Override>,
}

impl CostTable {
    /// The embedded table alone.
    pub fn embedded() -> Result<CostTable, CostTableError> {
        Ok(CostTable {
            data: table::embedded()?,
            overrides: Vec::new(),
        })
    }

    /// The embedded table with the overrides file at `path` (TOML, format in `overrides.rs`'s docs) taking
    /// precedence. A file that cannot be read or parsed, or has a negative price, is an error naming the file.
    pub fn with_overrides(path: &Path) -> Result<CostTable, CostTableError> {
        Ok(CostTable {
            data: table::embedded()?,
            overrides: overrides::load(path)?,
        })
    }

    /// Where the embedded prices come from, e.g. for `llmtap --version` or the API.
    pub fn source(&self) -> &Source {
        &self.data.source
    }

    /// The cost of one call: `provider` is llmtap's provider name (`gen_ai.provider.name`), `model` the model as
    /// the response reports it, `at` the call's start (prices change over time), `usage` in llmtap's convention.
    pub fn cost(&self, provider: &str, model: &str, at: UnixMicros, usage: &Usage) -> Result<Cost, UnknownCost> {
        if let Some(o) = self.overrides.iter().find(|o| o.matches(provider, model)) {
            return Ok(Cost {
                usd: price::breakdown(&o.prices, usage, &o.label)?,
                priced_by: PricedBy::Override { model: o.label.clone() },
            });
        }
        let found = self.data.find(provider, model).map_err(|missing| match missing {
            table::Missing::Provider => UnknownCost::Provider {
                provider: provider.to_owned(),
            },
            table::Missing::Model => UnknownCost::Model {
                provider: provider.to_owned(),
                model: model.to_owned(),
            },
        })?;
        let prices = found.prices_at(at).ok_or_else(|| UnknownCost::MissingPrice {
            model_id: found.id.clone(),
            kind: "any",
            tokens: usage.total(),
        })?;
        Ok(Cost {
            usd: price::breakdown(prices, usage, &found.id)?,
            priced_by: PricedBy::Table {
                model_id: found.id.clone(),
            },
        })
    }
}
