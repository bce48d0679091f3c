//! What a socket's messages mean: Responses WebSocket mode and Realtime turns become exchanges shaped like the
//! HTTP calls the Responses adapter already reads; any other socket is kept raw.

use std::collections::VecDeque;

use bytes::Bytes;
use rustc_hash::FxHashMap;
use serde_json::{Map, Value, json};

use super::frames::Message;
use super::{Direction, Protocol, SocketInfo, api_of};
use crate::capture::{CaptureTx, Captured, HeaderList, Outcome, RawExchange, Timings, UnixMicros, exchange_id};

/// The trace header that says a request was rebuilt from a socket rather than captured as sent.
pub const RECONSTRUCTED_HEADER: &str = "x-llmtap-reconstructed";
/// The trace header naming the WebSocket protocol an exchange came from.
pub const WEBSOCKET_HEADER: &str = "x-llmtap-websocket";

/// Responses kept for `previous_response_id` chains, per socket (a Codex socket lives at most an hour).
const MAX_CHAIN: usize = 1024;

pub enum Session {
    Responses(Responses),
    Realtime(Realtime),
    Raw(Raw),
}

impl Session {
    pub fn new(info: &SocketInfo, socket_id: u64, cap: usize) -> Session {
        match info.protocol {
            Protocol::Responses => Session::Responses(Responses {
                cap,
                lanes: FxHashMap::default(),
                chain: FxHashMap::default(),
                chain_order: VecDeque::new(),
            }),
            Protocol::Realtime => Session::Realtime(Realtime {
                cap,
                socket_id,
                session: Map::new(),
                session_id: None,
                items: Vec::new(),
                pending: VecDeque::new(),
            }),
            Protocol::Raw => Session::Raw(Raw {
                cap,
                sides: Default::default(),
                first_byte: None,
                last: info.start,
            }),
        }
    }

    pub fn message(&mut self, info: &SocketInfo, direction: Direction, m: Message, capture: &CaptureTx) {
        match self {
            Session::Responses(s) => s.message(info, direction, m, capture),
            Session::Realtime(s) => s.message(info, direction, m, capture),
            Session::Raw(s) => s.message(direction, m),
        }
    }

    /// The socket ended: what is still pending is emitted, marked cut.
    pub fn close(self, info: &SocketInfo, cut: bool, now: UnixMicros, capture: &CaptureTx) {
        match self {
            Session::Responses(s) => {
                for (_, lane) in s.lanes {
                    for turn in lane {
                        let request = turn.request_body(None);
                        capture.try_send(turn.into_exchange(info, request, None, true, now, closed_error(cut)));
                    }
                }
            }
            Session::Realtime(mut s) => {
                while let Some(turn) = s.pending.pop_front() {
                    let request = turn.request.clone();
                    let meta_session = s.session_name();
                    let mut ex =
                        turn.into_exchange(info, request, Some("realtime session"), true, now, closed_error(cut));
                    ex.meta.session = ex.meta.session.or(Some(meta_session));
                    capture.try_send(ex);
                }
            }
            Session::Raw(s) => capture.try_send(s.into_exchange(info, cut, now)),
        }
    }
}

fn closed_error(cut: bool) -> Option<String> {
    Some(if cut {
        "capture of the WebSocket fell behind (budget or queue full); the rest of the socket was forwarded uncaptured"
            .to_owned()
    } else {
        "the WebSocket closed before the response ended".to_owned()
    })
}

/// A message's text as JSON, or None (binary, cut, or not JSON).
fn json_of(m: &Message) -> Option<Map<String, Value>> {
    if !m.text {
        return None;
    }
    match serde_json::from_slice(&m.data) {
        Ok(Value::Object(o)) => Some(o),
        _ => None,
    }
}

fn str_of<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    o.get(key).and_then(Value::as_str)
}

/// Whether a cut message's kept prefix names `kind` as its type.
fn prefix_names(m: &Message, kind: &str) -> bool {
    let head = &m.data[..m.data.len().min(256)];
    let needle = format!("\"{kind}\"");
    head.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// A request's `input` as a list of items (a string is one user message).
fn input_items(input: Option<&Value>) -> Vec<Value> {
    match input {
        Some(Value::Array(items)) => items.clone(),
        Some(Value::String(text)) => vec![json!({"type": "message", "role": "user", "content": text})],
        _ => Vec::new(),
    }
}

/// One response on a socket, from its request to its last event.
struct Turn {
    /// The request as sent (its `type` and the socket-only `stream_id` removed); None when the message was cut.
    request: Map<String, Value>,
    request_truncated: bool,
    start: UnixMicros,
    first_byte: Option<UnixMicros>,
    /// The server's events as an SSE stream (what `POST /v1/responses` with `stream: true` returns).
    events: String,
    events_truncated: bool,
    response_id: Option<String>,
    output: Vec<Value>,
    error: Option<String>,
    cap: usize,
}

impl Turn {
    fn new(request: Map<String, Value>, truncated: bool, at: UnixMicros, cap: usize) -> Turn {
        Turn {
            request,
            request_truncated: truncated,
            start: at,
            first_byte: None,
            events: String::new(),
            events_truncated: false,
            response_id: None,
            output: Vec::new(),
            error: None,
            cap,
        }
    }

    /// Keeps one server event in SSE form (`data:` must be one line: a pretty-printed event is re-serialized).
    fn push_event(&mut self, kind: &str, raw: &[u8], value: &Map<String, Value>, at: UnixMicros) {
        self.first_byte.get_or_insert(at);
        let data = match std::str::from_utf8(raw) {
            Ok(text) if !text.contains('\n') => std::borrow::Cow::Borrowed(text),
            _ => std::borrow::Cow::Owned(Value::Object(value.clone()).to_string()),
        };
        let add = kind.len() + data.len() + 16;
        if self.events.len() + add > self.cap {
            self.events_truncated = true;
            return;
        }
        self.events.push_str("event: ");
        self.events.push_str(kind);
        self.events.push_str("\ndata: ");
        self.events.push_str(&data);
        self.events.push_str("\n\n");
    }

    fn request_body(&self, input: Option<Vec<Value>>) -> Map<String, Value> {
        let mut body = self.request.clone();
        if let Some(input) = input {
            body.insert("input".into(), Value::Array(input));
            body.remove("previous_response_id");
        }
        body
    }

    fn into_exchange(
        self,
        info: &SocketInfo,
        request: Map<String, Value>,
        reconstructed: Option<&str>,
        unfinished: bool,
        end: UnixMicros,
        closed: Option<String>,
    ) -> RawExchange {
        let truncated = self.request_truncated || self.events_truncated || unfinished;
        let mut request_headers = info.request_headers.clone();
        request_headers.push(
            WEBSOCKET_HEADER,
            match info.protocol {
                Protocol::Realtime => "realtime",
                _ => "responses",
            },
        );
        if let Some(r) = reconstructed {
            request_headers.push(RECONSTRUCTED_HEADER, r);
        }
        let body = Value::Object(request).to_string().into_bytes();
        let mut response_headers = info.response_headers.clone();
        response_headers.push("content-type", "text/event-stream");
        let error = if unfinished { closed } else { self.error };
        RawExchange {
            id: exchange_id(self.start),
            upstream: info.upstream.clone(),
            api: api_of(info.protocol),
            method: http::Method::GET,
            path: info.path.clone(),
            status: Some(101),
            request: captured(request_headers, body, self.request_truncated),
            response: Some(captured(
                response_headers,
                self.events.into_bytes(),
                self.events_truncated || unfinished,
            )),
            timings: Timings {
                start: self.start,
                first_byte: self.first_byte,
                end,
            },
            outcome: if truncated {
                Outcome::Truncated
            } else {
                Outcome::Complete
            },
            error,
            meta: info.meta.clone(),
            charge: Default::default(),
        }
    }
}

fn captured(headers: HeaderList, body: Vec<u8>, truncated: bool) -> Captured {
    let len = body.len() as u64;
    Captured {
        headers,
        body: smallvec::smallvec![Bytes::from(body)],
        len,
        truncated,
        ended: !truncated,
        charge: Default::default(),
    }
}

/// An error event's message, for the trace.
fn error_text(event: &Map<String, Value>) -> String {
    let e = event
        .get("error")
        .or_else(|| event.get("response").and_then(|r| r.get("error")))
        .unwrap_or(&Value::Null);
    let code = e
        .get("code")
        .or_else(|| e.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("error");
    let message = e.get("message").and_then(Value::as_str).unwrap_or("");
    format!("{code}: {message}")
}

/// A response of the socket, for `previous_response_id`: its own new input and output, and what it continued.
struct Link {
    parent: Option<String>,
    items: Vec<Value>,
}

/// Responses WebSocket mode. Requests with the same `stream_id` are answered in order and the server's events
/// echo the `stream_id`, so each lane is a FIFO of turns; `previous_response_id` may point across lanes.
pub struct Responses {
    cap: usize,
    lanes: FxHashMap<String, VecDeque<Turn>>,
    chain: FxHashMap<String, Link>,
    chain_order: VecDeque<String>,
}

impl Responses {
    fn message(&mut self, info: &SocketInfo, direction: Direction, m: Message, capture: &CaptureTx) {
        let parsed = json_of(&m);
        match direction {
            Direction::FromClient => {
                let Some(mut event) = parsed else {
                    if m.truncated && prefix_names(&m, "response.create") {
                        // Too long to keep whole: its events still need a turn to land in.
                        let turn = Turn::new(Map::new(), true, m.at, self.cap);
                        self.lanes.entry(String::new()).or_default().push_back(turn);
                    }
                    return;
                };
                if str_of(&event, "type") != Some("response.create") {
                    return;
                }
                event.remove("type");
                // Some clients nest the parameters under `response`.
                if let Some(Value::Object(inner)) = event.remove("response") {
                    for (k, v) in inner {
                        event.entry(k).or_insert(v);
                    }
                }
                let lane = match event.remove("stream_id") {
                    Some(Value::String(s)) => s,
                    _ => String::new(),
                };
                let turn = Turn::new(event, m.truncated, m.at, self.cap);
                self.lanes.entry(lane).or_default().push_back(turn);
            }
            Direction::FromUpstream => {
                let Some(event) = parsed else {
                    if m.truncated {
                        // An event too long to keep: the turn it belongs to cannot be told; all pending are cut.
                        for turn in self.lanes.values_mut().flatten() {
                            turn.events_truncated = true;
                        }
                    }
                    return;
                };
                let kind = str_of(&event, "type").unwrap_or("").to_owned();
                let lane = str_of(&event, "stream_id")
                    .or_else(|| {
                        event
                            .get("response")
                            .and_then(|r| r.get("stream_id"))
                            .and_then(Value::as_str)
                    })
                    .unwrap_or("")
                    .to_owned();
                let key = if self.lanes.get(&lane).is_some_and(|l| !l.is_empty()) {
                    lane
                } else {
                    // No lane named (or an unknown one): the only lane with a turn waiting, if there is one.
                    let mut busy = self.lanes.iter().filter(|(_, l)| !l.is_empty()).map(|(k, _)| k);
                    match (busy.next(), busy.next()) {
                        (Some(only), None) => only.clone(),
                        _ => return,
                    }
                };
                let Some(turn) = self.lanes.get_mut(&key).and_then(|l| l.front_mut()) else {
                    return;
                };
                turn.push_event(&kind, &m.data, &event, m.at);
                if m.truncated {
                    turn.events_truncated = true;
                }
                let response = event.get("response").and_then(Value::as_object);
                if let Some(id) = response.and_then(|r| str_of(r, "id")) {
                    turn.response_id = Some(id.to_owned());
                }
                if kind == "response.output_item.done"
                    && let Some(item) = event.get("item")
                {
                    turn.output.push(item.clone());
                }
                let terminal = matches!(
                    kind.as_str(),
                    "response.completed" | "response.incomplete" | "response.failed" | "error"
                );
                if !terminal {
                    return;
                }
                if let Some(output) = response.and_then(|r| r.get("output")).and_then(Value::as_array)
                    && !output.is_empty()
                {
                    turn.output = output.clone();
                }
                if kind == "response.failed" || kind == "error" {
                    turn.error = Some(error_text(&event));
                }
                if let Some(turn) = self.lanes.get_mut(&key).and_then(VecDeque::pop_front) {
                    self.finish(info, turn, m.at, capture);
                }
            }
        }
    }

    /// The input of `response_id`'s whole conversation on this socket and what it returned, oldest first; None
    /// if the chain leaves the socket's memory (a response from another socket or an HTTP call).
    fn history(&self, response_id: &str) -> Option<Vec<Value>> {
        let mut links = Vec::new();
        let mut at = Some(response_id);
        while let Some(id) = at {
            let link = self.chain.get(id)?;
            links.push(link);
            at = link.parent.as_deref();
            if links.len() > MAX_CHAIN {
                return None;
            }
        }
        Some(links.iter().rev().flat_map(|l| l.items.iter().cloned()).collect())
    }

    fn finish(&mut self, info: &SocketInfo, turn: Turn, end: UnixMicros, capture: &CaptureTx) {
        let previous = str_of(&turn.request, "previous_response_id").map(str::to_owned);
        let new_input = input_items(turn.request.get("input"));
        let earlier = previous.as_deref().and_then(|p| self.history(p));
        let reconstructed = previous
            .as_ref()
            .filter(|_| earlier.is_some())
            .map(|p| format!("previous_response_id={p}"));
        let request = match earlier {
            Some(mut items) => {
                items.extend(new_input.iter().cloned());
                turn.request_body(Some(items))
            }
            None => turn.request_body(None),
        };
        if let Some(id) = turn.response_id.clone() {
            let mut items = new_input;
            items.extend(turn.output.iter().cloned());
            if self
                .chain
                .insert(
                    id.clone(),
                    Link {
                        parent: previous,
                        items,
                    },
                )
                .is_none()
            {
                self.chain_order.push_back(id);
            }
            while self.chain_order.len() > MAX_CHAIN {
                if let Some(old) = self.chain_order.pop_front() {
                    self.chain.remove(&old);
                }
            }
        }
        capture.try_send(turn.into_exchange(info, request, reconstructed.as_deref(), false, end, None));
    }
}

/// A Realtime session: the conversation is the socket's, built from the client's `conversation.item.create`
/// and each response's output; `session.update` / `session.created` give the instructions, tools and model.
pub struct Realtime {
    cap: usize,
    socket_id: u64,
    session: Map<String, Value>,
    session_id: Option<String>,
    items: Vec<Value>,
    pending: VecDeque<Turn>,
}

/// A Realtime conversation item in the Responses input vocabulary (text parts, audio by its transcript).
fn responses_item(item: &Value) -> Value {
    let mut item = item.clone();
    if let Some(Value::Object(o)) = Some(&mut item) {
        o.remove("object");
        o.remove("status");
        let assistant = str_of(o, "role") == Some("assistant");
        if let Some(Value::Array(parts)) = o.get_mut("content") {
            for part in parts.iter_mut() {
                let Some(p) = part.as_object_mut() else { continue };
                let kind = str_of(p, "type").unwrap_or("").to_owned();
                let text = str_of(p, "text").or_else(|| str_of(p, "transcript")).map(str::to_owned);
                let new_kind = match (kind.as_str(), assistant) {
                    ("text" | "output_text" | "audio" | "output_audio", true) => "output_text",
                    ("input_text" | "text" | "input_audio", false) => "input_text",
                    _ => continue,
                };
                *part = json!({"type": new_kind, "text": text.unwrap_or_default()});
            }
        }
    }
    item
}

/// `response.done`'s usage with the Responses names added (`input_token_details` → `input_tokens_details`).
fn responses_usage(usage: &Value) -> Value {
    let mut u = usage.clone();
    if let Some(o) = u.as_object_mut() {
        if let Some(d) = o.get("input_token_details").cloned() {
            o.entry("input_tokens_details").or_insert(d);
        }
        if let Some(d) = o.get("output_token_details").cloned() {
            o.entry("output_tokens_details").or_insert(d);
        }
    }
    u
}

impl Realtime {
    fn session_name(&self) -> String {
        self.session_id
            .clone()
            .unwrap_or_else(|| format!("ws-{}", self.socket_id))
    }

    fn message(&mut self, info: &SocketInfo, direction: Direction, m: Message, capture: &CaptureTx) {
        let Some(event) = json_of(&m) else {
            if m.truncated {
                match direction {
                    Direction::FromClient if prefix_names(&m, "response.create") => {
                        let turn = Turn::new(Map::new(), true, m.at, self.cap);
                        self.pending.push_back(turn);
                    }
                    Direction::FromUpstream => {
                        for t in &mut self.pending {
                            t.events_truncated = true;
                        }
                    }
                    _ => {}
                }
            }
            return;
        };
        let kind = str_of(&event, "type").unwrap_or("").to_owned();
        match (direction, kind.as_str()) {
            (Direction::FromClient, "session.update")
            | (Direction::FromUpstream, "session.created" | "session.updated") => {
                if let Some(Value::Object(s)) = event.get("session") {
                    if direction == Direction::FromUpstream
                        && let Some(id) = str_of(s, "id")
                    {
                        self.session_id = Some(id.to_owned());
                    }
                    for key in ["model", "instructions", "tools", "tool_choice", "temperature"] {
                        if let Some(v) = s.get(key) {
                            self.session.insert(key.into(), v.clone());
                        }
                    }
                }
            }
            (Direction::FromClient, "conversation.item.create") => {
                if let Some(item) = event.get("item") {
                    self.items.push(responses_item(item));
                }
            }
            (Direction::FromClient, "response.create") => {
                let params = event
                    .get("response")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                let mut request = self.session.clone();
                if !request.contains_key("model")
                    && let Some(model) = model_in_query(&info.path)
                {
                    request.insert("model".into(), Value::String(model));
                }
                let own_input = str_of(&params, "conversation") == Some("none");
                for (k, v) in params {
                    if k != "conversation" && k != "input" {
                        request.insert(k, v);
                    }
                }
                let input: Vec<Value> = if own_input {
                    input_items(event.get("response").and_then(|r| r.get("input")))
                        .iter()
                        .map(responses_item)
                        .collect()
                } else {
                    self.items.clone()
                };
                request.insert("input".into(), Value::Array(input));
                request.insert("stream".into(), Value::Bool(true));
                self.pending.push_back(Turn::new(request, m.truncated, m.at, self.cap));
            }
            (Direction::FromUpstream, _) if kind.starts_with("response.") => {
                let Some(turn) = self.pending.front_mut() else {
                    return;
                };
                turn.push_event(&kind, &m.data, &event, m.at);
                if kind != "response.done" {
                    return;
                }
                let Some(mut turn) = self.pending.pop_front() else {
                    return;
                };
                let mut response = event.get("response").cloned().unwrap_or(Value::Null);
                if let Some(r) = response.as_object_mut() {
                    let output: Vec<Value> = r
                        .get("output")
                        .and_then(Value::as_array)
                        .map(|o| o.iter().map(responses_item).collect())
                        .unwrap_or_default();
                    self.items.extend(output.iter().cloned());
                    r.insert("output".into(), Value::Array(output));
                    if let Some(u) = r.get("usage").map(responses_usage) {
                        r.insert("usage".into(), u);
                    }
                    if str_of(r, "status") == Some("failed") {
                        turn.error = Some(error_text(&event));
                    }
                    if !r.contains_key("model")
                        && let Some(m) = turn.request.get("model")
                    {
                        r.insert("model".into(), m.clone());
                    }
                }
                // The terminal event the Responses adapter reads.
                let completed = json!({"type": "response.completed", "response": response});
                let text = completed.to_string();
                if let Some(o) = completed.as_object() {
                    turn.push_event("response.completed", text.as_bytes(), o, m.at);
                }
                let request = turn.request.clone();
                let mut ex = turn.into_exchange(info, request, Some("realtime session"), false, m.at, None);
                ex.meta.session = ex.meta.session.or(Some(self.session_name()));
                capture.try_send(ex);
            }
            _ => {}
        }
    }
}

fn model_in_query(path: &str) -> Option<String> {
    let query = path.split_once('?')?.1;
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix("model="))
        .map(|m| percent_encoding::percent_decode_str(m).decode_utf8_lossy().into_owned())
}

/// Any other socket: each direction's messages, one per line (binary ones as `<binary N bytes>`), kept up to the
/// cap and emitted as one exchange when the socket closes.
pub struct Raw {
    cap: usize,
    /// (kept text, bytes seen, truncated) per direction.
    sides: [(Vec<u8>, u64, bool); 2],
    first_byte: Option<UnixMicros>,
    last: UnixMicros,
}

impl Raw {
    fn message(&mut self, direction: Direction, m: Message) {
        if direction == Direction::FromUpstream {
            self.first_byte.get_or_insert(m.at);
        }
        self.last = self.last.max(m.at);
        let (kept, seen, truncated) = &mut self.sides[direction.index()];
        *seen += m.len;
        *truncated |= m.truncated;
        let line: std::borrow::Cow<[u8]> = if m.text {
            std::borrow::Cow::Borrowed(&m.data)
        } else {
            std::borrow::Cow::Owned(format!("<binary {} bytes>", m.len).into_bytes())
        };
        if kept.len() + line.len() + 1 > self.cap {
            *truncated = true;
            return;
        }
        kept.extend_from_slice(&line);
        kept.push(b'\n');
    }

    fn into_exchange(self, info: &SocketInfo, cut: bool, now: UnixMicros) -> RawExchange {
        let [(client, client_len, client_cut), (server, server_len, server_cut)] = self.sides;
        let mut request_headers = info.request_headers.clone();
        request_headers.push(WEBSOCKET_HEADER, "raw");
        let mut request = captured(request_headers, client, client_cut || cut);
        request.len = client_len;
        let mut response = captured(info.response_headers.clone(), server, server_cut || cut);
        response.len = server_len;
        let truncated = request.truncated || response.truncated;
        RawExchange {
            id: exchange_id(info.start),
            upstream: info.upstream.clone(),
            api: api_of(info.protocol),
            method: http::Method::GET,
            path: info.path.clone(),
            status: Some(101),
            request,
            response: Some(response),
            timings: Timings {
                start: info.start,
                first_byte: self.first_byte,
                end: now.max(self.last),
            },
            outcome: if truncated {
                Outcome::Truncated
            } else {
                Outcome::Complete
            },
            error: cut.then(|| "capture of the WebSocket fell behind; messages after that were not kept".to_owned()),
            meta: info.meta.clone(),
            charge: Default::default(),
        }
    }
}
