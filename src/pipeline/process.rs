//! RawExchange → ProviderTrace (+ the normalized call): decode bodies, reassemble streams, normalize.
//! Pure functions of one exchange; run on the pipeline thread, never on the async workers.

use bytes::Bytes;
use serde_json::Value;

use crate::capture::sse::{looks_like_sse, parse_events};
use crate::capture::{Captured, RawExchange, decode::decode_body};
use crate::model::call::NormalizedCall;
use crate::model::json::{Json, JsonText};
use crate::model::trace::ProviderTrace;
use crate::provider::{CallContext, adapter_for};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("exchange {id}: {what}")]
    Body { id: String, what: String },
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

fn decoded_text(c: &Captured, id: &str, errors: &mut Vec<ProcessError>) -> String {
    let raw = c.body_bytes();
    let bytes = match decode_body(c.header("content-encoding"), raw) {
        Ok(b) => b,
        Err(e) => {
            errors.push(ProcessError::Body {
                id: id.to_owned(),
                what: e.to_string(),
            });
            c.body_bytes()
        }
    };
    match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }
}

/// JSON if it parses; otherwise the text as a JSON string; Null if empty.
fn json_or_text(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

/// The body as one buffer: the captured frame itself when it is a single uncompressed one (no copy), else the
/// frames decoded and joined.
fn body_buffer(c: &Captured, id: &str, errors: &mut Vec<ProcessError>) -> Bytes {
    let identity = c
        .header("content-encoding")
        .is_none_or(|e| e.eq_ignore_ascii_case("identity"));
    if identity && c.body.len() == 1 {
        return c.body[0].clone();
    }
    Bytes::from(decoded_text(c, id, errors))
}

pub fn process(ex: RawExchange) -> Processed {
    let mut errors = Vec::new();
    let request_body = body_buffer(&ex.request, &ex.id, &mut errors);
    // The request is read through a borrowed view and kept as its own text: no `Value` tree is built for it.
    let (request_view, request) = match JsonText::parse(&request_body) {
        Some(parsed) => parsed,
        None => {
            let text = String::from_utf8_lossy(&request_body);
            let v = json_or_text(&text);
            (Json::from_value(&Value::Null), JsonText::from_value(&v))
        }
    };
    let adapter = adapter_for(ex.api);

    let (response, raw_response, streamed) = match &ex.response {
        None => (Value::Null, None, false),
        Some(resp) => {
            let text = decoded_text(resp, &ex.id, &mut errors);
            let content_type = resp.header("content-type").unwrap_or("").to_ascii_lowercase();
            let sse =
                content_type.contains("text/event-stream") || (!content_type.contains("json") && looks_like_sse(&text));
            // Gemini without ?alt=sse streams one JSON array of chunks.
            let json_array_stream = ex.path.contains(":streamGenerateContent") && text.trim_start().starts_with('[');
            if sse || json_array_stream {
                let events = if sse {
                    parse_events(&text)
                } else {
                    vec![crate::capture::sse::SseEvent {
                        data: text.clone(),
                        ..Default::default()
                    }]
                };
                let reassembled = match adapter {
                    Some(a) => a.reassemble(&events).unwrap_or_else(|source| {
                        errors.push(ProcessError::Adapter {
                            id: ex.id.clone(),
                            source,
                        });
                        Value::Null
                    }),
                    None => Value::Null,
                };
                (reassembled, Some(text), true)
            } else {
                (json_or_text(&text), None, false)
            }
        }
    };

    let call = adapter.and_then(|a| {
        let path = ex.path.split('?').next().unwrap_or(&ex.path);
        let ctx = CallContext {
            path,
            status: ex.status,
        };
        a.normalize(&ctx, &request_view, &Json::from_value(&response))
            .map_err(|source| {
                errors.push(ProcessError::Adapter {
                    id: ex.id.clone(),
                    source,
                })
            })
            .ok()
    });

    let model = call
        .as_ref()
        .and_then(|c| c.model_response.clone().or_else(|| c.model_requested.clone()))
        .or_else(|| request_view.owned_str("model"));
    drop(request_view);
    let trace = ProviderTrace {
        id: ex.id,
        upstream: ex.upstream.to_string(),
        api: ex.api,
        method: ex.method,
        path: ex.path,
        status: ex.status,
        outcome: ex.outcome,
        error: ex.error,
        streamed,
        timings: ex.timings,
        request_bytes: ex.request.len,
        response_bytes: ex.response.as_ref().map_or(0, |r| r.len),
        request_headers: ex.request.headers,
        response_headers: ex.response.map(|r| r.headers).unwrap_or_default(),
        request,
        response,
        raw_response,
        meta: ex.meta,
        model,
        usage: call.as_ref().and_then(|c| c.usage),
        trajectory_id: None,
    };
    Processed { trace, call, errors }
}
