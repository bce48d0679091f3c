//! RawExchange → ProviderTrace (+ the normalized call): decode bodies, reassemble streams, normalize.
//! Pure functions of one exchange; run on the pipeline thread, never on the async workers.

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::memo::ItemMemo;
use crate::capture::Api;
use crate::provider::{ItemOut, ItemWise};

use crate::capture::sse::{looks_like_sse, parse_events};
use crate::capture::{Captured, RawExchange, decode::decode_body};
use crate::model::call::NormalizedCall;
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

/// The common case without copying: one uncompressed frame that is valid JSON.
fn parse_in_place(c: &Captured) -> Option<Value> {
    if c.header("content-encoding")
        .is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
        || c.body.len() != 1
    {
        return None;
    }
    serde_json::from_slice(&c.body[0]).ok()
}

/// The pipeline's reader of exchanges; it remembers conversation items across calls (see `memo`).
#[derive(Default)]
pub struct Processor {
    memo: ItemMemo,
}

/// A request read on the fast path: its members other than the conversation, and the conversation's items.
struct FastRequest {
    rest: Value,
    items: Vec<ItemOut>,
    /// The whole body, kept verbatim for the store.
    body: bytes::Bytes,
}

impl Processor {
    /// Reads an item-wise request without building a tree for the conversation: one scan for the member
    /// boundaries, then each item from the memo or, if new, parsed and normalized. None when the body is not a
    /// single plain JSON object frame (then the general path reads it).
    fn fast_request(&mut self, api: Api, iw: &dyn ItemWise, c: &Captured) -> Option<FastRequest> {
        if c.header("content-encoding")
            .is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
            || c.truncated
        {
            return None;
        }
        // Bodies arrive in several frames more often than not; one copy joins them (cheap next to parsing).
        let body = match c.body.as_slice() {
            [one] => one.clone(),
            _ => bytes::Bytes::from(c.body_bytes()),
        };
        let top: Vec<(String, &RawValue)> = serde_json::from_slice::<RawMembers<'_>>(&body).ok()?.0;
        let key = iw.conversation_key();
        let mut rest = Map::with_capacity(top.len());
        let mut items = Vec::new();
        for (k, raw) in top {
            if k == key {
                let list: Vec<&RawValue> = serde_json::from_str(raw.get()).ok()?;
                items.reserve(list.len());
                for item in list {
                    let out = self.memo.get_or_read(api as u8, item.get().as_bytes(), || {
                        let v: Value = serde_json::from_str(item.get()).unwrap_or(Value::Null);
                        iw.normalize_item(&v)
                    });
                    items.push(out);
                }
            } else {
                rest.insert(k, serde_json::from_str(raw.get()).ok()?);
            }
        }
        Some(FastRequest {
            rest: Value::Object(rest),
            items,
            body: body.clone(),
        })
    }

    pub fn process(&mut self, ex: RawExchange) -> Processed {
        let adapter = adapter_for(ex.api);
        let fast = adapter
            .and_then(|a| a.item_wise())
            .and_then(|iw| Some((iw, self.fast_request(ex.api, iw, &ex.request)?)));
        process_with(ex, fast)
    }
}

/// A JSON object's members in order, values left unparsed.
struct RawMembers<'a>(Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for RawMembers<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = RawMembers<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, mut m: M) -> Result<Self::Value, M::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(8));
                while let Some((k, v)) = m.next_entry::<String, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(RawMembers(out))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// One exchange without memory of earlier ones (tests, tools); the pipeline uses a [`Processor`].
pub fn process(ex: RawExchange) -> Processed {
    process_with(ex, None)
}

fn process_with(ex: RawExchange, fast: Option<(&dyn ItemWise, FastRequest)>) -> Processed {
    let mut errors = Vec::new();
    let (request, request_json_text) = match &fast {
        Some((_, f)) => (Value::Null, Some(f.body.clone())),
        None => match parse_in_place(&ex.request) {
            Some(v) => (v, None),
            None => (json_or_text(&decoded_text(&ex.request, &ex.id, &mut errors)), None),
        },
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
        match fast {
            Some((iw, f)) => iw.normalize_rest(&ctx, &f.rest, f.items, &response),
            None => a.normalize(&ctx, &request, &response),
        }
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
        .or_else(|| request.get("model").and_then(Value::as_str).map(str::to_owned));
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
        request_json_text,
        response,
        raw_response,
        meta: ex.meta,
        model,
        usage: call.as_ref().and_then(|c| c.usage),
        trajectory_id: None,
    };
    Processed { trace, call, errors }
}
