//! User price overrides: private, fine-tuned or negotiated models, in TOML. They win over the embedded table.
//!
//! ```toml
//! [[prices]]
//! provider = "openai"            # llmtap's provider name (gen_ai.provider.name); omit to match any provider
//! model = "ft:gpt-4o-mini:acme:*" # exact model name (case-insensitive), or a prefix when it ends with `*`
//! input_mtok = 0.3                # USD per million tokens; required
//! output_mtok = 1.2               # required
//! cache_read_mtok = 0.15          # optional: cache reads are charged at input_mtok without it
//! cache_write_mtok = 0.375        # optional: cache writes are charged at input_mtok without it
//! reasoning_mtok = 1.2            # optional: reasoning is charged at output_mtok without it
//! ```
//!
//! Numbers may be written as TOML integers, floats or strings ("0.3"); floats are read through their shortest
//! decimal form, so `0.3` is exactly 0.3, not 0.29999999999999998890.

use std::path::{Path, PathBuf};

use rust_decimal::Decimal;
use serde::Deserialize;

use super::price::{ModelPrices, Price};

#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    #[error("price overrides {path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("price overrides {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("price overrides {path}: [[prices]] entry {index} (model {model:?}): {what}")]
    Invalid {
        path: PathBuf,
        /// 1-based, in file order.
        index: usize,
        model: String,
        what: &'static str,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    prices: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    provider: Option<String>,
    model: String,
    input_mtok: Decimal,
    output_mtok: Decimal,
    cache_read_mtok: Option<Decimal>,
    cache_write_mtok: Option<Decimal>,
    reasoning_mtok: Option<Decimal>,
}

/// One override, ready to match.
#[derive(Debug, Clone)]
pub struct Override {
    /// Lowercased; None matches every provider.
    provider: Option<String>,
    /// Lowercased, without the trailing `*` when `prefix`.
    model: String,
    prefix: bool,
    pub prices: ModelPrices,
    /// The model as the user wrote it, for reporting.
    pub label: String,
}

impl Override {
    pub fn matches(&self, provider: &str, model: &str) -> bool {
        let provider_ok = self
            .provider
            .as_deref()
            .is_none_or(|p| p == provider.trim().to_lowercase());
        let model = model.trim().to_lowercase();
        let model_ok = if self.prefix {
            model.starts_with(&self.model)
        } else {
            model == self.model
        };
        provider_ok && model_ok
    }
}

/// Parse an overrides file's text; `path` only labels errors.
pub fn parse(text: &str, path: &Path) -> Result<Vec<Override>, OverrideError> {
    let file: File = toml::from_str(text).map_err(|e| OverrideError::Parse {
        path: path.to_owned(),
        source: Box::new(e),
    })?;
    file.prices
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let invalid = |what| OverrideError::Invalid {
                path: path.to_owned(),
                index: i + 1,
                model: e.model.clone(),
                what,
            };
            let lowered = e.model.trim().to_lowercase();
            let (model, prefix) = match lowered.strip_suffix('*') {
                Some(p) => (p.to_owned(), true),
                None => (lowered, false),
            };
            if model.is_empty() {
                return Err(invalid("model is empty"));
            }
            let prices = ModelPrices {
                input_mtok: Some(Price::Flat(e.input_mtok)),
                cache_read_mtok: e.cache_read_mtok.map(Price::Flat),
                cache_write_mtok: e.cache_write_mtok.map(Price::Flat),
                output_mtok: Some(Price::Flat(e.output_mtok)),
                output_reasoning_mtok: e.reasoning_mtok.map(Price::Flat),
            };
            if !prices.is_valid() {
                return Err(invalid("a price is negative"));
            }
            Ok(Override {
                provider: e.provider.map(|p| p.trim().to_lowercase()),
                model,
                prefix,
                prices,
                label: e.model,
            })
        })
        .collect()
}

/// Read and parse an overrides file.
pub fn load(path: &Path) -> Result<Vec<Override>, OverrideError> {
    let text = std::fs::read_to_string(path).map_err(|source| OverrideError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn p(text: &str) -> Result<Vec<Override>, OverrideError> {
        parse(text, Path::new("prices.toml"))
    }

    #[test]
    fn floats_are_read_as_the_decimals_written() {
        let o = p("[[prices]]\nmodel = \"m\"\ninput_mtok = 0.3\noutput_mtok = \"1.2\"\ncache_read_mtok = 3\n").unwrap();
        assert_eq!(
            o[0].prices.input_mtok,
            Some(Price::Flat(Decimal::from_str("0.3").unwrap()))
        );
        assert_eq!(
            o[0].prices.output_mtok,
            Some(Price::Flat(Decimal::from_str("1.2").unwrap()))
        );
        assert_eq!(o[0].prices.cache_read_mtok, Some(Price::Flat(Decimal::from(3))));
    }

    #[test]
    fn exact_and_prefix_models_and_optional_provider() {
        let o = p(r#"
            [[prices]]
            provider = "OpenAI"
            model = "ft:gpt-4o-mini:acme:*"
            input_mtok = 1
            output_mtok = 2
            [[prices]]
            model = "Private-Model"
            input_mtok = 1
            output_mtok = 2
        "#)
        .unwrap();
        assert!(o[0].matches("openai", "ft:gpt-4o-mini:acme:abc123"));
        assert!(!o[0].matches("groq", "ft:gpt-4o-mini:acme:abc123"));
        assert!(!o[0].matches("openai", "gpt-4o-mini"));
        assert!(o[1].matches("anything", "private-model"));
        assert!(!o[1].matches("anything", "private-model-2"));
    }

    #[test]
    fn a_typo_is_an_error_naming_the_file() {
        let e = p("[[prices]]\nmodel = \"m\"\ninput_mtoks = 1\noutput_mtok = 2\n").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, OverrideError::Parse { .. }), "{msg}");
        assert!(msg.contains("prices.toml") && msg.contains("input_mtoks"), "{msg}");
    }

    #[test]
    fn a_missing_output_price_is_an_error() {
        let e = p("[[prices]]\nmodel = \"m\"\ninput_mtok = 1\n").unwrap_err();
        assert!(e.to_string().contains("output_mtok"), "{e}");
    }

    #[test]
    fn a_negative_price_is_an_error_naming_the_entry() {
        let e = p("[[prices]]\nmodel = \"m\"\ninput_mtok = 1\noutput_mtok = 2\n[[prices]]\nmodel = \"n\"\ninput_mtok = -1\noutput_mtok = 2\n")
            .unwrap_err();
        assert!(
            matches!(&e, OverrideError::Invalid { index: 2, model, .. } if model == "n"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_file_is_a_read_error() {
        let e = load(Path::new("/nonexistent/llmtap-prices.toml")).unwrap_err();
        assert!(matches!(e, OverrideError::Read { .. }), "{e}");
    }
}
