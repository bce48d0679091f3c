//! What in a user turn is the person's own text and what the client injected around it, and the title of a
//! conversation.
//!
//! Agents add context to the user's turns in tagged blocks: Claude Code's `<system-reminder>` (CLAUDE.md, the
//! date, todo and file-change reminders) and hook and local-command output, Codex CLI's `<user_instructions>`
//! and `<environment_context>`. A title or a one-line preview of such a turn should be the person's words, and a
//! reader wants the injected pages folded. The tags are what the clients send; nothing else marks the blocks.
//!
//! Titles: a client that asks the model for one (Claude Code's title call, answered as `{"title": …}`; earlier
//! releases' topic detection, `{"isNewTopic": …, "title": …}`) names its session; otherwise the first user text
//! without injected context does.

use serde::Serialize;

/// Tags whose blocks the client injects into user turns.
const INJECTED_TAGS: &[&str] = &[
    "system-reminder",
    "user-prompt-submit-hook",
    "local-command-stdout",
    "local-command-stderr",
    "local-command-caveat",
    "ide_opened_file",
    "ide_selection",
    "user_instructions",
    "environment_context",
];

/// A title or preview is cut at this many characters (with `…`).
pub const TITLE_CHARS: usize = 100;

/// A piece of a user turn's text, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Segment {
    /// The tag of an injected block (`system-reminder`, ...); None for the person's own text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub injected: Option<&'static str>,
    /// For an injected block: a one-line description of what it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    pub text: String,
}

/// `text` split into the person's text and injected blocks (the block's text is its whole `<tag>…</tag>`). A
/// block without its closing tag is text: only what the client closed is folded. Whitespace-only pieces between
/// blocks are dropped.
pub fn segments(text: &str) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some((start, tag)) = next_open_tag(rest) {
        let close = format!("</{tag}>");
        let Some(end) = rest[start..].find(&close).map(|e| start + e + close.len()) else {
            break;
        };
        push_text(&mut out, &rest[..start]);
        let block = &rest[start..end];
        out.push(Segment {
            injected: Some(tag),
            summary: Some(describe(tag, block)),
            text: block.to_owned(),
        });
        rest = &rest[end..];
    }
    push_text(&mut out, rest);
    out
}

/// Whether `text` holds any injected block.
pub fn has_injected(text: &str) -> bool {
    segments(text).iter().any(|s| s.injected.is_some())
}

/// The person's text: `text` without injected blocks, trimmed.
pub fn user_text(text: &str) -> String {
    let parts: Vec<String> = segments(text)
        .into_iter()
        .filter(|s| s.injected.is_none())
        .map(|s| s.text.trim().to_owned())
        .collect();
    parts.join("\n").trim().to_owned()
}

/// A title from the first user text of a conversation: the person's words on one line, cut at [`TITLE_CHARS`].
pub fn title_from_user_text(text: &str) -> Option<String> {
    one_line(&user_text(text))
}

/// The title a title call answered: `{"title": …}` (JSON, possibly in a code fence), a topic detection's
/// `{"isNewTopic": true, "title": …}` (None when it says there is no new topic), else the answer's first line
/// without surrounding quotes.
pub fn title_from_answer(answer: &str) -> Option<String> {
    let trimmed = answer.trim();
    let unfenced = trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|t| t.strip_suffix("```"))
        .unwrap_or(trimmed)
        .trim();
    if unfenced.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(unfenced).ok()?;
        if v.get("isNewTopic").and_then(serde_json::Value::as_bool) == Some(false) {
            return None;
        }
        return v.get("title").and_then(serde_json::Value::as_str).and_then(one_line);
    }
    let first = unfenced.lines().find(|l| !l.trim().is_empty())?.trim();
    let unquoted = first
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(first);
    one_line(unquoted)
}

/// Whitespace collapsed to single spaces, cut at [`TITLE_CHARS`]; None when empty.
fn one_line(text: &str) -> Option<String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.is_empty() {
        return None;
    }
    let line = words.join(" ");
    if line.chars().count() <= TITLE_CHARS {
        return Some(line);
    }
    let mut cut: String = line.chars().take(TITLE_CHARS - 1).collect();
    cut.push('…');
    Some(cut)
}

fn push_text(out: &mut Vec<Segment>, text: &str) {
    if !text.trim().is_empty() {
        out.push(Segment {
            injected: None,
            summary: None,
            text: text.to_owned(),
        });
    }
}

/// The earliest opening tag of an injected block in `text`: its byte offset and the tag.
fn next_open_tag(text: &str) -> Option<(usize, &'static str)> {
    INJECTED_TAGS
        .iter()
        .filter_map(|tag| find_open_tag(text, tag).map(|at| (at, *tag)))
        .min_by_key(|(at, _)| *at)
}

/// `<tag>` or `<tag attr…>` (Codex and IDE tags carry none, but a client may add attributes).
fn find_open_tag(text: &str, tag: &str) -> Option<usize> {
    let needle = format!("<{tag}");
    let mut from = 0;
    while let Some(i) = text[from..].find(&needle) {
        let at = from + i;
        match text[at + needle.len()..].chars().next() {
            Some('>') | Some(' ') | Some('\n') => return Some(at),
            _ => from = at + needle.len(),
        }
    }
    None
}

/// What an injected block holds, in a line: its kind, what it names, and its size.
fn describe(tag: &str, block: &str) -> String {
    let inner_start = block.find('>').map_or(0, |i| i + 1);
    let inner_end = block.rfind("</").unwrap_or(block.len()).max(inner_start);
    let inner = &block[inner_start..inner_end];
    let what = if inner.contains("# claudeMd") || inner.contains("CLAUDE.md") {
        "CLAUDE.md and project context".to_owned()
    } else {
        match inner.lines().map(str::trim).find(|l| !l.is_empty()) {
            Some(first) => {
                let mut s: String = first.chars().take(80).collect();
                if first.chars().count() > 80 {
                    s.push('…');
                }
                s
            }
            None => "empty".to_owned(),
        }
    };
    let lines = match inner.trim().lines().count() {
        1 => "1 line".to_owned(),
        n => format!("{n} lines"),
    };
    format!("{tag}: {what} ({lines}, {} chars)", inner.trim().chars().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first user message of a Claude Code session as it reaches the provider: the CLAUDE.md context and a
    /// reminder as injected blocks, then what the person typed.
    const CLAUDE_FIRST_USER: &str = "<system-reminder>\nAs you answer the user's questions, you can use the \
        following context:\n# claudeMd\nCodebase and user instructions are shown below.\n\nContents of \
        /repo/CLAUDE.md:\nUse cargo nextest.\n</system-reminder>\n<system-reminder>\nThe date is 2026-11-27.\n\
        </system-reminder>\nFix the flaky parser test in   src/parse.rs\nand run it";

    #[test]
    fn injected_blocks_are_split_from_the_persons_text_and_described() {
        let s = segments(CLAUDE_FIRST_USER);
        assert_eq!(s.len(), 3, "{s:#?}");
        assert_eq!(s[0].injected, Some("system-reminder"));
        assert!(s[0].text.starts_with("<system-reminder>") && s[0].text.ends_with("</system-reminder>"));
        assert_eq!(
            s[0].summary.as_deref(),
            Some("system-reminder: CLAUDE.md and project context (6 lines, 178 chars)")
        );
        assert_eq!(
            s[1].summary.as_deref(),
            Some("system-reminder: The date is 2026-11-27. (1 line, 23 chars)")
        );
        assert_eq!(s[2].injected, None);
        assert_eq!(
            user_text(CLAUDE_FIRST_USER),
            "Fix the flaky parser test in   src/parse.rs\nand run it"
        );
        // Nothing is lost: the pieces are the text, less whitespace between blocks.
        let joined: String = s.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(joined.replace('\n', ""), CLAUDE_FIRST_USER.replace('\n', ""));
    }

    #[test]
    fn codex_context_turns_and_unclosed_tags_and_lookalike_tags() {
        let codex = "<user_instructions>\nAGENTS.md says: be brief\n</user_instructions>";
        assert_eq!(user_text(codex), "");
        assert_eq!(title_from_user_text(codex), None);
        let env = "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>\nlist files";
        assert_eq!(user_text(env), "list files");
        // Not closed: the person's text (someone pasting a tag), kept whole.
        let open = "what does <system-reminder> mean";
        assert_eq!(segments(open).len(), 1);
        assert_eq!(user_text(open), open);
        // A longer tag name sharing the prefix is not the tag.
        let other = "<system-reminders>x</system-reminders> y";
        assert!(!has_injected(other));
        assert!(has_injected(CLAUDE_FIRST_USER));
    }

    #[test]
    fn titles_from_the_first_user_text_are_one_line_and_cut() {
        assert_eq!(
            title_from_user_text(CLAUDE_FIRST_USER).as_deref(),
            Some("Fix the flaky parser test in src/parse.rs and run it")
        );
        let long = "word ".repeat(60);
        let t = title_from_user_text(&long).unwrap();
        assert_eq!(t.chars().count(), TITLE_CHARS);
        assert!(t.ends_with('…'));
        // Non-ASCII text is cut on character boundaries.
        let korean = "결제 모듈 리팩토링 ".repeat(20);
        assert!(title_from_user_text(&korean).unwrap().ends_with('…'));
        assert_eq!(title_from_user_text("  \n "), None);
    }

    #[test]
    fn titles_from_a_title_calls_answer() {
        assert_eq!(
            title_from_answer("{\"title\": \"Fix login button on mobile\"}").as_deref(),
            Some("Fix login button on mobile")
        );
        assert_eq!(
            title_from_answer("```json\n{\"title\": \"Add OAuth\"}\n```").as_deref(),
            Some("Add OAuth")
        );
        assert_eq!(
            title_from_answer("{\"isNewTopic\": true, \"title\": \"Parser fix\"}").as_deref(),
            Some("Parser fix")
        );
        assert_eq!(title_from_answer("{\"isNewTopic\": false, \"title\": null}"), None);
        assert_eq!(title_from_answer("{\"title\": 3}"), None);
        assert_eq!(title_from_answer("{not json"), None);
        assert_eq!(
            title_from_answer("\n\"Debug failing CI tests\"\nextra").as_deref(),
            Some("Debug failing CI tests")
        );
        assert_eq!(title_from_answer(""), None);
    }
}
