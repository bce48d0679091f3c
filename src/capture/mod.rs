//! The contract between the data path and the pipeline.
//!
//! The data path builds one [`RawExchange`] per HTTP exchange out of `Bytes` clones and hands it over with
//! exactly one non-blocking [`CaptureTx::try_send`], made when the worker thread next runs out of work (see
//! [`handoff`]), through a queue whose sends rarely need to wake anyone (see [`queue`]). Everything else
//! (decoding, parsing, reassembly, derivation, storage) happens on other threads.

pub mod budget;
pub mod conversation;
pub mod decode;
pub mod handoff;
pub mod queue;
pub mod spill;
pub mod sse;
pub mod websocket;

use std::sync::Arc;

use bytes::Bytes;

pub use queue::{CaptureRx, CaptureTx};

/// Where the pipeline takes exchanges from: the capture queue itself, or the spill stage's handoff when the
/// spill is on (see [`spill`]).
pub trait Source: Send {
    /// The next exchange, waiting at most `timeout`; `Disconnected` once nothing more can come.
    fn recv_timeout(&mut self, timeout: std::time::Duration) -> Result<RawExchange, std::sync::mpsc::RecvTimeoutError>;
    /// The next exchange if one is waiting right now.
    fn try_recv(&mut self) -> Option<RawExchange>;
}

// The exchange vocabulary is the model's (traces and exports use it too); re-exported for the data path.
pub use crate::model::exchange::{Api, ExchangeMeta, Outcome, Timings, UnixMicros, now_micros};

/// Header (name, value) pairs kept in one string, `name:value\n` each: the data path makes one allocation per
/// message instead of two per header (a `String` pair per header was a third of capture's cost on the data
/// path; a separate list of offsets was one more allocation per message). HTTP header names cannot contain
/// `:` or a newline and values cannot contain a newline, so the separators are unambiguous; [`HeaderList::push`]
/// replaces a newline in a value that did not come from the wire. The pipeline reads pairs back as `&str` and
/// turns them into owned pairs off the data path.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeaderList {
    text: String,
}

impl HeaderList {
    /// Room for `headers` headers totalling `bytes` bytes of names and values.
    pub fn with_capacity(headers: usize, bytes: usize) -> HeaderList {
        HeaderList {
            text: String::with_capacity(bytes + 2 * headers),
        }
    }

    /// Any pair: a newline in the value becomes a space.
    pub fn push(&mut self, name: &str, value: &str) {
        if value.contains('\n') {
            self.push_wire(name, &value.replace('\n', " "));
        } else {
            self.push_wire(name, value);
        }
    }

    /// A pair read off an `http::HeaderMap`, whose names and values cannot hold the separators (the data
    /// path's case: no scan of the value).
    pub fn push_wire(&mut self, name: &str, value: &str) {
        self.text.push_str(name);
        self.text.push(':');
        self.text.push_str(value);
        self.text.push('\n');
    }

    /// The list as stored: `name:value\n` per pair (what the spill writes to disk).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// A list from [`HeaderList::text`]'s form (read back from the spill).
    pub fn from_text(text: &str) -> HeaderList {
        HeaderList { text: text.to_owned() }
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Bytes of names, values and separators.
    pub fn text_len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.text
            .split_terminator('\n')
            .map(|line| line.split_once(':').unwrap_or((line, "")))
    }

    /// The first value of `name` (ASCII case-insensitive).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v)
    }

    pub fn to_pairs(&self) -> Vec<(String, String)> {
        self.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    }
}

impl<'a> FromIterator<(&'a str, &'a str)> for HeaderList {
    fn from_iter<I: IntoIterator<Item = (&'a str, &'a str)>>(pairs: I) -> HeaderList {
        let mut list = HeaderList::default();
        for (k, v) in pairs {
            list.push(k, v);
        }
        list
    }
}

/// A captured body: the frames that passed, usually one (small frames are copied into one buffer, see
/// `proxy::tap`), kept inline so that the common case allocates no list.
pub type BodyChunks = smallvec::SmallVec<[Bytes; 1]>;

/// One direction of an exchange as captured: redacted headers and the body as the frames that passed.
#[derive(Debug, Clone, Default)]
pub struct Captured {
    /// Header name → value, secrets already replaced (see `proxy::redact`).
    pub headers: HeaderList,
    pub body: BodyChunks,
    /// Bytes seen, including those past the cap.
    pub len: u64,
    /// The cap was hit: `body` holds only a prefix.
    pub truncated: bool,
    /// The body reached its end (false when the stream was cut).
    pub ended: bool,
    /// The body's bytes as charged to the capture budget; released when this capture is dropped.
    pub charge: budget::Charge,
}

impl Captured {
    /// Concatenate the captured frames (off the data path only).
    pub fn body_bytes(&self) -> Vec<u8> {
        let total: usize = self.body.iter().map(|b| b.len()).sum();
        let mut out = Vec::with_capacity(total);
        for b in &self.body {
            out.extend_from_slice(b);
        }
        out
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)
    }

    /// Bytes this capture keeps alive: body frames and header text.
    pub fn held_bytes(&self) -> u64 {
        let body: usize = self.body.iter().map(Bytes::len).sum();
        (body + self.headers.text_len()) as u64
    }
}

/// An exchange's id: a UUIDv7 (RFC 9562) carrying the exchange's start time, with random bits after the
/// millisecond. Made from the timestamp the data path already took: `Uuid::now_v7` reads the clock again and
/// locks a process-wide counter (two proxy workers took turns on that lock). Ids still sort by millisecond;
/// within one they are unordered, and nothing orders by id (reads order by start time, then store sequence).
pub fn exchange_id(start: UnixMicros) -> uuid::Uuid {
    let micros = start.max(0) as u64;
    let ts = uuid::Timestamp::from_unix_time(micros / 1_000_000, (micros % 1_000_000) as u32 * 1_000, 0, 0);
    uuid::Uuid::new_v7(ts)
}

/// Everything the data path knows about one exchange.
#[derive(Debug, Clone)]
pub struct RawExchange {
    /// See [`exchange_id`]; formatted as text off the data path.
    pub id: uuid::Uuid,
    pub upstream: Arc<str>,
    pub api: Api,
    pub method: http::Method,
    /// Path and query as sent upstream (the upstream URL's own prefix included), query secrets redacted.
    pub path: String,
    pub status: Option<u16>,
    pub request: Captured,
    pub response: Option<Captured>,
    pub timings: Timings,
    pub outcome: Outcome,
    pub error: Option<String>,
    pub meta: ExchangeMeta,
    /// What the capture queue charged for the rest of `held_bytes` (headers, and bodies not charged yet).
    pub charge: budget::Charge,
}

impl RawExchange {
    /// Held bytes not yet charged to the capture budget.
    pub fn uncharged_bytes(&self) -> u64 {
        let charged =
            self.request.charge.bytes() + self.response.as_ref().map_or(0, |r| r.charge.bytes()) + self.charge.bytes();
        self.held_bytes().saturating_sub(charged)
    }

    /// Captured bytes this exchange keeps alive (what the capture queue's byte budget counts).
    pub fn held_bytes(&self) -> u64 {
        self.request.held_bytes() + self.response.as_ref().map_or(0, Captured::held_bytes)
    }
}

#[cfg(test)]
impl RawExchange {
    /// A finished, empty exchange, for tests that only follow exchanges by id (`n` becomes the id's bits).
    pub(crate) fn for_test(n: u128) -> RawExchange {
        RawExchange {
            id: uuid::Uuid::from_u128(n),
            upstream: Arc::from("openai"),
            api: Api::OpenAiChat,
            method: http::Method::POST,
            path: "/v1/chat/completions".into(),
            status: Some(200),
            request: Captured::default(),
            response: None,
            timings: Timings::default(),
            outcome: Outcome::Complete,
            error: None,
            meta: ExchangeMeta::default(),
            charge: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HeaderList, exchange_id};

    #[test]
    fn exchange_ids_are_v7_carry_the_start_millisecond_and_differ_within_it() {
        let start = 1_763_800_000_123_456; // 2025-11-22T08:26:40.123456Z
        let a = exchange_id(start);
        let b = exchange_id(start);
        assert_ne!(a, b, "random bits after the millisecond");
        assert_eq!(a.get_version_num(), 7);
        let (secs, nanos) = a.get_timestamp().expect("v7 has a timestamp").to_unix();
        assert_eq!((secs, nanos), (1_763_800_000, 123_000_000));
        assert!(exchange_id(start + 1_000) > a, "a later millisecond sorts after");
        assert_eq!(a.to_string().len(), 36);
    }

    #[test]
    fn header_list_reads_back_what_was_pushed_in_order() {
        let mut h = HeaderList::with_capacity(3, 10);
        h.push("content-type", "application/json");
        h.push("x-empty", "");
        h.push("Set-Cookie", "REDACTED");
        h.push("x-unicode", "caf\u{e9}");
        h.push("x-url", "https://example.com:8080/a?b=c:d");
        h.push("x-not-from-the-wire", "two\nlines");
        assert_eq!(h.len(), 6);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            [
                ("content-type", "application/json"),
                ("x-empty", ""),
                ("Set-Cookie", "REDACTED"),
                ("x-unicode", "caf\u{e9}"),
                ("x-url", "https://example.com:8080/a?b=c:d"),
                ("x-not-from-the-wire", "two lines")
            ]
        );
        assert_eq!(h.get("set-cookie"), Some("REDACTED"));
        assert_eq!(h.get("x-empty"), Some(""));
        assert_eq!(h.get("missing"), None);
        assert_eq!(
            h.to_pairs()[0],
            ("content-type".to_owned(), "application/json".to_owned())
        );
        assert!(HeaderList::default().is_empty());
    }
}
