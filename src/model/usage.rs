//! Token usage in one convention, used everywhere inside llmtap and in every export.
//!
//! - `input` is the whole prompt, **including** cache reads and cache writes (Anthropic reports these
//!   separately; its adapter adds them back).
//! - `output` is everything generated, **including** reasoning (Gemini reports thoughts separately; its
//!   adapter adds them back).
//! - `cache_read`, `cache_write` and `reasoning` are subsets of the above; `None` when the provider does not
//!   report them (which is different from reporting zero).
//!
//! This is the convention of the OpenTelemetry GenAI `gen_ai.usage.*` attributes, so spans need no conversion.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<u64>,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.input + self.output
    }

    /// Sum for trajectory totals; an unreported subset stays unreported only if it is unreported everywhere.
    pub fn add(&mut self, other: &Usage) {
        fn add_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
            match (a, b) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
            }
        }
        self.input += other.input;
        self.output += other.output;
        self.cache_read = add_opt(self.cache_read, other.cache_read);
        self.cache_write = add_opt(self.cache_write, other.cache_write);
        self.reasoning = add_opt(self.reasoning, other.reasoning);
    }
}

/// Read a non-negative integer field; providers sometimes send null.
pub fn u64_at(v: &super::json::Json<'_>, path: &[&str]) -> Option<u64> {
    let mut cur = v;
    for key in path {
        cur = cur.get(key)?;
    }
    cur.as_u64()
}
