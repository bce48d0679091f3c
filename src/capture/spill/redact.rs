//! Credentials in a request body are removed before the spill writes the exchange to disk.
//!
//! Headers, query parameters and key-shaped path segments are redacted on the data path, before capture
//! (`proxy::redact`); credential members of a JSON body (`{"api_key": "..."}`) are found by scanning the body,
//! which the data path never does. Exchanges that go straight to the pipeline are redacted there; one that
//! waits in the spill would reach `<data_dir>/spill/` with its body as sent. So the spill thread applies the
//! same scan to every exchange it writes, before encoding it. Only spilled exchanges pay for it, on this thread,
//! never on the async workers.
//!
//! The scan itself is the pipeline's (`pipeline::secrets::redact_json`), handed in by the caller: this layer sits
//! below the proxy's naming rule. A compressed body is decoded to be scanned (at most the capture cap); when it
//! held a credential it is written decoded and redacted, and its `content-encoding` header is kept as
//! `identity`, so that the pipeline reads it as what it now is.

use bytes::Bytes;

use crate::capture::decode::decode_body;
use crate::capture::{Captured, HeaderList};

/// How a spilled request body is scanned: `redact` returns the JSON text with credential values replaced, or
/// None when it has none; `cap` is `capture.max_body_bytes`, the most a compressed body is decoded to.
#[derive(Clone, Copy)]
pub struct BodyRedaction {
    pub redact: fn(&str) -> Option<String>,
    pub cap: usize,
}

impl BodyRedaction {
    /// Replace `request`'s body by its redacted form when it holds a credential; otherwise leave it untouched
    /// (no copy of a single-frame identity body).
    pub fn apply(&self, request: &mut Captured) {
        if request.body.is_empty() {
            return;
        }
        let encoding = request
            .header("content-encoding")
            .map(str::trim)
            .filter(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity"));
        let encoded = encoding.is_some();
        let (joined, truncated) = match encoding {
            None if request.body.len() == 1 => (None, false),
            None => (Some(request.body_bytes()), false),
            Some(encoding) => match decode_body(Some(encoding), request.body_bytes(), self.cap) {
                Ok(decoded) => (Some(decoded.bytes), decoded.truncated),
                // Not decodable here nor in the pipeline (which then keeps the bytes as they are): no JSON
                // text to find a member in.
                Err(_) => return,
            },
        };
        let bytes: &[u8] = match &joined {
            Some(b) => b.as_slice(),
            None => &request.body[0][..],
        };
        // `str::from_utf8` validates ASCII a word at a time; `from_utf8_lossy` walks the body byte by byte even
        // when it is valid (15% of the spill thread's CPU in the forward benchmark's capture-on rounds).
        let text = match std::str::from_utf8(bytes) {
            Ok(text) => std::borrow::Cow::Borrowed(text),
            Err(_) => String::from_utf8_lossy(bytes),
        };
        let Some(redacted) = (self.redact)(&text) else { return };
        request.body = [Bytes::from(redacted)].into_iter().collect();
        if encoded {
            request.truncated |= truncated;
            request.headers = request
                .headers
                .iter()
                .map(|(k, v)| {
                    if k.eq_ignore_ascii_case("content-encoding") {
                        (k, "identity")
                    } else {
                        (k, v)
                    }
                })
                .collect::<HeaderList>();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redaction() -> BodyRedaction {
        BodyRedaction {
            redact: |t| t.contains("sk-x").then(|| t.replace("sk-x", "REDACTED")),
            cap: 1 << 20,
        }
    }

    fn request(headers: &[(&str, &str)], body: &[&'static [u8]]) -> Captured {
        Captured {
            headers: headers.iter().copied().collect(),
            body: body.iter().map(|b| Bytes::from_static(b)).collect(),
            ended: true,
            ..Default::default()
        }
    }

    #[test]
    fn a_body_with_a_credential_is_replaced_in_one_frame_and_one_without_is_untouched() {
        let mut split = request(&[("content-type", "application/json")], &[b"{\"k\":\"s", b"k-x\"}"]);
        redaction().apply(&mut split);
        assert_eq!(split.body_bytes(), b"{\"k\":\"REDACTED\"}");
        assert_eq!(split.body.len(), 1);

        let mut clean = request(&[], &[b"{\"k\":\"v\"}"]);
        let before = clean.body[0].as_ptr();
        redaction().apply(&mut clean);
        assert_eq!(clean.body[0].as_ptr(), before, "not copied");
    }

    /// A body that is not valid UTF-8 is still scanned (its invalid bytes read as U+FFFD).
    #[test]
    fn a_body_with_invalid_utf8_is_still_scanned() {
        let mut c = request(&[], &[b"{\"k\":\"sk-x\",\"n\":\"\xff\"}"]);
        redaction().apply(&mut c);
        assert_eq!(c.body_bytes(), "{\"k\":\"REDACTED\",\"n\":\"\u{fffd}\"}".as_bytes());
    }

    #[test]
    fn a_compressed_body_with_a_credential_is_kept_decoded_and_marked_identity() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"{\"k\":\"sk-x\"}").unwrap();
        let body: &'static [u8] = Box::leak(gz.finish().unwrap().into_boxed_slice());
        let mut c = request(
            &[("content-encoding", "gzip"), ("content-type", "application/json")],
            &[body],
        );
        redaction().apply(&mut c);
        assert_eq!(c.body_bytes(), b"{\"k\":\"REDACTED\"}");
        assert_eq!(c.header("content-encoding"), Some("identity"));
        assert_eq!(c.header("content-type"), Some("application/json"));
    }
}
