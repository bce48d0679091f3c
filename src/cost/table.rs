//! The embedded price table (data/prices.json, written by scripts/update-prices.py) and genai-prices' lookup:
//! provider by id, model by clause, the price period in effect at the call's time.

use std::sync::{Arc, LazyLock};

use chrono::{DateTime, NaiveDate, NaiveTime};
use serde::{Deserialize, Deserializer};

use super::matcher::Matcher;
use super::price::ModelPrices;
use crate::model::exchange::UnixMicros;

const EMBEDDED: &str = include_str!("../../data/prices.json");

/// Where the embedded prices come from (data/prices.PROVENANCE.md has the rest).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct Source {
    /// `genai-prices`
    pub package: String,
    /// `pypi`
    pub registry: String,
    pub version: String,
    pub licence: String,
    /// The day scripts/update-prices.py ran (YYYY-MM-DD).
    pub fetched: String,
}

#[derive(Debug, Deserialize)]
pub struct PriceData {
    pub source: Source,
    providers: Vec<Provider>,
}

#[derive(Debug, Deserialize)]
struct Provider {
    id: String,
    provider_match: Option<Matcher>,
    // `model_match` (guessing the provider from a model name) is in the data but not read: llmtap always knows
    // the provider, and a self-hosted model must not be priced as the vendor's.
    fallback_model_providers: Vec<String>,
    models: Vec<Model>,
}

#[derive(Debug, Deserialize)]
pub struct Model {
    pub id: String,
    #[serde(rename = "match")]
    matcher: Matcher,
    prices: Vec<Period>,
}

#[derive(Debug, Deserialize)]
struct Period {
    constraint: Option<Constraint>,
    prices: ModelPrices,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Constraint {
    /// A price change: in effect from this UTC date on.
    StartDate {
        #[serde(deserialize_with = "date")]
        start_date: NaiveDate,
    },
    /// An off-peak window (e.g. DeepSeek's), UTC; wraps past midnight when `end_time < start_time`.
    TimeOfDay {
        #[serde(deserialize_with = "time")]
        start_time: NaiveTime,
        #[serde(deserialize_with = "time")]
        end_time: NaiveTime,
    },
}

fn date<'de, D: Deserializer<'de>>(d: D) -> Result<NaiveDate, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

fn time<'de, D: Deserializer<'de>>(d: D) -> Result<NaiveTime, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("the embedded price table (data/prices.json) does not load: {0}")]
pub struct TableError(Arc<serde_path_to_error::Error<serde_json::Error>>);

static TABLE: LazyLock<Result<PriceData, TableError>> = LazyLock::new(|| parse(EMBEDDED));

fn parse(text: &str) -> Result<PriceData, TableError> {
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| TableError(Arc::new(e)))
}

/// The embedded table, parsed (and its regexes compiled) on first use.
pub fn embedded() -> Result<&'static PriceData, TableError> {
    TABLE.as_ref().map_err(Clone::clone)
}

/// OpenTelemetry GenAI well-known `gen_ai.provider.name` values whose genai-prices id differs and is not caught by
/// its `provider_match` clauses (checked against the data: `gcp.gemini`/`gcp.vertex_ai` match "google" by
/// `contains`, `aws.bedrock` matches "aws", `mistral_ai` matches "mistral").
fn alias(provider: &str) -> &str {
    match provider {
        "x_ai" => "x-ai",
        "azure.ai.openai" | "azure.ai.inference" => "azure",
        other => other,
    }
}

impl PriceData {
    fn provider(&self, name: &str) -> Option<&Provider> {
        let name = alias(name);
        self.providers.iter().find(|p| p.id == name).or_else(|| {
            self.providers
                .iter()
                .find(|p| p.provider_match.as_ref().is_some_and(|m| m.is_match(name)))
        })
    }

    /// The model `model_ref` of `provider` (names as llmtap reports them), or why there is none.
    pub fn find(&self, provider: &str, model_ref: &str) -> Result<&Model, Missing> {
        let mut provider = provider.trim().to_lowercase();
        let mut model = model_ref.trim().to_lowercase();
        // Gemini names models by resource ("models/gemini-2.5-flash"); the table uses the bare id.
        if let Some(bare) = model.strip_prefix("models/") {
            model = bare.to_owned();
        }
        // LiteLLM routes by "<provider>/<model>"; genai-prices prices such a call as the named provider's.
        if provider == "litellm"
            && let Some((p, m)) = model.split_once('/')
            && self.provider(p).is_some()
        {
            (provider, model) = (p.to_owned(), m.to_owned());
        }
        let Some(p) = self.provider(&provider) else {
            return Err(Missing::Provider);
        };
        if let Some(found) = self.find_in(p, &model, true) {
            return Ok(found);
        }
        // LiteLLM and OpenRouter report compact dates (gpt-5.2-20251211) where the table has dashed ones.
        match dashed_dates(&model) {
            Some(dashed) => self.find_in(p, &dashed, true).ok_or(Missing::Model),
            None => Err(Missing::Model),
        }
    }

    fn find_in<'a>(&'a self, p: &'a Provider, lowered: &str, fallback: bool) -> Option<&'a Model> {
        p.models.iter().find(|m| m.matcher.is_match(lowered)).or_else(|| {
            // One step only (genai-prices: a fallback provider's own fallbacks are not followed), e.g. Azure →
            // OpenAI, Google → Anthropic for Claude on Vertex.
            if !fallback {
                return None;
            }
            p.fallback_model_providers
                .iter()
                .filter_map(|id| self.providers.iter().find(|q| &q.id == id))
                .find_map(|q| self.find_in(q, lowered, false))
        })
    }
}

pub enum Missing {
    Provider,
    Model,
}

impl Model {
    /// The prices in effect at `at`: the last period whose constraint holds, else the first (genai-prices' rule;
    /// the data lists a model's original price first and later changes after it).
    pub fn prices_at(&self, at: UnixMicros) -> Option<&ModelPrices> {
        // Out of chrono's range (±262 000 years) cannot be a real call time; the epoch picks the first period.
        let when = DateTime::from_timestamp_micros(at).unwrap_or_default();
        self.prices
            .iter()
            .rev()
            .find(|p| match &p.constraint {
                None => true,
                Some(Constraint::StartDate { start_date }) => when.date_naive() >= *start_date,
                Some(Constraint::TimeOfDay { start_time, end_time }) => {
                    let t = when.time();
                    if end_time < start_time {
                        t >= *start_time || t < *end_time
                    } else {
                        *start_time <= t && t < *end_time
                    }
                }
            })
            .or(self.prices.first())
            .map(|p| &p.prices)
    }
}

/// Rewrite `-YYYYMMDD` (a real date, followed by `-`, `:` or the end) as `-YYYY-MM-DD`; None if nothing changed.
fn dashed_dates(model: &str) -> Option<String> {
    let mut out = String::with_capacity(model.len() + 4);
    let mut changed = false;
    let mut rest = model;
    while let Some(i) = rest.find('-') {
        out.push_str(&rest[..=i]);
        rest = &rest[i + 1..];
        let digits = rest.as_bytes().iter().take_while(|b| b.is_ascii_digit()).count();
        let ends_well = matches!(rest.as_bytes().get(8), None | Some(b'-' | b':'));
        if digits == 8 && ends_well && rest.starts_with("20") {
            let (y, m, d) = (&rest[..4], &rest[4..6], &rest[6..8]);
            let valid = match (y.parse(), m.parse(), d.parse()) {
                (Ok(y), Ok(m), Ok(d)) => NaiveDate::from_ymd_opt(y, m, d).is_some(),
                _ => false,
            };
            if valid {
                out.push_str(&format!("{y}-{m}-{d}"));
                rest = &rest[8..];
                changed = true;
            }
        }
    }
    out.push_str(rest);
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_table_loads() {
        let t = embedded().unwrap();
        assert_eq!(t.source.package, "genai-prices");
        assert!(t.providers.len() > 10);
    }

    #[test]
    fn compact_dates_become_dashed() {
        assert_eq!(dashed_dates("gpt-5.2-20251211").as_deref(), Some("gpt-5.2-2025-12-11"));
        assert_eq!(dashed_dates("x-20251211:free").as_deref(), Some("x-2025-12-11:free"));
        // Not a date (month 13), too many digits, or nothing to do.
        assert_eq!(dashed_dates("x-20251311"), None);
        assert_eq!(dashed_dates("x-202512110"), None);
        assert_eq!(dashed_dates("gpt-4o-2024-08-06"), None);
    }

    fn model_with(periods: &str) -> Model {
        serde_json::from_str(&format!(
            r#"{{"id": "m", "match": {{"equals": "m"}}, "prices": {periods}}}"#
        ))
        .unwrap()
    }

    fn micros(rfc3339: &str) -> UnixMicros {
        DateTime::parse_from_rfc3339(rfc3339).unwrap().timestamp_micros()
    }

    #[test]
    fn the_last_period_in_effect_wins_and_the_first_is_the_default() {
        let m = model_with(
            r#"[{"constraint": null, "prices": {"input_mtok": "1"}},
                {"constraint": {"start_date": "2025-06-01"}, "prices": {"input_mtok": "2"}}]"#,
        );
        let input = |at| m.prices_at(micros(at)).unwrap().input_mtok.clone();
        assert_eq!(
            input("2025-05-31T23:59:59Z"),
            Some(super::super::price::Price::Flat(1.into()))
        );
        assert_eq!(
            input("2025-06-01T00:00:00Z"),
            Some(super::super::price::Price::Flat(2.into()))
        );
    }

    #[test]
    fn time_of_day_windows_wrap_past_midnight() {
        let m = model_with(
            r#"[{"constraint": null, "prices": {"input_mtok": "1"}},
                {"constraint": {"start_time": "16:30:00", "end_time": "00:30:00"}, "prices": {"input_mtok": "5"}}]"#,
        );
        let input = |at| m.prices_at(micros(at)).unwrap().input_mtok.clone();
        assert_eq!(
            input("2025-01-01T23:00:00Z"),
            Some(super::super::price::Price::Flat(5.into()))
        );
        assert_eq!(
            input("2025-01-01T00:29:59Z"),
            Some(super::super::price::Price::Flat(5.into()))
        );
        assert_eq!(
            input("2025-01-01T00:30:00Z"),
            Some(super::super::price::Price::Flat(1.into()))
        );
    }
}
