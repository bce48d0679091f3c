//! What search reads of a step, and how text is compared: one function for both backends, so the same query
//! finds the same steps in SQLite and PostgreSQL.
//!
//! Matching is by substring of folded text: Unicode NFC, lower case, whitespace runs as one space. Folding happens
//! here, in Rust, for the indexed text and the query alike (the databases only compare bytes): SQLite's trigram
//! tokenizer and PostgreSQL's `lower()` fold case differently outside ASCII (PostgreSQL in the C locale not at
//! all), which would make the two stores answer differently. Accents are kept: `café` finds `Café`, not `cafe`.

use std::ops::Range;

use unicode_normalization::UnicodeNormalization;

use crate::model::step::{Step, StepRole};

/// The most characters of one field (a prompt, an output, one tool call's arguments, one tool result) that are
/// indexed: tool results are often whole files, and the index grows with what it holds.
pub const FIELD_CHARS: usize = 2_048;
/// The most characters indexed per step, all fields together.
pub const STEP_CHARS: usize = 8_192;
/// Terms per query, and characters per term.
pub const MAX_TERMS: usize = 8;
pub const MAX_TERM_CHARS: usize = 200;

/// Which part of a step a hit is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Field {
    Prompt,
    Output,
    Reasoning,
    ToolCall,
    ToolResult,
    Error,
}

/// The searchable text of a step, field by field, each cut to [`FIELD_CHARS`] and all to [`STEP_CHARS`].
pub fn fields(step: &Step) -> Vec<(Field, String)> {
    let mut out: Vec<(Field, String)> = Vec::new();
    let mut left = STEP_CHARS;
    let mut push = |field: Field, text: &str| {
        let n = left.min(FIELD_CHARS);
        if n == 0 || text.trim().is_empty() {
            return;
        }
        let cut: String = text.chars().take(n).collect();
        left -= cut.chars().count();
        out.push((field, cut));
    };
    if let Some(c) = &step.content {
        let field = if step.role == StepRole::Agent {
            Field::Output
        } else {
            Field::Prompt
        };
        push(field, c);
    }
    if let Some(r) = &step.reasoning_content {
        push(Field::Reasoning, r);
    }
    for tc in &step.tool_calls {
        let args = match &tc.input {
            serde_json::Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        push(Field::ToolCall, &format!("{} {args}", tc.tool_name));
    }
    for o in &step.observations {
        if let Some(t) = o.content.as_deref().or(o.output_summary.as_deref()) {
            push(Field::ToolResult, t);
        }
    }
    if let Some(e) = &step.error {
        push(Field::Error, e);
    }
    out
}

/// The text the index holds for a step: its fields folded, one per line.
pub fn indexed_text(step: &Step) -> String {
    let mut out = String::new();
    for (_, text) in fields(step) {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&fold(text.as_str()).0);
    }
    out
}

/// Whether a step is one the "errors only" filter keeps: its call failed, or a tool result is flagged an error.
pub fn has_error(step: &Step) -> bool {
    step.status != "ok" || step.error.is_some() || step.observations.iter().any(|o| o.error.is_some())
}

/// `text` folded (see the module), and for each byte of the folded text the char index in `text`'s NFC form it
/// came from, with that NFC form as chars: what a snippet is cut from.
fn fold(text: &str) -> (String, Vec<usize>, Vec<char>) {
    let original: Vec<char> = text.nfc().collect();
    let mut out = String::with_capacity(text.len());
    let mut origin = Vec::with_capacity(text.len());
    let mut in_space = false;
    for (i, &c) in original.iter().enumerate() {
        if c.is_whitespace() {
            if !in_space {
                out.push(' ');
                origin.push(i);
            }
            in_space = true;
            continue;
        }
        in_space = false;
        for l in c.to_lowercase() {
            let before = out.len();
            out.push(l);
            origin.extend(std::iter::repeat_n(i, out.len() - before));
        }
    }
    (out, origin, original)
}

/// A query's terms: words, or "quoted phrases", folded. Every term must occur in a step for it to match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terms(Vec<String>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TermsError {
    #[error("the search text is empty")]
    Empty,
    #[error("at most {MAX_TERMS} search terms")]
    TooMany,
    #[error("a search term is longer than {MAX_TERM_CHARS} characters")]
    TooLong,
}

impl Terms {
    pub fn parse(q: &str) -> Result<Terms, TermsError> {
        let mut terms = Vec::new();
        for (i, part) in q.split('"').enumerate() {
            // Odd parts were inside quotes: one term each; the rest split on whitespace.
            let pieces: Vec<&str> = if i % 2 == 1 {
                vec![part]
            } else {
                part.split_whitespace().collect()
            };
            for p in pieces {
                let folded = fold(p.trim()).0;
                let folded = folded.trim();
                if folded.is_empty() {
                    continue;
                }
                if folded.chars().count() > MAX_TERM_CHARS {
                    return Err(TermsError::TooLong);
                }
                if !terms.iter().any(|t| t == folded) {
                    terms.push(folded.to_owned());
                }
            }
        }
        if terms.is_empty() {
            return Err(TermsError::Empty);
        }
        if terms.len() > MAX_TERMS {
            return Err(TermsError::TooMany);
        }
        Ok(Terms(terms))
    }

    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    /// Whether folded `text` holds every term.
    pub fn all_in(&self, text: &str) -> bool {
        self.0.iter().all(|t| text.contains(t.as_str()))
    }
}

/// A piece of a snippet: plain text, or text a term matched.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Piece {
    pub text: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub hit: bool,
}

/// Characters of context around the first match.
const CONTEXT_CHARS: usize = 80;

/// Where a step matches: the first field holding a term (the longest term first, it says the most), and that
/// field's text around the match with every term occurrence marked. Text, never markup: the viewer renders the
/// pieces as text nodes.
pub fn snippet(step: &Step, terms: &Terms) -> Option<(Field, Vec<Piece>)> {
    let mut by_length: Vec<&String> = terms.0.iter().collect();
    by_length.sort_by_key(|t| std::cmp::Reverse(t.len()));
    let fields = fields(step);
    let folded: Vec<_> = fields.iter().map(|(_, t)| fold(t)).collect();
    let (field, (text, origin, chars), at) = by_length.iter().find_map(|term| {
        fields
            .iter()
            .zip(&folded)
            .find_map(|((f, _), fo)| fo.0.find(term.as_str()).map(|at| (*f, fo, at)))
    })?;
    // Char ranges of the original (NFC) text that some term matched.
    let mut marks: Vec<Range<usize>> = Vec::new();
    for term in &terms.0 {
        for (start, m) in text.match_indices(term.as_str()) {
            let end = start + m.len();
            marks.push(origin[start]..origin[end - 1] + 1);
        }
    }
    marks.sort_by_key(|r| r.start);
    let first = origin[at];
    let from = first.saturating_sub(CONTEXT_CHARS);
    let to = (first + CONTEXT_CHARS * 2).min(chars.len());
    let mut pieces = Vec::new();
    let mut at = from;
    let plain = |a: usize, b: usize| chars[a..b].iter().collect::<String>();
    if from > 0 {
        pieces.push(Piece {
            text: "…".into(),
            hit: false,
        });
    }
    for m in marks {
        let (s, e) = (m.start.max(at), m.end.min(to));
        if s >= e {
            continue;
        }
        if s > at {
            pieces.push(Piece {
                text: plain(at, s),
                hit: false,
            });
        }
        pieces.push(Piece {
            text: plain(s, e),
            hit: true,
        });
        at = e;
    }
    if at < to {
        pieces.push(Piece {
            text: plain(at, to),
            hit: false,
        });
    }
    if to < chars.len() {
        pieces.push(Piece {
            text: "…".into(),
            hit: false,
        });
    }
    Some((field, pieces))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(content: &str, result: &str) -> Step {
        let mut s: Step = serde_json::from_value(serde_json::json!({
            "step_id": "t/1", "trajectory_id": "t", "step_index": 1, "role": "agent", "content": content,
            "reasoning_content": null, "model": "m", "system_prompt_hash": null, "agent_role": null,
            "parent_step": null, "call_type": null, "tools_available": [], "tool_calls": [
                {"tool_call_id": "c1", "tool_name": "read_file", "input": {"path": "src/main.rs"}}],
            "observations": [], "snippets": [], "token_usage": serde_json::to_value(
                crate::model::step::TokenUsage::default()).unwrap_or_else(|e| panic!("{e}")), "timestamp": "2026-01-01T00:00:00Z",
            "status": "ok"
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        s.observations.push(crate::model::step::Observation {
            source_call_id: "c1".into(),
            content: Some(result.into()),
            output_summary: None,
            error: None,
        });
        s
    }

    #[test]
    fn folding_ignores_case_and_whitespace_runs_and_keeps_accents() {
        assert_eq!(fold("Café  AU\n\tLait").0, "café au lait");
        // NFD input folds to the same text as NFC.
        assert_eq!(fold("Cafe\u{301}").0, fold("Café").0);
        assert_eq!(fold("東京タワー").0, "東京タワー");
        let t = Terms::parse("  \"Au  Lait\" CAFÉ x").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.as_slice(), ["au lait", "café", "x"]);
        assert!(t.all_in(&indexed_text(&step("un café au lait, x", ""))));
        assert!(!t.all_in(&indexed_text(&step("un cafe au lait, x", ""))));
        assert_eq!(Terms::parse(" \"\" "), Err(TermsError::Empty));
    }

    #[test]
    fn a_snippet_marks_every_term_in_the_field_of_the_first_match_and_keeps_the_original_text() {
        let s = step(
            "Reading the file.",
            "fn main() {\n    println!(\"Grüße aus 東京タワー\");\n}",
        );
        let t = Terms::parse("GRÜSSE 東京 \"grüße aus\"").unwrap_or_else(|e| panic!("{e}"));
        let (field, pieces) = snippet(&s, &t).unwrap_or_else(|| panic!("a match"));
        assert_eq!(field, Field::ToolResult);
        let hits: Vec<&str> = pieces.iter().filter(|p| p.hit).map(|p| p.text.as_str()).collect();
        // "grüsse" is not in the text ("ß" lowercases to itself); the phrase and the CJK word are.
        assert_eq!(hits, ["Grüße aus", "東京"]);
        let whole: String = pieces.iter().map(|p| p.text.as_str()).collect();
        assert!(whole.contains("println!(\"Grüße aus 東京タワー\")"), "{whole}");
        assert_eq!(
            snippet(&s, &Terms::parse("absent").unwrap_or_else(|e| panic!("{e}"))),
            None
        );
        // Tool arguments are searchable too.
        let (field, _) = snippet(&s, &Terms::parse("src/main.rs").unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|| panic!("a match"));
        assert_eq!(field, Field::ToolCall);
    }

    #[test]
    fn fields_are_capped() {
        let long = "x".repeat(FIELD_CHARS * 10);
        let mut s = step(&long, &long);
        for _ in 0..10 {
            s.observations.push(s.observations[0].clone());
        }
        let f = fields(&s);
        assert!(f.iter().all(|(_, t)| t.chars().count() <= FIELD_CHARS));
        assert_eq!(f.iter().map(|(_, t)| t.chars().count()).sum::<usize>(), STEP_CHARS);
    }
}
