//! Server-sent events framing (WHATWG HTML §9.2), shared by every adapter.
//!
//! Handles `\n`, `\r\n` and `\r` line ends, comment lines (`: keep-alive`), multi-line `data:`, fields without
//! a space after the colon, and a final event with no trailing blank line (a truncated stream).

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field; None means the default type "message".
    pub event: Option<String>,
    pub data: String,
    pub id: Option<String>,
}

/// Split a whole captured stream into events. Events with neither data nor a type are skipped.
pub fn parse_events(text: &str) -> Vec<SseEvent> {
    let mut events = Vec::new();
    let mut cur = SseEvent::default();
    let mut has_data = false;
    let dispatch = |cur: &mut SseEvent, has_data: &mut bool, events: &mut Vec<SseEvent>| {
        if *has_data || cur.event.is_some() {
            events.push(std::mem::take(cur));
        } else {
            *cur = SseEvent::default();
        }
        *has_data = false;
    };
    for line in lines(text) {
        if line.is_empty() {
            dispatch(&mut cur, &mut has_data, &mut events);
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.find(':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (line, ""),
        };
        match field {
            "data" => {
                if has_data {
                    cur.data.push('\n');
                }
                cur.data.push_str(value);
                has_data = true;
            }
            "event" => cur.event = Some(value.to_owned()),
            "id" => cur.id = Some(value.to_owned()),
            _ => {}
        }
    }
    dispatch(&mut cur, &mut has_data, &mut events);
    events
}

/// Lines split on `\r\n`, `\n` or `\r`.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        match rest.find(['\r', '\n']) {
            Some(i) => {
                let line = &rest[..i];
                let skip = if rest[i..].starts_with("\r\n") { 2 } else { 1 };
                rest = &rest[i + skip..];
                Some(line)
            }
            None => {
                let line = rest;
                rest = "";
                Some(line)
            }
        }
    })
}

/// Does this body look like an SSE stream (used when the content-type is missing or wrong)?
pub fn looks_like_sse(text: &str) -> bool {
    let t = text.trim_start();
    t.starts_with("data:") || t.starts_with("event:") || t.starts_with(':')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_variants() {
        let text = ": comment\r\n\r\nevent: message_start\r\ndata: {\"a\":1}\r\n\r\ndata:x\ndata: y\n\ndata: [DONE]";
        let ev = parse_events(text);
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[0].event.as_deref(), Some("message_start"));
        assert_eq!(ev[0].data, "{\"a\":1}");
        assert_eq!(ev[1].data, "x\ny");
        assert_eq!(ev[2].data, "[DONE]");
    }

    #[test]
    fn bare_cr_line_ends() {
        let ev = parse_events("data: 1\r\rdata: 2\r\r");
        assert_eq!(ev.iter().map(|e| e.data.as_str()).collect::<Vec<_>>(), ["1", "2"]);
    }
}
