//! The AWS event-stream framing (`application/vnd.amazon.eventstream`) that Bedrock's streaming endpoints
//! answer in, decoded from a whole captured body into the events the adapters reassemble.
//!
//! A message is: a prelude (total length u32, headers length u32, CRC-32 of those 8 bytes), the headers
//! (name length u8, name, value type u8, value), the payload, and a CRC-32 of everything before it. All
//! integers are big-endian. Headers name the event (`:message-type` = `event` | `exception` | `error`,
//! `:event-type`, `:exception-type`, `:error-code`, `:error-message`, `:content-type`).
//!
//! Written here rather than taken from `aws-smithy-eventstream`: that crate needs `aws-smithy-types` (the SDK's
//! runtime types, with their own `http`/`time` dependency tree and a 0.x API that breaks with the SDK), while
//! the format is a dozen lines of arithmetic over a buffer the pipeline already holds whole. `crc32fast` does
//! the checksums (the same CRC-32 as zlib's).
//!
//! Bad input never stops the trace: decoding keeps every message before the damage and says what went wrong.
//! A message whose prelude checks but whose message CRC does not is skipped (its length is trustworthy, so
//! the next message is found); a bad prelude CRC or a cut message ends decoding.

use base64::Engine;
use serde_json::{Value, json};

use crate::capture::sse::SseEvent;

/// Prelude (12) + message CRC (4): the smallest message, one with no headers and no payload.
const MIN_MESSAGE: usize = 16;
/// The largest message the service sends is 16 MiB payload + 128 KiB headers; anything claiming more is
/// not event-stream framing.
const MAX_MESSAGE: usize = 16 * 1024 * 1024 + 128 * 1024 + MIN_MESSAGE;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventStreamError {
    #[error("event stream cut at byte {offset}: a message needs {needed} bytes, {available} remain")]
    Truncated {
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error(
        "event stream message at byte {offset}: prelude CRC mismatch (stated {stated:#010x}, computed {computed:#010x})"
    )]
    PreludeCrc { offset: usize, stated: u32, computed: u32 },
    #[error(
        "event stream message at byte {offset}: message CRC mismatch (stated {stated:#010x}, computed {computed:#010x})"
    )]
    MessageCrc { offset: usize, stated: u32, computed: u32 },
    #[error("event stream message at byte {offset}: impossible lengths (total {total}, headers {headers})")]
    Lengths {
        offset: usize,
        total: usize,
        headers: usize,
    },
    #[error("event stream message at byte {offset}: malformed headers ({what})")]
    Headers { offset: usize, what: &'static str },
}

/// One decoded message: its string headers (other header types are skipped) and its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    pub headers: Vec<(&'a str, &'a str)>,
    pub payload: &'a [u8],
}

impl Message<'_> {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }
}

/// Every message of a captured body, and the damage that ended or interrupted decoding (the first of it).
pub fn decode(buf: &[u8]) -> (Vec<Message<'_>>, Option<EventStreamError>) {
    let mut out = Vec::new();
    let mut first_error = None;
    let mut offset = 0;
    while offset < buf.len() {
        match message_at(buf, offset) {
            Ok((message, next)) => {
                out.push(message);
                offset = next;
            }
            Err(Damage::Skip(e, next)) => {
                first_error.get_or_insert(e);
                offset = next;
            }
            Err(Damage::Stop(e)) => {
                first_error.get_or_insert(e);
                break;
            }
        }
    }
    (out, first_error)
}

enum Damage {
    /// The message is unreadable but its length is known: go on after it.
    Skip(EventStreamError, usize),
    Stop(EventStreamError),
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn message_at(buf: &[u8], offset: usize) -> Result<(Message<'_>, usize), Damage> {
    let rest = &buf[offset..];
    if rest.len() < 12 {
        return Err(Damage::Stop(EventStreamError::Truncated {
            offset,
            needed: MIN_MESSAGE,
            available: rest.len(),
        }));
    }
    let total = be32(rest, 0) as usize;
    let headers_len = be32(rest, 4) as usize;
    let stated = be32(rest, 8);
    let computed = crc32fast::hash(&rest[..8]);
    if stated != computed {
        return Err(Damage::Stop(EventStreamError::PreludeCrc {
            offset,
            stated,
            computed,
        }));
    }
    if !(MIN_MESSAGE..=MAX_MESSAGE).contains(&total) || headers_len > total - MIN_MESSAGE {
        return Err(Damage::Stop(EventStreamError::Lengths {
            offset,
            total,
            headers: headers_len,
        }));
    }
    if rest.len() < total {
        return Err(Damage::Stop(EventStreamError::Truncated {
            offset,
            needed: total,
            available: rest.len(),
        }));
    }
    let next = offset + total;
    let stated = be32(rest, total - 4);
    let computed = crc32fast::hash(&rest[..total - 4]);
    if stated != computed {
        return Err(Damage::Skip(
            EventStreamError::MessageCrc {
                offset,
                stated,
                computed,
            },
            next,
        ));
    }
    let headers = headers(&rest[12..12 + headers_len])
        .map_err(|what| Damage::Skip(EventStreamError::Headers { offset, what }, next))?;
    Ok((
        Message {
            headers,
            payload: &rest[12 + headers_len..total - 4],
        },
        next,
    ))
}

/// Header values by type byte: 0/1 bool (no bytes), 2 byte, 3 short, 4 int, 5 long, 6 bytes and 7 string
/// (u16 length first), 8 timestamp (8 bytes), 9 uuid (16 bytes).
fn headers(mut b: &[u8]) -> Result<Vec<(&str, &str)>, &'static str> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let name_len = usize::from(b[0]);
        let name = b.get(1..1 + name_len).ok_or("name past the end")?;
        let name = std::str::from_utf8(name).map_err(|_| "name is not UTF-8")?;
        let kind = *b.get(1 + name_len).ok_or("no value type")?;
        b = &b[2 + name_len..];
        let fixed = match kind {
            0 | 1 => Some(0),
            2 => Some(1),
            3 => Some(2),
            4 => Some(4),
            5 | 8 => Some(8),
            9 => Some(16),
            6 | 7 => None,
            _ => return Err("unknown value type"),
        };
        match fixed {
            Some(n) => b = b.get(n..).ok_or("value past the end")?,
            None => {
                let len_bytes = b.get(..2).ok_or("value length past the end")?;
                let len = usize::from(u16::from_be_bytes([len_bytes[0], len_bytes[1]]));
                let value = b.get(2..2 + len).ok_or("value past the end")?;
                if kind == 7 {
                    out.push((
                        name,
                        std::str::from_utf8(value).map_err(|_| "string value is not UTF-8")?,
                    ));
                }
                b = &b[2 + len..];
            }
        }
    }
    Ok(out)
}

/// The messages as the events the adapters reassemble, in order:
/// - an `event` whose JSON payload is `{"bytes": "<base64>"}` (InvokeModelWithResponseStream's `chunk`) is the
///   provider's own event inside: its decoded bytes are the data, so the Anthropic adapter reads a Bedrock
///   stream as it reads an SSE one;
/// - any other `event`: `:event-type` is the event name, the payload the data (ConverseStream);
/// - an `exception` or `error` becomes an `error` event `{"type":"error","error":{"type":..,"message":..}}`,
///   the shape both adapters keep as the response's `error`.
pub fn events(messages: &[Message<'_>]) -> Vec<SseEvent> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let payload = String::from_utf8_lossy(m.payload);
        match m.header(":message-type").unwrap_or("event") {
            "exception" => {
                let kind = m.header(":exception-type").unwrap_or("exception");
                let message = serde_json::from_str::<Value>(&payload)
                    .ok()
                    .and_then(|v| v.get("message").or_else(|| v.get("Message")).cloned())
                    .unwrap_or(Value::String(payload.into_owned()));
                out.push(error_event(kind, message));
            }
            "error" => {
                let kind = m.header(":error-code").unwrap_or("error");
                let message = m.header(":error-message").unwrap_or_default();
                out.push(error_event(kind, Value::String(message.to_owned())));
            }
            _ => {
                let event = m.header(":event-type").map(str::to_owned);
                let data = match wrapped_bytes(&payload) {
                    Some(inner) => inner,
                    None => payload.into_owned(),
                };
                out.push(SseEvent { event, data, id: None });
            }
        }
    }
    out
}

fn error_event(kind: &str, message: Value) -> SseEvent {
    SseEvent {
        event: Some("error".to_owned()),
        data: json!({"type": "error", "error": {"type": kind, "message": message}}).to_string(),
        id: None,
    }
}

/// `{"bytes": "<base64>", ...}` → the decoded text; None for any other payload.
fn wrapped_bytes(payload: &str) -> Option<String> {
    if !payload.trim_start().starts_with('{') || !payload.contains("\"bytes\"") {
        return None;
    }
    let v: Value = serde_json::from_str(payload).ok()?;
    let b64 = v.get("bytes")?.as_str()?;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    Some(String::from_utf8_lossy(&raw).into_owned())
}

/// The events as SSE text: what a trace keeps as its raw stream, readable where the binary framing is not.
pub fn to_sse_text(events: &[SseEvent]) -> String {
    let mut s = String::new();
    for e in events {
        if let Some(name) = &e.event {
            s.push_str("event: ");
            s.push_str(name);
            s.push('\n');
        }
        for line in e.data.split('\n') {
            s.push_str("data: ");
            s.push_str(line);
            s.push('\n');
        }
        s.push('\n');
    }
    s
}

/// One message in the wire format, for tests and the scripted upstream: string headers and a payload.
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::new();
    for (name, value) in headers {
        h.push(name.len() as u8);
        h.extend_from_slice(name.as_bytes());
        h.push(7);
        h.extend_from_slice(&(value.len() as u16).to_be_bytes());
        h.extend_from_slice(value.as_bytes());
    }
    let total = 12 + h.len() + payload.len() + 4;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(total as u32).to_be_bytes());
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    let prelude_crc = crc32fast::hash(&out);
    out.extend_from_slice(&prelude_crc.to_be_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The empty message from the AWS event-stream reference test vectors (awslabs/aws-c-event-stream,
    /// `test/encoded/positive/empty_message`): total 16, headers 0, prelude CRC 0x05c248eb, message CRC
    /// 0x7d98c8ff.
    const EMPTY: [u8; 16] = [
        0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x05, 0xc2, 0x48, 0xeb, 0x7d, 0x98, 0xc8, 0xff,
    ];

    #[test]
    fn the_reference_empty_message_decodes_and_our_encoder_writes_it() {
        let (messages, err) = decode(&EMPTY);
        assert_eq!(err, None);
        assert_eq!(messages.len(), 1);
        assert!(messages[0].headers.is_empty() && messages[0].payload.is_empty());
        assert_eq!(encode(&[], b""), EMPTY);
    }

    #[test]
    fn headers_of_every_type_are_walked_and_strings_kept() {
        // A header block by hand: bool true, int, bytes, string, timestamp, uuid.
        let mut h = Vec::new();
        h.extend_from_slice(&[1, b'b', 0]);
        h.extend_from_slice(&[1, b'i', 4, 0, 0, 0, 7]);
        h.extend_from_slice(&[1, b'y', 6, 0, 2, 0xff, 0xfe]);
        h.extend_from_slice(&[
            11, b':', b'e', b'v', b'e', b'n', b't', b'-', b't', b'y', b'p', b'e', 7, 0, 5,
        ]);
        h.extend_from_slice(b"chunk");
        h.extend_from_slice(&[1, b't', 8, 0, 0, 0, 0, 0, 0, 0, 1]);
        h.extend_from_slice(&[1, b'u', 9]);
        h.extend_from_slice(&[0; 16]);
        let total = 12 + h.len() + 2 + 4;
        let mut m = Vec::new();
        m.extend_from_slice(&(total as u32).to_be_bytes());
        m.extend_from_slice(&(h.len() as u32).to_be_bytes());
        m.extend_from_slice(&crc32fast::hash(&m).to_be_bytes());
        m.extend_from_slice(&h);
        m.extend_from_slice(b"{}");
        m.extend_from_slice(&crc32fast::hash(&m).to_be_bytes());
        let (messages, err) = decode(&m);
        assert_eq!(err, None);
        assert_eq!(messages[0].headers, vec![(":event-type", "chunk")]);
        assert_eq!(messages[0].payload, b"{}");
    }

    fn two_chunks() -> Vec<u8> {
        let mut body = encode(
            &[(":event-type", "chunk"), (":message-type", "event")],
            br#"{"bytes":"eyJ0eXBlIjoicGluZyJ9","p":"abc"}"#,
        );
        body.extend(encode(
            &[(":event-type", "contentBlockDelta"), (":message-type", "event")],
            br#"{"contentBlockIndex":0,"delta":{"text":"hi"}}"#,
        ));
        body
    }

    #[test]
    fn chunks_are_unwrapped_and_named_events_kept() {
        let body = two_chunks();
        let (messages, err) = decode(&body);
        assert_eq!(err, None);
        let events = events(&messages);
        assert_eq!(events[0].data, r#"{"type":"ping"}"#);
        assert_eq!(events[1].event.as_deref(), Some("contentBlockDelta"));
        assert_eq!(events[1].data, r#"{"contentBlockIndex":0,"delta":{"text":"hi"}}"#);
    }

    #[test]
    fn a_cut_stream_keeps_what_came_before() {
        let body = two_chunks();
        for cut in [body.len() - 1, body.len() - 20, 70, 5] {
            let (messages, err) = decode(&body[..cut]);
            assert!(
                matches!(err, Some(EventStreamError::Truncated { .. })),
                "cut {cut}: {err:?}"
            );
            assert!(messages.len() <= 1, "cut {cut}");
        }
    }

    #[test]
    fn a_bad_message_crc_skips_that_message_and_a_bad_prelude_stops() {
        let mut body = two_chunks();
        let first = be32(&body, 0) as usize;
        body[first - 6] ^= 0x20; // a payload byte of the first message
        let (messages, err) = decode(&body);
        assert!(
            matches!(err, Some(EventStreamError::MessageCrc { offset: 0, .. })),
            "{err:?}"
        );
        assert_eq!(messages.len(), 1, "the second message still decodes");
        assert_eq!(messages[0].header(":event-type"), Some("contentBlockDelta"));

        let mut body = two_chunks();
        body[3] ^= 1; // total length: the prelude CRC no longer matches
        let (messages, err) = decode(&body);
        assert!(
            matches!(err, Some(EventStreamError::PreludeCrc { offset: 0, .. })),
            "{err:?}"
        );
        assert!(messages.is_empty());
    }

    #[test]
    fn lengths_that_cannot_be_are_refused_without_reading_past_the_buffer() {
        for (total, headers) in [(0u32, 0u32), (15, 0), (16, 1), (u32::MAX, 0), (40, 30)] {
            let mut m = Vec::new();
            m.extend_from_slice(&total.to_be_bytes());
            m.extend_from_slice(&headers.to_be_bytes());
            m.extend_from_slice(&crc32fast::hash(&m).to_be_bytes());
            m.extend_from_slice(&[0; 40]);
            let (messages, err) = decode(&m);
            assert!(messages.is_empty());
            assert!(err.is_some(), "{total}/{headers}");
        }
        // Header blocks that lie about their own lengths.
        for h in [
            &[5u8, b'a'][..],
            &[1, b'a', 7, 0, 9, b'x'],
            &[1, b'a', 42],
            &[1, b'a', 4, 0],
        ] {
            let mut m = Vec::new();
            let total = 12 + h.len() + 4;
            m.extend_from_slice(&(total as u32).to_be_bytes());
            m.extend_from_slice(&(h.len() as u32).to_be_bytes());
            m.extend_from_slice(&crc32fast::hash(&m).to_be_bytes());
            m.extend_from_slice(h);
            m.extend_from_slice(&crc32fast::hash(&m).to_be_bytes());
            let (_, err) = decode(&m);
            assert!(matches!(err, Some(EventStreamError::Headers { .. })), "{h:?}: {err:?}");
        }
    }

    #[test]
    fn exceptions_become_error_events() {
        let body = encode(
            &[
                (":exception-type", "throttlingException"),
                (":message-type", "exception"),
                (":content-type", "application/json"),
            ],
            br#"{"message":"Too many requests, please wait before trying again."}"#,
        );
        let (messages, _) = decode(&body);
        let events = events(&messages);
        let v: Value = serde_json::from_str(&events[0].data).unwrap_or_default();
        assert_eq!(v["error"]["type"], "throttlingException");
        assert_eq!(
            v["error"]["message"],
            "Too many requests, please wait before trying again."
        );
    }
}
