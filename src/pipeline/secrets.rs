//! Credentials users put in request bodies (`{"api_key": "..."}`, an OAuth `client_secret` passed through):
//! the stored copy of a request has the string values of members whose names are secret (the same rule as
//! headers, see [`crate::proxy::redact::is_secret_json_member`]) replaced.
//!
//! Runs on the pipeline thread and, for exchanges routed to the disk spill, on the spill thread before the
//! write (`capture::spill::redact`), never the data path. It scans the JSON text rather than parsing it into a
//! `Value`: a request repeats the whole conversation, and a parse + re-serialization per exchange would copy
//! all of it to find, almost always, nothing. The scan only stops at quotes (memchr), copies nothing when no
//! member matches, and keeps the text byte-for-byte otherwise except the redacted values.
//!
//! Only string values are replaced (`max_tokens` matches the rule but is a number); a member whose name is
//! written with `\u` escapes is judged as written.

use memchr::{memchr, memchr2};

use crate::proxy::redact::{REDACTED, is_secret_json_member};

/// A value as [`REDACTED`] writes it.
const ALREADY_REDACTED: &[u8] = b"\"REDACTED\"";

/// `text` (valid JSON) with secret member values replaced, or None when there is nothing to replace (a value
/// already `"REDACTED"` included).
pub fn redact_json(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while let Some(at) = memchr(b'"', &b[i..]) {
        let start = i + at;
        let end = string_end(b, start);
        let colon = skip_ws(b, end);
        if b.get(colon) != Some(&b':') {
            // A string value (or a key we are past): not a member name.
            i = end;
            continue;
        }
        let value = skip_ws(b, colon + 1);
        if b.get(value) == Some(&b'"') && is_secret_json_member(&b[start + 1..end.saturating_sub(1)]) {
            let value_end = string_end(b, value);
            // Already redacted (the spill redacts what it writes to disk): nothing to copy for it.
            if &b[value..value_end] != ALREADY_REDACTED {
                spans.push((value, value_end));
            }
            i = value_end;
        } else {
            i = colon + 1;
        }
    }
    if spans.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    for (start, end) in spans {
        out.push_str(&text[from..start]);
        out.push('"');
        out.push_str(REDACTED);
        out.push('"');
        from = end;
    }
    out.push_str(&text[from..]);
    Some(out)
}

/// The index just past the closing quote of the string that opens at `open`.
fn string_end(b: &[u8], open: usize) -> usize {
    let mut i = open + 1;
    while let Some(at) = memchr2(b'"', b'\\', &b[i.min(b.len())..]) {
        let at = i + at;
        if b[at] == b'\\' {
            i = at + 2;
        } else {
            return at + 1;
        }
    }
    b.len()
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(|c| c.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_string_members_are_replaced_anywhere_and_nothing_else_changes() {
        let text = r#"{"model":"gpt-4o","api_key":"sk-live","max_tokens":5,"metadata":{"client_secret" : "s\"x","note":"api_key"},"messages":[{"role":"user","content":"my \"password\": hunter2"}],"signature":"EqA"}"#;
        let out = redact_json(text).unwrap();
        assert_eq!(
            out,
            r#"{"model":"gpt-4o","api_key":"REDACTED","max_tokens":5,"metadata":{"client_secret" : "REDACTED","note":"api_key"},"messages":[{"role":"user","content":"my \"password\": hunter2"}],"signature":"EqA"}"#
        );
        assert!(serde_json::from_str::<serde_json::Value>(&out).is_ok());
    }

    #[test]
    fn nothing_to_redact_copies_nothing() {
        assert_eq!(redact_json(r#"{"model":"m","max_tokens":1,"messages":[]}"#), None);
        assert_eq!(redact_json(r#""key""#), None);
        assert_eq!(redact_json("null"), None);
        assert_eq!(
            redact_json(r#"{"api_key":"REDACTED","model":"m"}"#),
            None,
            "redacted by the spill already"
        );
    }
}
