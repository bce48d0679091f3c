//! The cost engine (src/cost) against the recorded traffic and hand-computed prices.
//!
//! Expected dollar amounts below are worked out by hand from the provider's own usage numbers (quoted from the
//! fixture) and the published per-million-token prices as data/prices.json (genai-prices 0.2.3) carries them;
//! the arithmetic is written out next to each one. If a refresh of data/prices.json moves a price, these
//! expectations must be re-derived, not copied from the new output.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::str::FromStr;

use common::*;
use llmtap::capture::Api;
use llmtap::cost::{Cost, CostTable, CostTableError, PricedBy, UnknownCost};
use llmtap::model::usage::Usage;
use rust_decimal::Decimal;

fn usd(s: &str) -> Decimal {
    Decimal::from_str(s).unwrap()
}

fn at(rfc3339: &str) -> i64 {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .unwrap()
        .timestamp_micros()
}

/// A date well after every recorded call, for fixtures whose recording kept no `date` header.
const NO_DATE: &str = "2026-01-01T00:00:00Z";

struct Recorded {
    name: String,
    provider: String,
    model: String,
    at: i64,
    usage: Usage,
}

/// llmtap's gen_ai.provider.name for a recording (the same rule as the OTLP exporter).
fn provider_name(f: &Fixture) -> String {
    match f.api() {
        Api::AnthropicMessages => "anthropic".into(),
        Api::GeminiGenerateContent => "gcp.gemini".into(),
        _ => f.upstream.to_owned(),
    }
}

/// Every recorded interaction whose normalized call has usage, with the model the response reports.
fn recorded() -> Vec<Recorded> {
    let mut out = Vec::new();
    for f in all_fixtures() {
        let Some((_, call)) = f.normalize() else {
            continue;
        };
        let Some(usage) = call.usage else { continue };
        let model = call.model_response.or(call.model_requested).unwrap();
        let date = f
            .response_headers
            .iter()
            .find(|(k, _)| k == "date")
            .map(|(_, v)| v.clone());
        let at = match date {
            // Parsed without the weekday: one recording's header names the wrong one (Tue, 23 Jul 2025).
            Some(d) => chrono::NaiveDateTime::parse_from_str(&d[5..], "%d %b %Y %H:%M:%S GMT")
                .unwrap_or_else(|e| panic!("{}: date {d:?}: {e}", f.name))
                .and_utc()
                .timestamp_micros(),
            None => at(NO_DATE),
        };
        out.push(Recorded {
            provider: provider_name(&f),
            name: f.name,
            model,
            at,
            usage,
        });
    }
    out
}

fn table() -> CostTable {
    CostTable::embedded().unwrap()
}

fn recorded_call(name: &str) -> Recorded {
    recorded().into_iter().find(|r| r.name == name).unwrap()
}

fn cost_of(r: &Recorded) -> Cost {
    table().cost(&r.provider, &r.model, r.at, &r.usage).unwrap()
}

#[test]
fn every_recorded_call_with_usage_has_a_positive_cost_or_a_listed_reason_not_to() {
    let calls = recorded();
    // Sanity: the corpus is what we think it is (every shape with usage is represented).
    assert!(calls.len() >= 60, "only {} calls with usage", calls.len());
    let mut unknown = Vec::new();
    for r in &calls {
        match table().cost(&r.provider, &r.model, r.at, &r.usage) {
            Ok(c) => {
                assert!(
                    c.usd.total > Decimal::ZERO,
                    "{}: {} {} costs {}",
                    r.name,
                    r.provider,
                    r.model,
                    c.usd.total
                );
                let parts = c.usd.input + c.usd.cache_read + c.usd.cache_write + c.usd.output + c.usd.reasoning;
                assert_eq!(parts, c.usd.total, "{}", r.name);
            }
            Err(e) => unknown.push((r.name.clone(), e)),
        }
    }
    // The one recording without a price: simonw/llm's cassette sends an OpenRouter-style model name
    // ("moonshotai/kimi-k2") to the api.openai.com URL, so llmtap sees provider "openai", which does not sell
    // that model. Pricing it as OpenRouter's would be a guess; unknown is the honest answer.
    let kimi = |name: &str| {
        (
            format!("openai_chat/simonw-llm__tools_streaming/{name}"),
            UnknownCost::Model {
                provider: "openai".into(),
                model: "moonshotai/kimi-k2".into(),
            },
        )
    };
    let expected = vec![kimi("00"), kimi("01")];
    assert_eq!(unknown, expected);
}

#[test]
fn anthropic_call_with_cache_writes_and_reads() {
    // usage: input_tokens 3, cache_creation_input_tokens 418, cache_read_input_tokens 1111, output_tokens 33.
    // claude-sonnet-4-5: $3 input, $3.75 cache write (5m), $0.30 cache read, $15 output per Mtok.
    let r = recorded_call("anthropic_messages/pydantic-ai__prompt_cache/01");
    assert_eq!(
        (r.provider.as_str(), r.model.as_str()),
        ("anthropic", "claude-sonnet-4-5-20250929")
    );
    let c = cost_of(&r);
    assert_eq!(
        c.priced_by,
        PricedBy::Table {
            model_id: "claude-sonnet-4-5".into()
        }
    );
    assert_eq!(c.usd.input, usd("0.000009")); // 3 × 3 / 1e6
    assert_eq!(c.usd.cache_write, usd("0.0015675")); // 418 × 3.75 / 1e6
    assert_eq!(c.usd.cache_read, usd("0.0003333")); // 1111 × 0.30 / 1e6
    assert_eq!(c.usd.output, usd("0.000495")); // 33 × 15 / 1e6
    assert_eq!(c.usd.reasoning, Decimal::ZERO);
    assert_eq!(c.usd.total, usd("0.0024048"));
}

#[test]
fn openai_call_with_cached_input() {
    // usage: prompt_tokens 1149 with prompt_tokens_details.cached_tokens 1024, completion_tokens 353
    // (reasoning_tokens 0). gpt-4o-mini: $0.15 input, $0.075 cached input, $0.60 output per Mtok.
    let r = recorded_call("openai_chat/openllmetry__prompt_caching/01");
    assert_eq!(r.model, "gpt-4o-mini-2024-07-18");
    let c = cost_of(&r);
    assert_eq!(c.usd.input, usd("0.00001875")); // (1149 − 1024) × 0.15 / 1e6
    assert_eq!(c.usd.cache_read, usd("0.0000768")); // 1024 × 0.075 / 1e6
    assert_eq!(c.usd.cache_write, Decimal::ZERO);
    assert_eq!(c.usd.output, usd("0.0002118")); // 353 × 0.60 / 1e6
    assert_eq!(c.usd.total, usd("0.00030735"));
}

#[test]
fn openai_call_with_reasoning_tokens() {
    // usage: prompt_tokens 577 (cached 0), completion_tokens 2320 of which reasoning_tokens 1792.
    // o3-mini: $1.10 input, $4.40 output per Mtok; reasoning has no price of its own, so it pays output's.
    let r = recorded_call("openai_chat/pydantic-ai__o-series_reasoning_effort");
    assert_eq!(r.model, "o3-mini-2025-01-31");
    let c = cost_of(&r);
    assert_eq!(c.usd.input, usd("0.0006347")); // 577 × 1.10 / 1e6
    assert_eq!(c.usd.output, usd("0.0023232")); // (2320 − 1792) × 4.40 / 1e6
    assert_eq!(c.usd.reasoning, usd("0.0078848")); // 1792 × 4.40 / 1e6
    assert_eq!(c.usd.total, usd("0.0108427"));
}

#[test]
fn gemini_call_with_thoughts() {
    // usageMetadata: promptTokenCount 5, candidatesTokenCount 877, thoughtsTokenCount 1058 (Gemini reports
    // thoughts apart from candidates; llmtap's output includes them). gemini-2.5-flash: $0.30 input, $2.50
    // output (thinking included) per Mtok.
    let r = recorded_call("gemini/openllmetry__generate_content_gzip");
    assert_eq!(
        (r.provider.as_str(), r.model.as_str()),
        ("gcp.gemini", "gemini-2.5-flash")
    );
    let c = cost_of(&r);
    assert_eq!(c.usd.input, usd("0.0000015")); // 5 × 0.30 / 1e6
    assert_eq!(c.usd.output, usd("0.0021925")); // 877 × 2.50 / 1e6
    assert_eq!(c.usd.reasoning, usd("0.002645")); // 1058 × 2.50 / 1e6
    assert_eq!(c.usd.total, usd("0.004839"));
    // The resource-name form Gemini uses in URLs prices the same.
    let by_resource = table()
        .cost("gcp.gemini", "models/gemini-2.5-flash", r.at, &r.usage)
        .unwrap();
    assert_eq!(by_resource.usd, c.usd);
}

#[test]
fn a_prompt_over_200k_tokens_pays_the_long_context_price_on_every_token() {
    // claude-sonnet-4-5 above 200k prompt tokens: $6 input, $0.60 cache read, $22.50 output per Mtok
    // (below: $3, $0.30, $15). The prompt size counts cached tokens.
    let t = table();
    let long = Usage {
        input: 250_000,
        output: 1_000,
        cache_read: Some(50_000),
        cache_write: Some(0),
        reasoning: None,
    };
    let c = t
        .cost("anthropic", "claude-sonnet-4-5-20250929", at(NO_DATE), &long)
        .unwrap();
    assert_eq!(c.usd.input, usd("1.2")); // 200 000 × 6 / 1e6
    assert_eq!(c.usd.cache_read, usd("0.03")); // 50 000 × 0.60 / 1e6
    assert_eq!(c.usd.output, usd("0.0225")); // 1 000 × 22.50 / 1e6
    assert_eq!(c.usd.total, usd("1.2525"));
    // Exactly at the threshold is still the base tier.
    let edge = Usage {
        input: 200_000,
        output: 1_000,
        ..Default::default()
    };
    let c = t.cost("anthropic", "claude-sonnet-4-5", at(NO_DATE), &edge).unwrap();
    assert_eq!(c.usd.total, usd("0.615")); // 200 000 × 3 / 1e6 + 1 000 × 15 / 1e6
}

#[test]
fn the_price_in_effect_on_the_calls_date_is_used() {
    // OpenAI cut o3 from $10/$40 to $2/$8 per Mtok on 2025-06-10.
    let t = table();
    let usage = Usage {
        input: 1_000_000,
        output: 1_000_000,
        ..Default::default()
    };
    let before = t
        .cost("openai", "o3-2025-04-16", at("2025-06-09T23:59:59Z"), &usage)
        .unwrap();
    let after = t
        .cost("openai", "o3-2025-04-16", at("2025-06-10T00:00:00Z"), &usage)
        .unwrap();
    assert_eq!(before.usd.total, usd("50"));
    assert_eq!(after.usd.total, usd("10"));
}

#[test]
fn an_unknown_model_or_provider_is_unknown_not_zero() {
    let t = table();
    let usage = Usage {
        input: 100,
        output: 10,
        ..Default::default()
    };
    assert_eq!(
        t.cost("openai", "totally-made-up-model", at(NO_DATE), &usage),
        Err(UnknownCost::Model {
            provider: "openai".into(),
            model: "totally-made-up-model".into()
        })
    );
    // A self-hosted upstream is not guessed from the model's name, even one OpenAI also sells.
    assert_eq!(
        t.cost("local", "gpt-4o", at(NO_DATE), &usage),
        Err(UnknownCost::Provider {
            provider: "local".into()
        })
    );
}

#[test]
fn overrides_win_over_the_table_and_price_private_models() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prices.toml");
    std::fs::write(
        &path,
        r#"
[[prices]]
provider = "openai"
model = "gpt-4o-mini*"
input_mtok = 0.1
output_mtok = 0.2

[[prices]]
model = "acme-private-7b"
input_mtok = 1
output_mtok = 2
cache_read_mtok = 0.5
"#,
    )
    .unwrap();
    let t = CostTable::with_overrides(&path).unwrap();

    // The prompt-caching call again (1149 prompt, 1024 cached, 353 completion), now at the negotiated price;
    // with no cache price of its own the cached part pays the input price.
    let r = recorded_call("openai_chat/openllmetry__prompt_caching/01");
    let c = t.cost(&r.provider, &r.model, r.at, &r.usage).unwrap();
    assert_eq!(
        c.priced_by,
        PricedBy::Override {
            model: "gpt-4o-mini*".into()
        }
    );
    assert_eq!(c.usd.input, usd("0.0000125")); // 125 × 0.1 / 1e6
    assert_eq!(c.usd.cache_read, usd("0.0001024")); // 1024 × 0.1 / 1e6
    assert_eq!(c.usd.output, usd("0.0000706")); // 353 × 0.2 / 1e6
    assert_eq!(c.usd.total, usd("0.0001855"));

    // Unknown to the table, known through the override (any provider).
    let usage = Usage {
        input: 2_000,
        output: 100,
        cache_read: Some(1_000),
        ..Default::default()
    };
    assert!(table().cost("local", "acme-private-7b", at(NO_DATE), &usage).is_err());
    let c = t.cost("local", "ACME-private-7b", at(NO_DATE), &usage).unwrap();
    // 1000 × 1 / 1e6 + 1000 × 0.5 / 1e6 + 100 × 2 / 1e6
    assert_eq!(c.usd.total, usd("0.0017"));
}

#[test]
fn a_bad_overrides_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prices.toml");
    std::fs::write(&path, "[[prices]]\nmodel = \"m\"\ninput_mtok = 1\noutput = 2\n").unwrap();
    let e = CostTable::with_overrides(&path).unwrap_err();
    assert!(matches!(e, CostTableError::Overrides(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("prices.toml") && msg.contains("output"), "{msg}");
}

#[test]
fn costs_serialize_as_exact_decimal_strings() {
    let r = recorded_call("anthropic_messages/pydantic-ai__prompt_cache/01");
    let v = serde_json::to_value(cost_of(&r)).unwrap();
    assert_eq!(v["total"], "0.0024048");
    assert_eq!(v["cache_write"], "0.0015675");
    assert_eq!(v["priced_by"]["from"], "table");
    assert_eq!(v["priced_by"]["model_id"], "claude-sonnet-4-5");
}
