//! One spilled exchange on disk: `[payload length: u32 LE][CRC-32 of the payload: u32 LE][payload]`, the
//! payload a `postcard` encoding of [`Mirror`].
//!
//! The mirror is a plain struct rather than `RawExchange` itself: postcard is not self-describing, so
//! `skip_serializing_if` (used by `ExchangeMeta` for its JSON form) would make records unreadable, and enums
//! are written as their names (`Api::as_str`) so that reordering a Rust enum cannot change what an old record
//! means. Strings and bodies borrow from the buffer they are read from: a body read back is a slice of the
//! segment's one buffer (`Bytes::slice_ref`), not a copy.
//!
//! The length and checksum make a torn tail (kill -9 in the middle of a write) or a damaged record an error
//! the reader reports, never a panic or a misread exchange.

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::capture::{Api, BodyChunks, Captured, ExchangeMeta, HeaderList, Outcome, RawExchange, Timings};

/// Bytes of a record's frame before its payload.
pub const FRAME_HEADER: usize = 8;
/// The largest payload a record may declare: a larger length is damage, not a record (a body is at most
/// `capture.max_body_bytes` per direction, well below this).
const MAX_PAYLOAD: u32 = 1 << 31;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RecordError {
    #[error("spill record cut short: {needed} bytes declared, {left} left")]
    Torn { needed: usize, left: usize },
    #[error("spill record fails its checksum")]
    Checksum,
    #[error("spill record declares {0} bytes")]
    Length(u32),
    #[error("spill record does not decode: {0}")]
    Decode(String),
    #[error("exchange does not encode: {0}")]
    Encode(String),
}

#[derive(Serialize, Deserialize)]
struct MirrorCaptured<'a> {
    headers: &'a str,
    #[serde(borrow, serialize_with = "chunks_as_bytes")]
    body: Vec<&'a [u8]>,
    len: u64,
    truncated: bool,
    ended: bool,
}

#[derive(Serialize, Deserialize)]
struct Mirror<'a> {
    id: [u8; 16],
    upstream: &'a str,
    api: &'a str,
    method: &'a str,
    path: &'a str,
    status: Option<u16>,
    #[serde(borrow)]
    request: MirrorCaptured<'a>,
    #[serde(borrow)]
    response: Option<MirrorCaptured<'a>>,
    start: i64,
    first_byte: Option<i64>,
    end: i64,
    outcome: &'a str,
    #[serde(borrow)]
    error: Option<&'a str>,
    #[serde(borrow)]
    session: Option<&'a str>,
    #[serde(borrow)]
    client_session: Option<&'a str>,
    #[serde(borrow)]
    agent: Option<&'a str>,
    #[serde(borrow)]
    tags: Vec<&'a str>,
    #[serde(borrow)]
    traceparent: Option<&'a str>,
}

/// serde writes a `&[u8]` as a sequence of `u8`, one serializer call per byte; as bytes it is one copy. In
/// postcard both are the same bytes on disk (a varint length, then the bytes), which is the form `&[u8]`'s
/// `Deserialize` reads.
fn chunks_as_bytes<S: serde::Serializer>(chunks: &[&[u8]], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(chunks.iter().map(|c| AsBytes(c)))
}

struct AsBytes<'a>(&'a [u8]);

impl Serialize for AsBytes<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

fn mirror_captured(c: &Captured) -> MirrorCaptured<'_> {
    MirrorCaptured {
        headers: c.headers.text(),
        body: c.body.iter().map(|b| &b[..]).collect(),
        len: c.len,
        truncated: c.truncated,
        ended: c.ended,
    }
}

fn captured_from(m: MirrorCaptured<'_>, buffer: &Bytes) -> Captured {
    Captured {
        headers: HeaderList::from_text(m.headers),
        body: m.body.into_iter().map(|b| buffer.slice_ref(b)).collect::<BodyChunks>(),
        len: m.len,
        truncated: m.truncated,
        ended: m.ended,
        charge: Default::default(),
    }
}

/// Append one framed record for `exchange` to `out`; returns the frame's length.
pub fn encode(exchange: &RawExchange, out: &mut Vec<u8>) -> Result<usize, RecordError> {
    let m = &exchange.meta;
    let mirror = Mirror {
        id: exchange.id.into_bytes(),
        upstream: &exchange.upstream,
        api: exchange.api.as_str(),
        method: exchange.method.as_str(),
        path: &exchange.path,
        status: exchange.status,
        request: mirror_captured(&exchange.request),
        response: exchange.response.as_ref().map(mirror_captured),
        start: exchange.timings.start,
        first_byte: exchange.timings.first_byte,
        end: exchange.timings.end,
        outcome: exchange.outcome.as_str(),
        error: exchange.error.as_deref(),
        session: m.session.as_deref(),
        client_session: m.client_session.as_deref(),
        agent: m.agent.as_deref(),
        tags: m.tags.iter().map(String::as_str).collect(),
        traceparent: m.traceparent.as_deref(),
    };
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER]);
    let mut out_vec = std::mem::take(out);
    out_vec = postcard::to_extend(&mirror, out_vec).map_err(|e| RecordError::Encode(e.to_string()))?;
    *out = out_vec;
    let payload_len = out.len() - start - FRAME_HEADER;
    let Ok(len32) = u32::try_from(payload_len) else {
        out.truncate(start);
        return Err(RecordError::Length(u32::MAX));
    };
    if len32 > MAX_PAYLOAD {
        out.truncate(start);
        return Err(RecordError::Length(len32));
    }
    let crc = crc32fast::hash(&out[start + FRAME_HEADER..]);
    out[start..start + 4].copy_from_slice(&len32.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(out.len() - start)
}

/// Decode the record at the start of `buffer[at..]`: the exchange and the frame's length. Bodies are slices
/// of `buffer`.
pub fn decode(buffer: &Bytes, at: usize) -> Result<(RawExchange, usize), RecordError> {
    let rest = buffer.get(at..).unwrap_or_default();
    if rest.len() < FRAME_HEADER {
        return Err(RecordError::Torn {
            needed: FRAME_HEADER,
            left: rest.len(),
        });
    }
    let word = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
    let (len, crc) = (word(0), word(4));
    if len > MAX_PAYLOAD {
        return Err(RecordError::Length(len));
    }
    let frame = FRAME_HEADER + len as usize;
    if rest.len() < frame {
        return Err(RecordError::Torn {
            needed: frame,
            left: rest.len(),
        });
    }
    let payload = &rest[FRAME_HEADER..frame];
    if crc32fast::hash(payload) != crc {
        return Err(RecordError::Checksum);
    }
    let m: Mirror<'_> = postcard::from_bytes(payload).map_err(|e| RecordError::Decode(e.to_string()))?;
    let method = http::Method::from_bytes(m.method.as_bytes()).map_err(|e| RecordError::Decode(e.to_string()))?;
    let exchange = RawExchange {
        id: uuid::Uuid::from_bytes(m.id),
        upstream: Arc::from(m.upstream),
        api: Api::parse(m.api),
        method,
        path: m.path.to_owned(),
        status: m.status,
        request: captured_from(m.request, buffer),
        response: m.response.map(|r| captured_from(r, buffer)),
        timings: Timings {
            start: m.start,
            first_byte: m.first_byte,
            end: m.end,
        },
        outcome: Outcome::parse(m.outcome),
        error: m.error.map(str::to_owned),
        meta: ExchangeMeta {
            session: m.session.map(str::to_owned),
            client_session: m.client_session.map(str::to_owned),
            agent: m.agent.map(str::to_owned),
            tags: m.tags.into_iter().map(str::to_owned).collect(),
            traceparent: m.traceparent.map(str::to_owned),
            // Set by the pipeline from the request headers, which the record keeps.
            replay_of: None,
        },
        charge: Default::default(),
    };
    Ok((exchange, frame))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RawExchange {
        let mut e = RawExchange::for_test(0x1234_5678_9abc_def0_1122_3344_5566_7788);
        e.api = Api::AnthropicMessages;
        e.method = http::Method::PUT;
        e.path = "/v1/messages?key=REDACTED".into();
        e.status = Some(529);
        e.request.headers.push("content-type", "application/json");
        e.request.headers.push("authorization", "REDACTED");
        e.request.body = vec![Bytes::from_static(b"{\"a\":"), Bytes::from_static(b"1}")].into();
        e.request.len = 7;
        e.request.ended = true;
        e.response = Some(Captured {
            headers: [("content-type", "text/event-stream")].into_iter().collect(),
            body: [Bytes::from(vec![7u8; 70_000])].into(),
            len: 90_000,
            truncated: true,
            ended: false,
            charge: Default::default(),
        });
        e.timings = Timings {
            start: 1_763_800_000_000_000,
            first_byte: Some(1_763_800_000_100_000),
            end: 1_763_800_000_200_000,
        };
        e.outcome = Outcome::ClientGone;
        e.error = Some("client went away".into());
        e.meta = ExchangeMeta {
            session: Some("s-1".into()),
            client_session: None,
            agent: Some("coder".into()),
            tags: vec!["a".into(), "b".into()],
            traceparent: Some("00-abc-def-01".into()),
            replay_of: None,
        };
        e
    }

    fn same(a: &RawExchange, b: &RawExchange) {
        assert_eq!(a.id, b.id);
        assert_eq!(
            (&*a.upstream, a.api, &a.method, &a.path, a.status),
            (&*b.upstream, b.api, &b.method, &b.path, b.status)
        );
        for (x, y) in [
            (Some(&a.request), Some(&b.request)),
            (a.response.as_ref(), b.response.as_ref()),
        ] {
            let (x, y) = (x.expect("present"), y.expect("present"));
            assert_eq!(x.headers, y.headers);
            assert_eq!(x.body_bytes(), y.body_bytes());
            assert_eq!(x.body.len(), y.body.len(), "frames kept as frames");
            assert_eq!((x.len, x.truncated, x.ended), (y.len, y.truncated, y.ended));
        }
        assert_eq!(
            (a.timings.start, a.timings.first_byte, a.timings.end),
            (b.timings.start, b.timings.first_byte, b.timings.end)
        );
        assert_eq!((a.outcome, &a.error, &a.meta), (b.outcome, &b.error, &b.meta));
    }

    #[test]
    fn an_exchange_reads_back_field_for_field_and_bodies_are_slices_of_the_buffer() {
        let e = sample();
        let mut buf = b"head".to_vec();
        let n = encode(&e, &mut buf).expect("encode");
        assert_eq!(buf.len(), 4 + n);
        let buffer = Bytes::from(buf);
        let (back, len) = decode(&buffer, 4).expect("decode");
        assert_eq!(len, n);
        same(&e, &back);
        let body = &back.response.as_ref().expect("response").body[0];
        let inside = buffer.as_ptr_range();
        assert!(inside.contains(&body.as_ptr()), "no copy of the body");
        assert_eq!(back.charge.bytes(), 0);
    }

    /// Chunks written as bytes are the bytes a sequence of `u8` gives in postcard: a spill written either way
    /// reads back the same.
    #[test]
    fn body_chunks_as_bytes_are_the_same_bytes_as_a_sequence_of_u8() {
        let chunks: Vec<&[u8]> = vec![b"", b"{\"a\":1}", &[0xff; 300]];
        let as_seq = postcard::to_allocvec(&chunks).expect("seq");
        let as_bytes = postcard::to_allocvec(&chunks.iter().map(|c| AsBytes(c)).collect::<Vec<_>>()).expect("bytes");
        assert_eq!(as_seq, as_bytes);
        let back: Vec<&[u8]> = postcard::from_bytes(&as_bytes).expect("decode");
        assert_eq!(back, chunks);
    }

    #[test]
    fn records_follow_each_other_and_a_torn_or_damaged_one_is_an_error() {
        let mut buf = Vec::new();
        let first = encode(&RawExchange::for_test(1), &mut buf).expect("encode");
        let second = encode(&sample(), &mut buf).expect("encode");
        let whole = Bytes::from(buf.clone());
        let (a, n) = decode(&whole, 0).expect("first");
        assert_eq!((a.id.as_u128(), n), (1, first));
        let (b, m) = decode(&whole, n).expect("second");
        assert_eq!(m, second);
        same(&sample(), &b);
        assert!(matches!(
            decode(&whole, n + m),
            Err(RecordError::Torn { needed: 8, left: 0 })
        ));

        // Every cut of the second record is a torn record, never a panic or an exchange.
        for cut in first..buf.len() {
            let torn = Bytes::copy_from_slice(&buf[..cut]);
            assert!(
                matches!(decode(&torn, first), Err(RecordError::Torn { .. })),
                "cut at {cut}"
            );
        }
        // Any flipped payload byte fails the checksum.
        for at in [first + FRAME_HEADER, first + FRAME_HEADER + 100, buf.len() - 1] {
            let mut damaged = buf.clone();
            damaged[at] ^= 0x40;
            assert_eq!(decode(&Bytes::from(damaged), first).err(), Some(RecordError::Checksum));
        }
        // A length no record can have.
        let mut damaged = buf.clone();
        damaged[first + 3] = 0xff;
        assert!(matches!(
            decode(&Bytes::from(damaged), first),
            Err(RecordError::Length(_))
        ));
        // A right checksum over bytes that are not a mirror.
        let junk = [1u8, 2, 3];
        let mut framed = (junk.len() as u32).to_le_bytes().to_vec();
        framed.extend_from_slice(&crc32fast::hash(&junk).to_le_bytes());
        framed.extend_from_slice(&junk);
        assert!(matches!(decode(&Bytes::from(framed), 0), Err(RecordError::Decode(_))));
    }
}
