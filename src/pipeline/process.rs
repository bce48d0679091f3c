//! RawExchange → ProviderTrace (+ the normalized call): decode bodies, reassemble streams, normalize.
//! Pure functions of one exchange; run on the pipeline thread, never on the async workers.

use bytes::Bytes;
use serde_json::Value;

use crate::capture::sse::{looks_like_sse, parse_events};
use crate::capture::{Captured, Outcome, RawExchange, decode::decode_body};
use crate::model::call::NormalizedCall;
use crate::model::exchange::{REPLAY_OF_HEADER, replay_of_value};
use crate::model::json::{Json, JsonText};
use crate::model::trace::{CallFacts, ProviderTrace};
use crate::provider::{CallContext, adapter_for, eventstream};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("exchange {id}: {what}")]
    Body { id: String, what: String },
    #[error("exchange {id}: a body decodes to more than the capture cap ({cap} bytes); kept cut at the cap")]
    DecodedOverCap { id: String, cap: usize },
    /// A Bedrock stream's binary framing is cut or damaged: the events before the damage are kept.
    #[error("exchange {id}: {source}")]
    EventStream {
        id: String,
        #[source]
        source: crate::provider::eventstream::EventStreamError,
    },
    #[error("exchange {id}: {source}")]
    Adapter {
        id: String,
        #[source]
        source: crate::provider::AdapterError,
    },
}

/// Everything derivation needs about one exchange.
pub struct Processed {
    pub trace: ProviderTrace,
    pub call: Option<NormalizedCall>,
    /// Problems that did not stop the trace from being kept (it is stored with what could be read).
    pub errors: Vec<ProcessError>,
}

/// The body decoded (at most `cap` bytes), or as captured when it cannot be decoded.
fn decoded(c: &Captured, id: &str, cap: usize, errors: &mut Vec<ProcessError>, truncated: &mut bool) -> Vec<u8> {
    match decode_body(c.header("content-encoding"), c.body_bytes(), cap) {
        Ok(decoded) => {
            *truncated |= decoded.truncated;
            release_if_large(decoded.bytes.len());
            decoded.bytes
        }
        Err(e) => {
            errors.push(ProcessError::Body {
                id: id.to_owned(),
                what: e.to_string(),
            });
            c.body_bytes()
        }
    }
}

/// Past this, the memory a body's processing freed is handed back to the OS at once (see [`release_if_large`]).
pub const RELEASE_AFTER_BYTES: usize = 1 << 20;

/// The buffer a large body was decoded into grew by doubling, and mimalloc keeps what a thread freed until that
/// thread collects: the buffers it outgrew (half the body again) were still resident while the body was escaped
/// and stored, and a compression bomb's peak was the cap three times over. Hand them back now.
pub fn release_if_large(bytes: usize) {
    if bytes > RELEASE_AFTER_BYTES {
        crate::allocator::release_freed_memory();
    }
}

/// The body as one buffer: the captured frame itself when it is a single uncompressed one (no copy), else the
/// frames decoded and joined. Not checked for UTF-8 here: whoever reads it as text does (a copy of a body that
/// is not UTF-8 was made here and another one later); a binary body (Bedrock's event-stream framing) stays as
/// it came.
fn body_buffer(c: &Captured, id: &str, cap: usize, errors: &mut Vec<ProcessError>, truncated: &mut bool) -> Bytes {
    let identity = c
        .header("content-encoding")
        .is_none_or(|e| e.eq_ignore_ascii_case("identity"));
    if identity && c.body.len() == 1 {
        return c.body[0].clone();
    }
    Bytes::from(decoded(c, id, cap, errors, truncated))
}

fn is_event_stream(c: &Captured) -> bool {
    c.header("content-type")
        .is_some_and(|t| t.to_ascii_lowercase().contains("application/vnd.amazon.eventstream"))
}

/// What an adapter sees of a body that is not JSON (an error page, whose text becomes the error message):
/// its beginning, up to this many bytes.
const TEXT_VIEW_BYTES: usize = 64 * 1024;

/// A body read without building a `Value`: a borrowed view for the adapter and the text to keep (see
/// [`text_body`] for a body that is not JSON). Empty is null. The body's buffer is taken from `body` when it is
/// not JSON (and `body` left empty), so that it can become the kept text: hence a macro, where a function
/// returning the view borrowed from `body` could not also take it.
macro_rules! read_body {
    ($body:ident, $cap:expr, $truncated:expr) => {{
        let parsed = JsonText::parse(&$body);
        match parsed {
            Some(parsed) => parsed,
            None => {
                drop(parsed);
                text_body(std::mem::take(&mut $body), $cap, $truncated)
            }
        }
    }};
}

/// A body that is not JSON is kept as a JSON string holding its text (adapters read error pages that way), at
/// most `cap` bytes of JSON (escaping can make a text six times longer; beyond `cap` it is cut and `truncated`
/// set), escaped in the body's own buffer when nothing else holds it (a decoded body): a decoded compression
/// bomb of control characters otherwise sat next to its escaped copy, twice the cap. The adapter sees its first
/// [`TEXT_VIEW_BYTES`]. Empty is null.
fn text_body(bytes: Bytes, cap: usize, truncated: &mut bool) -> (Json<'static>, JsonText) {
    if bytes.trim_ascii().is_empty() {
        return (Json::Null, JsonText::default());
    }
    let mut head = bytes.len().min(TEXT_VIEW_BYTES);
    // Not in the middle of a character (an invalid sequence at the end becomes one replacement character).
    while head < bytes.len() && head > 0 && (bytes[head] & 0xC0) == 0x80 {
        head -= 1;
    }
    let view = String::from_utf8_lossy(&bytes[..head]).into_owned();
    // No copy when this is the only handle on a buffer (see `Vec::from(Bytes)`).
    let (kept, cut) = JsonText::string_within(Vec::from(bytes), cap);
    *truncated |= cut;
    (Json::String(view.into()), kept)
}

/// `cap`: the most bytes a body may decode to (`capture.max_body_bytes`); beyond it the decoded copy is cut and
/// the trace marked truncated, as the data path does for bytes on the wire.
/// An HTTP error status (429, 529 "overloaded", ...) is an error even though the exchange completed on the wire:
/// the trace's `error` says what the provider answered, and the outcome is `upstream_error` (see [`process`]).
fn status_error(status: Option<u16>, call: Option<&NormalizedCall>) -> Option<String> {
    let status = status.filter(|s| *s >= 400)?;
    Some(match call.and_then(|c| c.error.as_ref()) {
        Some(e) => format!("{}: {}", e.kind, e.message),
        None => format!("http_{status}"),
    })
}

pub fn process(mut ex: RawExchange, cap: usize) -> Processed {
    let mut errors = Vec::new();
    let id = ex.id.to_string();
    let mut truncated = false;
    let mut request_body = body_buffer(&ex.request, &id, cap, &mut errors, &mut truncated);
    let (request_view, request) = read_body!(request_body, cap, &mut truncated);
    let adapter = adapter_for(ex.api);

    // A stream is rebuilt into the body a non-streamed call would have returned (a `Value`: reassembly merges
    // chunks); a non-streamed body is read like the request.
    let mut response_body = match &ex.response {
        Some(resp) => body_buffer(resp, &id, cap, &mut errors, &mut truncated),
        None => Bytes::new(),
    };
    let mut reassembled: Option<Value> = None;
    let mut raw_response = None;
    let mut damaged_stream = false;
    if let Some(resp) = &ex.response
        && is_event_stream(resp)
    {
        // Bedrock's binary event-stream: decoded into the events the adapter reassembles; the trace keeps them
        // as SSE text (the raw bytes are binary framing with checksums, of no use to a reader).
        let (messages, damage) = eventstream::decode(&response_body);
        if let Some(source) = damage {
            errors.push(ProcessError::EventStream { id: id.clone(), source });
            damaged_stream = true;
        }
        let events = eventstream::events(&messages);
        reassembled = Some(match adapter {
            Some(a) => a.reassemble(&events).unwrap_or_else(|source| {
                errors.push(ProcessError::Adapter { id: id.clone(), source });
                Value::Null
            }),
            None => Value::Null,
        });
        raw_response = Some(eventstream::to_sse_text(&events));
    } else if let Some(resp) = &ex.response {
        let text = match std::str::from_utf8(&response_body) {
            Ok(t) => std::borrow::Cow::Borrowed(t),
            Err(_) => String::from_utf8_lossy(&response_body),
        };
        let content_type = resp.header("content-type").unwrap_or("").to_ascii_lowercase();
        let sse =
            content_type.contains("text/event-stream") || (!content_type.contains("json") && looks_like_sse(&text));
        let json_array_stream =
            adapter.is_some_and(|a| a.streams_json_array(&ex.path)) && text.trim_start().starts_with('[');
        if sse || json_array_stream {
            let events = if sse {
                parse_events(&text)
            } else {
                vec![crate::capture::sse::SseEvent {
                    data: text.to_string(),
                    ..Default::default()
                }]
            };
            reassembled = Some(match adapter {
                Some(a) => a.reassemble(&events).unwrap_or_else(|source| {
                    errors.push(ProcessError::Adapter { id: id.clone(), source });
                    Value::Null
                }),
                None => Value::Null,
            });
            raw_response = Some(text.into_owned());
        }
    }
    let streamed = reassembled.is_some();
    // A damaged stream was forwarded as it came; what the capture holds of it is cut at the damage.
    if damaged_stream && ex.outcome == Outcome::Complete {
        ex.outcome = Outcome::Truncated;
    }
    let (response_view, response) = match &reassembled {
        Some(v) => (Json::from_value(v), JsonText::from_value(v)),
        None => read_body!(response_body, cap, &mut truncated),
    };
    if truncated {
        errors.push(ProcessError::DecodedOverCap { id: id.clone(), cap });
        if ex.outcome == Outcome::Complete {
            ex.outcome = Outcome::Truncated;
        }
    }

    let call = adapter.and_then(|a| {
        let path = ex.path.split('?').next().unwrap_or(&ex.path);
        let ctx = CallContext {
            path,
            status: ex.status,
        };
        a.normalize(&ctx, &request_view, &response_view)
            .map_err(|source| errors.push(ProcessError::Adapter { id: id.clone(), source }))
            .ok()
    });

    let model = call
        .as_ref()
        .and_then(|c| c.model_response.clone().or_else(|| c.model_requested.clone()))
        .or_else(|| request_view.owned_str("model"));
    drop((request_view, response_view));
    let error = ex.error.or_else(|| status_error(ex.status, call.as_ref()));
    // An error status is not a complete call: the provider refused or failed it. `status` keeps which status.
    if ex.outcome == Outcome::Complete && ex.status.is_some_and(|s| s >= 400) {
        ex.outcome = Outcome::UpstreamError;
    }
    // The adapter read the request as sent; what is kept has credentials the client put in the body removed.
    let request = match super::secrets::redact_json(request.as_str()) {
        Some(redacted) => JsonText::from_redacted(redacted),
        None => request,
    };
    let request_headers = ex.request.headers.to_pairs();
    let mut meta = ex.meta;
    meta.replay_of = request_headers
        .iter()
        .find(|(k, _)| k == REPLAY_OF_HEADER)
        .and_then(|(_, v)| replay_of_value(v));
    let trace = ProviderTrace {
        id,
        upstream: ex.upstream.to_string(),
        api: ex.api,
        method: ex.method.as_str().to_owned(),
        path: ex.path,
        status: ex.status,
        outcome: ex.outcome,
        error,
        streamed,
        timings: ex.timings,
        request_bytes: ex.request.len,
        response_bytes: ex.response.as_ref().map_or(0, |r| r.len),
        request_headers,
        response_headers: ex.response.map(|r| r.headers.to_pairs()).unwrap_or_default(),
        request,
        response,
        raw_response,
        meta,
        model,
        usage: call.as_ref().and_then(|c| c.usage),
        facts: call.as_ref().map(CallFacts::of),
        cost: None,
        trajectory_id: None,
        session_id: None,
    };
    Processed { trace, call, errors }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::capture::{Api, ExchangeMeta, Timings};

    const CAP: usize = 32 << 20;

    fn captured(content_type: &str, body: &'static [u8]) -> Captured {
        Captured {
            headers: [("content-type", content_type)].into_iter().collect(),
            body: [Bytes::from_static(body)].into(),
            len: body.len() as u64,
            truncated: false,
            ended: true,
            ..Default::default()
        }
    }

    fn exchange(status: u16, response: Captured) -> RawExchange {
        RawExchange {
            id: uuid::Uuid::from_u128(1),
            upstream: Arc::from("openai"),
            api: Api::OpenAiChat,
            method: http::Method::POST,
            path: "/v1/chat/completions".into(),
            status: Some(status),
            request: captured(
                "application/json",
                br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#,
            ),
            response: Some(response),
            timings: Timings::default(),
            outcome: Outcome::Complete,
            error: None,
            meta: ExchangeMeta::default(),
            charge: Default::default(),
        }
    }

    #[test]
    fn a_json_body_is_kept_as_received_and_read_through_the_view() {
        let p = process(exchange(
            200,
            captured(
                "application/json",
                br#"{"id":"c1","model":"gpt-4o-x","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"yo"}}]}"#,
            ),
        ), CAP);
        assert_eq!(
            p.trace.request.as_str(),
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#
        );
        let call = p.call.expect("normalized");
        assert_eq!(call.output.text.as_deref(), Some("yo"));
        assert_eq!(p.trace.model.as_deref(), Some("gpt-4o-x"));
        assert!(!p.trace.streamed);
    }

    #[test]
    fn a_non_json_error_page_is_kept_as_a_json_string_and_becomes_the_error_message() {
        let p = process(exchange(502, captured("text/html", b"<html>Bad gateway</html>")), CAP);
        assert_eq!(p.trace.response.as_str(), r#""<html>Bad gateway</html>""#);
        let call = p.call.expect("normalized");
        let error = call.error.expect("an error");
        assert_eq!(error.kind, "http_502");
        assert_eq!(error.message, "<html>Bad gateway</html>");
        assert_eq!(
            p.trace.error.as_deref(),
            Some("http_502: <html>Bad gateway</html>"),
            "an error status is the trace's error"
        );
        assert_eq!(
            p.trace.outcome,
            Outcome::UpstreamError,
            "an error status is not a complete call"
        );
        assert_eq!(p.trace.status, Some(502));
    }

    #[test]
    fn a_response_that_inflates_past_the_cap_is_kept_cut_and_marked_truncated() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&vec![b' '; 4 << 20]).unwrap();
        let body: &'static [u8] = Box::leak(gz.finish().unwrap().into_boxed_slice());
        let mut response = captured("application/json", body);
        response.headers.push("content-encoding", "gzip");
        let p = process(exchange(200, response), 1 << 20);
        assert_eq!(p.trace.outcome, Outcome::Truncated);
        assert!(
            p.errors
                .iter()
                .any(|e| matches!(e, ProcessError::DecodedOverCap { cap, .. } if *cap == 1 << 20)),
            "{:?}",
            p.errors.iter().map(ToString::to_string).collect::<Vec<_>>()
        );
    }
}
