//! genai-prices' match clauses (`equals`, `starts_with`, `ends_with`, `contains`, `regex`, `or`, `and`), checked
//! when the table is loaded. A regex is compiled again, and kept, the first time a lookup reaches it: the table
//! has 73 of them and a lookup reaches the few of its provider, while all 73 compiled took ~10 MiB of llmtap's
//! idle memory.
//!
//! Semantics follow genai-prices: the model reference is lowercased before matching; the string clauses compare
//! case-insensitively; a regex runs unanchored (`re.search`) against the lowercased reference, with its pattern
//! as written. Some patterns use look-ahead (`^(?![^/]+/)...`), which the `regex` crate refuses, hence
//! `fancy-regex`.

use serde::Deserialize;

/// One clause as data/prices.json spells it: `{"equals": "gpt-4o"}`, `{"or": [...]}`, ...
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum RawClause {
    Equals(String),
    StartsWith(String),
    EndsWith(String),
    Contains(String),
    Regex(String),
    Or(Vec<RawClause>),
    And(Vec<RawClause>),
}

#[derive(Debug, thiserror::Error)]
#[error("match clause regex {pattern:?} does not compile: {source}")]
pub struct MatcherError {
    pattern: String,
    #[source]
    source: Box<fancy_regex::Error>,
}

/// A compiled clause. String operands are stored lowercased so matching does no per-call allocation.
#[derive(Debug, Deserialize)]
#[serde(try_from = "RawClause")]
pub enum Matcher {
    Equals(String),
    StartsWith(String),
    EndsWith(String),
    Contains(String),
    Regex(Box<LazyRegex>),
    Or(Vec<Matcher>),
    And(Vec<Matcher>),
}

impl TryFrom<RawClause> for Matcher {
    type Error = MatcherError;

    fn try_from(raw: RawClause) -> Result<Self, Self::Error> {
        Ok(match raw {
            RawClause::Equals(s) => Matcher::Equals(s.to_lowercase()),
            RawClause::StartsWith(s) => Matcher::StartsWith(s.to_lowercase()),
            RawClause::EndsWith(s) => Matcher::EndsWith(s.to_lowercase()),
            RawClause::Contains(s) => Matcher::Contains(s.to_lowercase()),
            RawClause::Regex(pattern) => match fancy_regex::Regex::new(&pattern) {
                // Checked, then dropped: compiled again on first use.
                Ok(_) => Matcher::Regex(Box::new(LazyRegex {
                    pattern,
                    compiled: std::sync::OnceLock::new(),
                })),
                Err(e) => {
                    return Err(MatcherError {
                        pattern,
                        source: Box::new(e),
                    });
                }
            },
            RawClause::Or(list) => Matcher::Or(compile_all(list)?),
            RawClause::And(list) => Matcher::And(compile_all(list)?),
        })
    }
}

/// A regex clause: its pattern (known to compile), compiled on first use.
#[derive(Debug)]
pub struct LazyRegex {
    pattern: String,
    compiled: std::sync::OnceLock<Option<fancy_regex::Regex>>,
}

impl LazyRegex {
    fn get(&self) -> Option<&fancy_regex::Regex> {
        self.compiled
            .get_or_init(|| fancy_regex::Regex::new(&self.pattern).ok())
            .as_ref()
    }
}

fn compile_all(list: Vec<RawClause>) -> Result<Vec<Matcher>, MatcherError> {
    list.into_iter().map(Matcher::try_from).collect()
}

impl Matcher {
    /// `lowered` must already be lowercased (callers lowercase the model reference once per lookup).
    pub fn is_match(&self, lowered: &str) -> bool {
        match self {
            Matcher::Equals(s) => lowered == s,
            Matcher::StartsWith(s) => lowered.starts_with(s.as_str()),
            Matcher::EndsWith(s) => lowered.ends_with(s.as_str()),
            Matcher::Contains(s) => lowered.contains(s.as_str()),
            // A regex that hits fancy-regex's backtracking limit is treated as "no match": an unpriced call
            // is reported unknown, which is the safe side.
            Matcher::Regex(re) => re.get().is_some_and(|re| re.is_match(lowered).unwrap_or(false)),
            Matcher::Or(list) => list.iter().any(|m| m.is_match(lowered)),
            Matcher::And(list) => list.iter().all(|m| m.is_match(lowered)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(json: &str) -> Matcher {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn string_clauses_ignore_the_operands_case() {
        assert!(m(r#"{"equals": "GPT-4o"}"#).is_match("gpt-4o"));
        assert!(!m(r#"{"equals": "gpt-4o"}"#).is_match("gpt-4o-mini"));
        assert!(m(r#"{"starts_with": "MiniMax-M"}"#).is_match("minimax-m2"));
        assert!(m(r#"{"ends_with": "-Latest"}"#).is_match("claude-3-7-sonnet-latest"));
        assert!(m(r#"{"contains": "sonnet"}"#).is_match("claude-3-7-sonnet-latest"));
        assert!(!m(r#"{"contains": "opus"}"#).is_match("claude-3-7-sonnet-latest"));
    }

    #[test]
    fn regex_is_unanchored_and_supports_look_ahead() {
        assert!(m(r#"{"regex": "o[134]"}"#).is_match("gpt-o3-x"));
        let mistral = m(r#"{"regex": "^(?![^/]+/)(?:labs-)?mistral"}"#);
        assert!(mistral.is_match("mistral-large-latest"));
        assert!(!mistral.is_match("openrouter/mistral-large"));
    }

    #[test]
    fn or_and_combine() {
        let c = m(r#"{"and": [{"starts_with": "gpt-4o"}, {"or": [{"contains": "mini"}, {"ends_with": "-08-06"}]}]}"#);
        assert!(c.is_match("gpt-4o-mini"));
        assert!(c.is_match("gpt-4o-2024-08-06"));
        assert!(!c.is_match("gpt-4o-2024-05-13"));
    }

    #[test]
    fn a_bad_regex_is_an_error_naming_the_pattern() {
        let e = serde_json::from_str::<Matcher>(r#"{"regex": "(unclosed"}"#).unwrap_err();
        assert!(e.to_string().contains("(unclosed"), "{e}");
    }

    #[test]
    fn an_unknown_clause_is_an_error() {
        assert!(serde_json::from_str::<Matcher>(r#"{"like": "gpt%"}"#).is_err());
    }
}
