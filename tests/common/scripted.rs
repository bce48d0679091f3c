//! A scripted upstream: a model stand-in that answers whatever a real client sends, so agent clients can run
//! their multi-step loops through llmtap without the internet.
//!
//! It speaks the four API shapes (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses, Gemini
//! generateContent / streamGenerateContent), streamed in each provider's framing (Anthropic and Responses named
//! SSE events, Chat `data:` chunks ending in `[DONE]`, Gemini `\r\n`-separated SSE with `alt=sse` or one JSON
//! array without) or as one JSON body, with provider-style ids and usage (cache tokens included). The Anthropic
//! body is also answered on the cloud routes: Bedrock's `/model/{id}/invoke` and `/invoke-with-response-stream`
//! (the stream in AWS event-stream framing, each event a base64 `chunk`) and Vertex's `:rawPredict` /
//! `:streamRawPredict`, the model taken from the path.
//!
//! What it answers is decided by the conversation:
//! - the request offers tools and fewer tool rounds than wanted followed the latest user text: a call of one
//!   tool, its arguments made from the tool's JSON schema (a shell tool gets `echo hi`);
//! - otherwise text (`SCRIPTED_TEXT`).
//!
//! Directives in the latest user text steer it: `[[tool:NAME]]` picks the tool (e.g. Claude Code's `Task`, an
//! Agents SDK handoff `transfer_to_...`), `[[steps:N]]` asks for N tool rounds before the text, `[[status:N]]`
//! answers with that HTTP error status. The header `x-scripted-status` does the same as the last one, and
//! `x-scripted-no-length` leaves `content-length` out of the answer. Without a
//! directive the tool is the first shell-like one, else the first that is not a delegation (`Task`, `Agent`,
//! `transfer_to_*`).
//!
//! Side endpoints answer sensibly: Anthropic `count_tokens`, the model lists (also to `HEAD`: a GET's headers, no
//! body).
//! Everything it sent is kept in [`Scripted::sent`], so tests compare it with what llmtap stored.

use std::ops::Deref;
use std::sync::atomic::AtomicU64;

use serde_json::{Map, json};

use super::*;

/// The text of every final answer.
pub const SCRIPTED_TEXT: &str = "Done: the command printed hi.";

/// One response the scripted upstream sent.
#[derive(Debug, Clone)]
pub struct Sent {
    /// Its number, in the order requests arrived (from 1).
    pub n: u64,
    pub method: String,
    /// Path and query as the upstream received it.
    pub path: String,
    pub status: u16,
    pub streamed: bool,
    /// The response body bytes exactly as sent (all frames joined).
    pub body: Vec<u8>,
    /// The provider-native usage object it reported (None for side endpoints and errors).
    pub usage: Option<Value>,
    /// The tool it called, if any.
    pub tool: Option<String>,
    /// The request body it answered.
    pub request: Value,
}

pub struct Scripted {
    pub upstream: Upstream,
    pub sent: Arc<Mutex<Vec<Sent>>>,
}

impl Deref for Scripted {
    type Target = Upstream;
    fn deref(&self) -> &Upstream {
        &self.upstream
    }
}

impl Sent {
    /// The `request-id` response header it sent (stored by llmtap with the trace's response headers).
    pub fn request_id(&self) -> String {
        format!("req_scripted{:012}", self.n)
    }

    /// The usage it reported, as llmtap's provider-independent (input incl. cache, output, cache read).
    pub fn expected_usage(&self) -> Option<(u64, u64, u64)> {
        let u = self.usage.as_ref().filter(|u| !u.is_null())?;
        let n = |k: &str| u[k].as_u64().unwrap_or(0);
        Some(if u.get("promptTokenCount").is_some() {
            (
                n("promptTokenCount"),
                n("candidatesTokenCount"),
                n("cachedContentTokenCount"),
            )
        } else if u.get("prompt_tokens").is_some() {
            (
                n("prompt_tokens"),
                n("completion_tokens"),
                u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
            )
        } else if u.get("cache_read_input_tokens").is_some() {
            (
                n("input_tokens") + n("cache_read_input_tokens") + n("cache_creation_input_tokens"),
                n("output_tokens"),
                n("cache_read_input_tokens"),
            )
        } else {
            (
                n("input_tokens"),
                n("output_tokens"),
                u["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
            )
        })
    }
}

impl Scripted {
    /// Every exchange the upstream answered was captured by `tap`: the same status, the bytes as sent (a stream's
    /// text exactly, a JSON body's value), the usage the upstream reported. Returns the provider traces.
    pub fn assert_captured(&self, tap: &Llmtap) -> Vec<Value> {
        let sent = self.sent();
        let traces = tap.wait_for_traces(sent.len());
        assert_eq!(traces.len(), sent.len(), "one trace per upstream exchange");
        for s in &sent {
            let id = s.request_id();
            let t = traces
                .iter()
                .find(|t| t["headers"]["response"]["request-id"] == id.as_str())
                .unwrap_or_else(|| panic!("no trace for {} {} ({id})", s.method, s.path));
            assert_eq!(t["status"], s.status, "{}", s.path);
            let outcome = if s.status >= 400 { "upstream_error" } else { "complete" };
            assert_eq!(t["outcome"], outcome, "{}: {t:#}", s.path);
            if s.status >= 400 {
                assert!(t["error"].is_string(), "an error status is the trace's error: {t:#}");
            }
            if s.streamed {
                assert_eq!(t["streamed"], true);
                let raw = stored_raw_response(&tap.data_dir, t["id"].as_str().unwrap()).unwrap();
                // Bedrock's binary event-stream is kept as its events in SSE text (README, Cloud routes).
                let want = if s
                    .path
                    .split('?')
                    .next()
                    .unwrap_or("")
                    .ends_with("/invoke-with-response-stream")
                {
                    use llmtap::provider::eventstream;
                    let (messages, damage) = eventstream::decode(&s.body);
                    assert_eq!(damage, None);
                    eventstream::to_sse_text(&eventstream::events(&messages)).into_bytes()
                } else {
                    s.body.clone()
                };
                assert_eq!(
                    raw.as_bytes(),
                    want.as_slice(),
                    "{}: the stream is stored as sent",
                    s.path
                );
            } else if !s.body.is_empty() {
                assert_eq!(
                    t["response"],
                    serde_json::from_slice::<Value>(&s.body).unwrap(),
                    "{}",
                    s.path
                );
            }
            if let Some((input, output, cache_read)) = s.expected_usage() {
                assert_eq!(t["usage"]["input"], input, "{}: {}", s.path, t["usage"]);
                assert_eq!(t["usage"]["output"], output, "{}", s.path);
                assert_eq!(t["usage"]["cache_read"].as_u64().unwrap_or(0), cache_read, "{}", s.path);
            }
        }
        traces
    }

    /// Over HTTPS (HTTP/2 or HTTP/1.1, as llmtap negotiates), as providers serve.
    pub async fn start() -> Scripted {
        Self::start_with(true).await
    }

    /// Over plain HTTP/1.1 (an `http://` upstream, e.g. a local model server).
    pub async fn start_plain() -> Scripted {
        Self::start_with(false).await
    }

    async fn start_with(tls: bool) -> Scripted {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = sent.clone();
        let rec = received.clone();
        let counter = Arc::new(AtomicU64::new(1));
        let upstream = serve("127.0.0.1:0".parse().unwrap(), tls, received, move |req| {
            answer(req, rec.clone(), log.clone(), counter.clone())
        })
        .await;
        Scripted { upstream, sent }
    }

    pub fn sent(&self) -> Vec<Sent> {
        self.sent.lock().unwrap().clone()
    }

    /// One line per answer sent, for assertion messages.
    pub fn dump(&self) -> String {
        self.sent()
            .iter()
            .map(|s| {
                format!(
                    "#{} {} {} streamed={} tool={:?}",
                    s.n, s.method, s.path, s.streamed, s.tool
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The model calls only (side endpoints left out).
    pub fn model_calls(&self) -> Vec<Sent> {
        self.sent().into_iter().filter(|s| s.usage.is_some()).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Anthropic,
    Chat,
    Responses,
    Gemini,
}

/// What the conversation asks for, read the same way for every API shape.
#[derive(Debug, Default)]
struct Ask {
    /// (name, JSON schema of the arguments)
    tools: Vec<(String, Value)>,
    latest_user_text: String,
    /// Tool-result messages after the latest user text.
    tool_rounds: usize,
    model: String,
    stream: bool,
}

enum Decision {
    Text,
    Tool { name: String, args: Value },
}

struct Reply {
    status: u16,
    content_type: &'static str,
    frames: Vec<Bytes>,
    usage: Option<Value>,
    tool: Option<String>,
    streamed: bool,
}

impl Reply {
    fn json(status: u16, v: Value) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            frames: vec![Bytes::from(serde_json::to_vec(&v).unwrap())],
            usage: None,
            tool: None,
            streamed: false,
        }
    }
}

async fn answer(
    req: Request<Incoming>,
    received: Arc<Mutex<Vec<Received>>>,
    sent: Arc<Mutex<Vec<Sent>>>,
    counter: Arc<AtomicU64>,
) -> Result<Response<ChannelBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    received.lock().unwrap().push(Received {
        fixture: None,
        method: parts.method.to_string(),
        path: path.clone(),
        headers: parts.headers.clone(),
        authority: authority_of(&parts),
        body: body.clone(),
        body_matched: false,
        cancelled: Arc::new(AtomicBool::new(false)),
    });
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let n = counter.fetch_add(1, Ordering::SeqCst);
    let forced_status = parts
        .headers
        .get("x-scripted-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u16>().ok());
    let reply = reply_for(
        &parts.method,
        &path,
        &parts.headers,
        &request,
        body.len(),
        n,
        forced_status,
    );

    let mut resp = Response::new(ChannelBody(mpsc::channel(1).1));
    *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap();
    let (tx, rx) = mpsc::channel(reply.frames.len().max(1));
    *resp.body_mut() = ChannelBody(rx);
    let head = parts.method == http::Method::HEAD;
    resp.headers_mut()
        .insert("content-type", reply.content_type.parse().unwrap());
    resp.headers_mut()
        .insert("request-id", format!("req_scripted{n:012}").parse().unwrap());
    // `x-scripted-close`: the upstream ends the connection after this answer (and says so).
    if parts.headers.contains_key("x-scripted-close") {
        resp.headers_mut().insert("connection", "close".parse().unwrap());
    }
    // A HEAD answer has the headers a GET would have, its length included (RFC 9110 §9.3.2), and no body.
    // `x-scripted-no-length` leaves the length out (a chunked answer, or a HEAD that does not announce one).
    if !reply.streamed && !parts.headers.contains_key("x-scripted-no-length") {
        let len: usize = reply.frames.iter().map(Bytes::len).sum();
        resp.headers_mut().insert("content-length", len.into());
    }
    sent.lock().unwrap().push(Sent {
        n,
        method: parts.method.to_string(),
        path,
        status: reply.status,
        streamed: reply.streamed,
        body: if head {
            Vec::new()
        } else {
            reply.frames.iter().flat_map(|f| f.iter().copied()).collect()
        },
        usage: reply.usage.clone(),
        tool: reply.tool.clone(),
        request,
    });
    if !head {
        for f in reply.frames {
            let _ = tx.try_send(Ok(Frame::data(f)));
        }
    }
    Ok(resp)
}

fn shape_of(method: &http::Method, path: &str) -> Option<Shape> {
    let p = path.split('?').next().unwrap_or(path);
    if method != http::Method::POST {
        return None;
    }
    if p.ends_with("/messages") || is_bedrock_invoke(p) || p.contains(":rawPredict") || p.contains(":streamRawPredict")
    {
        Some(Shape::Anthropic)
    } else if p.ends_with("/chat/completions") {
        Some(Shape::Chat)
    } else if p.ends_with("/responses") {
        Some(Shape::Responses)
    } else if p.contains(":generateContent") || p.contains(":streamGenerateContent") {
        Some(Shape::Gemini)
    } else {
        None
    }
}

fn is_bedrock_invoke(p: &str) -> bool {
    p.contains("/model/") && (p.ends_with("/invoke") || p.ends_with("/invoke-with-response-stream"))
}

/// An Anthropic SSE stream as Bedrock's InvokeModelWithResponseStream sends it: each event's JSON, base64, in the
/// `bytes` of a `chunk` event-stream message.
fn bedrock_event_stream(mut reply: Reply) -> Reply {
    use base64::Engine;
    let frames = reply
        .frames
        .iter()
        .filter_map(|f| {
            let text = std::str::from_utf8(f).ok()?;
            let data = text.lines().find_map(|l| l.strip_prefix("data: "))?;
            let payload = json!({"bytes": base64::engine::general_purpose::STANDARD.encode(data), "p": "abcdefgh"});
            Some(Bytes::from(llmtap::provider::eventstream::encode(
                &[
                    (":event-type", "chunk"),
                    (":content-type", "application/json"),
                    (":message-type", "event"),
                ],
                payload.to_string().as_bytes(),
            )))
        })
        .collect();
    reply.frames = frames;
    reply.content_type = "application/vnd.amazon.eventstream";
    reply
}

fn reply_for(
    method: &http::Method,
    path: &str,
    headers: &HeaderMap,
    request: &Value,
    request_len: usize,
    n: u64,
    forced_status: Option<u16>,
) -> Reply {
    let p = path.split('?').next().unwrap_or(path);
    if method == http::Method::POST && p.ends_with("/messages/count_tokens") {
        return Reply::json(200, json!({"input_tokens": tokens(request_len)}));
    }
    let get_or_head = method == http::Method::GET || method == http::Method::HEAD;
    if get_or_head && (p == "/" || p.is_empty()) {
        // Connectivity probes (Claude Code sends `HEAD /` to its base URL).
        return Reply::json(200, json!({}));
    }
    if get_or_head && p.ends_with("/models") {
        return Reply::json(200, model_list(p, headers));
    }
    let Some(shape) = shape_of(method, path) else {
        return Reply::json(
            404,
            json!({"type": "error", "error": {"type": "not_found_error", "message": format!("no scripted answer for {method} {p}")}}),
        );
    };
    let ask = read_ask(shape, path, request);
    let status = forced_status.or_else(|| directive(&ask.latest_user_text, "status").and_then(|s| s.parse().ok()));
    if let Some(status) = status.filter(|s| *s >= 400) {
        return error_reply(shape, status);
    }
    let decision = decide(&ask);
    let usage = Usage::for_call(request_len, &decision, request);
    let ids = Ids::new(n);
    let mut reply = match shape {
        Shape::Anthropic if p.ends_with("/invoke-with-response-stream") => {
            bedrock_event_stream(anthropic(&ask, &decision, &usage, &ids))
        }
        Shape::Anthropic => anthropic(&ask, &decision, &usage, &ids),
        Shape::Chat => chat(&ask, &decision, &usage, &ids, request),
        Shape::Responses => responses(&ask, &decision, &usage, &ids, request),
        Shape::Gemini => gemini(&ask, &decision, &usage, &ids, path),
    };
    reply.tool = match decision {
        Decision::Tool { name, .. } => Some(name),
        Decision::Text => None,
    };
    reply
}

fn model_list(path: &str, headers: &HeaderMap) -> Value {
    if path.contains("/v1beta/") || path.contains("/v1/models") && headers.contains_key("x-goog-api-key") {
        return json!({"models": [{"name": "models/gemini-2.5-flash", "displayName": "Gemini 2.5 Flash",
            "supportedGenerationMethods": ["generateContent", "countTokens"]}]});
    }
    if headers.contains_key("anthropic-version") || headers.contains_key("x-api-key") {
        return json!({"data": [{"type": "model", "id": "claude-sonnet-4-5-20250929", "display_name": "Claude Sonnet 4.5",
            "created_at": "2025-09-29T00:00:00Z"}], "has_more": false,
            "first_id": "claude-sonnet-4-5-20250929", "last_id": "claude-sonnet-4-5-20250929"});
    }
    json!({"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "created": 1721172741, "owned_by": "system"}]})
}

fn error_reply(shape: Shape, status: u16) -> Reply {
    let (kind, message) = match status {
        429 => ("rate_limit_error", "Rate limited"),
        529 => ("overloaded_error", "Overloaded"),
        _ => ("api_error", "Internal server error"),
    };
    let body = match shape {
        Shape::Anthropic => json!({"type": "error", "error": {"type": kind, "message": message},
            "request_id": "req_scripted_error"}),
        Shape::Gemini => json!({"error": {"code": status, "message": message, "status": "UNAVAILABLE"}}),
        Shape::Chat | Shape::Responses => {
            json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
        }
    };
    Reply::json(status, body)
}

/// `[[name:value]]` in `text`.
fn directive(text: &str, name: &str) -> Option<String> {
    let open = format!("[[{name}:");
    let start = text.find(&open)? + open.len();
    let end = text[start..].find("]]")? + start;
    Some(text[start..end].trim().to_owned())
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn read_ask(shape: Shape, path: &str, r: &Value) -> Ask {
    let mut ask = Ask {
        model: r["model"].as_str().unwrap_or("").to_owned(),
        stream: r["stream"].as_bool().unwrap_or(false),
        ..Ask::default()
    };
    let arr = |v: &Value| v.as_array().cloned().unwrap_or_default();
    // Messages as (is a tool result, user text): the latest user text and the tool rounds after it.
    let mut turns: Vec<(bool, Option<String>)> = Vec::new();
    match shape {
        Shape::Anthropic => {
            for t in arr(&r["tools"]) {
                if let (Some(name), Some(schema)) = (t["name"].as_str(), t.get("input_schema")) {
                    ask.tools.push((name.to_owned(), schema.clone()));
                }
            }
            for m in arr(&r["messages"]) {
                if m["role"] != "user" {
                    continue;
                }
                let is_result = m["content"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|b| b["type"] == "tool_result"));
                turns.push((is_result, (!is_result).then(|| text_of(&m["content"]))));
            }
        }
        Shape::Chat => {
            for t in arr(&r["tools"]) {
                if let Some(name) = t["function"]["name"].as_str() {
                    let schema = t["function"].get("parameters").cloned().unwrap_or(json!({}));
                    ask.tools.push((name.to_owned(), schema));
                }
            }
            for m in arr(&r["messages"]) {
                match m["role"].as_str() {
                    Some("tool") => turns.push((true, None)),
                    Some("user") => turns.push((false, Some(text_of(&m["content"])))),
                    _ => {}
                }
            }
        }
        Shape::Responses => {
            for t in arr(&r["tools"]) {
                if t["type"] == "function"
                    && let Some(name) = t["name"].as_str()
                {
                    ask.tools
                        .push((name.to_owned(), t.get("parameters").cloned().unwrap_or(json!({}))));
                }
            }
            match &r["input"] {
                Value::String(s) => turns.push((false, Some(s.clone()))),
                Value::Array(items) => {
                    for it in items {
                        if it["type"] == "function_call_output" {
                            turns.push((true, None));
                        } else if it["role"] == "user" {
                            turns.push((false, Some(text_of(&it["content"]))));
                        }
                    }
                }
                _ => {}
            }
        }
        Shape::Gemini => {
            for t in arr(&r["tools"]) {
                for f in arr(&t["functionDeclarations"]) {
                    if let Some(name) = f["name"].as_str() {
                        // google-genai sends the JSON-schema form in snake case.
                        let schema = f
                            .get("parametersJsonSchema")
                            .or_else(|| f.get("parameters_json_schema"))
                            .or_else(|| f.get("parameters"))
                            .cloned()
                            .unwrap_or(json!({}));
                        ask.tools.push((name.to_owned(), schema));
                    }
                }
            }
            for c in arr(&r["contents"]) {
                if c["role"] == "model" {
                    continue;
                }
                let parts = arr(&c["parts"]);
                if parts.iter().any(|p| p.get("functionResponse").is_some()) {
                    turns.push((true, None));
                } else {
                    turns.push((false, Some(text_of(&c["parts"]))));
                }
            }
            ask.stream = path.contains(":streamGenerateContent");
            ask.model = path
                .split("/models/")
                .nth(1)
                .and_then(|m| m.split(':').next())
                .unwrap_or("gemini-2.5-flash")
                .to_owned();
        }
    }
    // Bedrock and Vertex name the model in the path and stream by endpoint.
    let p = path.split('?').next().unwrap_or(path);
    if shape == Shape::Anthropic && ask.model.is_empty() {
        let model = if is_bedrock_invoke(p) {
            p.split("/model/")
                .nth(1)
                .and_then(|m| m.rsplit_once('/'))
                .map(|(m, _)| m)
        } else {
            p.rsplit_once("/models/").and_then(|(_, m)| m.split(':').next())
        };
        ask.model = percent_encoding::percent_decode_str(model.unwrap_or(""))
            .decode_utf8_lossy()
            .into_owned();
    }
    if p.ends_with("/invoke-with-response-stream") || p.contains(":streamRawPredict") {
        ask.stream = true;
    }
    if let Some(i) = turns.iter().rposition(|(result, _)| !result) {
        ask.latest_user_text = turns[i].1.clone().unwrap_or_default();
        ask.tool_rounds = turns.len() - i - 1;
    } else {
        ask.tool_rounds = turns.len();
    }
    ask
}

fn is_delegation(name: &str) -> bool {
    name == "Task" || name == "Agent" || name.starts_with("transfer_to_")
}

fn is_shell(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n == "bash" || n.contains("shell") || n == "exec" || n.contains("run_command")
}

fn decide(ask: &Ask) -> Decision {
    let wanted_rounds = directive(&ask.latest_user_text, "steps")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1usize);
    if ask.tools.is_empty() || ask.tool_rounds >= wanted_rounds {
        return Decision::Text;
    }
    let forced = directive(&ask.latest_user_text, "tool");
    let pick = match &forced {
        // Claude Code names its delegation tool `Task` or `Agent` depending on the version.
        Some(want) => ask.tools.iter().find(|(n, _)| {
            n.eq_ignore_ascii_case(want) || (is_delegation(want) && is_delegation(n) && !n.starts_with("transfer_to_"))
        }),
        None => ask
            .tools
            .iter()
            .find(|(n, _)| is_shell(n))
            .or_else(|| ask.tools.iter().find(|(n, _)| !is_delegation(n))),
    };
    match pick {
        Some((name, schema)) => Decision::Tool {
            name: name.clone(),
            args: args_from_schema(schema),
        },
        None => Decision::Text,
    }
}

/// Arguments for a tool: its required properties (all of them when none are marked), each a plausible value.
fn args_from_schema(schema: &Value) -> Value {
    let mut out = Map::new();
    let Some(props) = schema["properties"].as_object() else {
        return Value::Object(out);
    };
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_else(|| props.keys().map(String::as_str).collect());
    for name in required {
        if let Some(p) = props.get(name) {
            out.insert(name.to_owned(), value_for(name, p));
        }
    }
    Value::Object(out)
}

fn value_for(name: &str, p: &Value) -> Value {
    if let Some(first) = p["enum"].as_array().and_then(|e| e.first()) {
        return first.clone();
    }
    let ty = match &p["type"] {
        Value::String(s) => s.as_str(),
        Value::Array(types) => types
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("string"),
        _ if p.get("anyOf").is_some() => {
            return p["anyOf"]
                .as_array()
                .and_then(|a| a.iter().find(|s| s["type"] != "null"))
                .map_or(Value::Null, |s| value_for(name, s));
        }
        _ => "string",
    };
    match ty {
        "integer" | "number" => json!(1),
        "boolean" => json!(false),
        "array" => json!([]),
        "object" => args_from_schema(p),
        _ => json!(match name {
            "command" | "cmd" | "script" => "echo hi",
            "description" => "Say hi",
            "prompt" => "Run the shell command `echo hi` and report its output.",
            "subagent_type" => "general-purpose",
            "city" | "location" => "Paris",
            _ => "hi",
        }),
    }
}

/// Token counts that look like a provider's: about four bytes of request per input token, half of a
/// cache-marked prompt read from cache and a quarter written.
struct Usage {
    input: u64,
    output: u64,
    cache_read: u64,
    cache_write: u64,
}

fn tokens(bytes: usize) -> u64 {
    (bytes / 4) as u64 + 3
}

impl Usage {
    fn for_call(request_len: usize, decision: &Decision, request: &Value) -> Usage {
        let total = tokens(request_len);
        let cached = request.to_string().contains("cache_control");
        let (cache_read, cache_write) = if cached { (total / 2, total / 4) } else { (0, 0) };
        let output = match decision {
            Decision::Text => tokens(SCRIPTED_TEXT.len()),
            Decision::Tool { args, .. } => tokens(args.to_string().len()) + 8,
        };
        Usage {
            input: total - cache_read - cache_write,
            output,
            cache_read,
            cache_write,
        }
    }
}

struct Ids {
    n: u64,
}

impl Ids {
    fn new(n: u64) -> Ids {
        Ids { n }
    }
    fn id(&self, prefix: &str) -> String {
        format!("{prefix}{:024x}", 0x5c41_9700_0000_0000_u64 + self.n)
    }
}

/// Text in a few chunks, as a model streams it.
fn chunks(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    words.chunks(2).map(|c| c.concat()).collect()
}

fn sse(event: Option<&str>, data: &Value) -> Bytes {
    Bytes::from(match event {
        Some(e) => format!("event: {e}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    })
}

fn streamed(frames: Vec<Bytes>, usage: Value) -> Reply {
    Reply {
        status: 200,
        content_type: "text/event-stream; charset=utf-8",
        frames,
        usage: Some(usage),
        tool: None,
        streamed: true,
    }
}

fn whole(body: Value, usage: Value) -> Reply {
    let mut r = Reply::json(200, body);
    r.usage = Some(usage);
    r
}

fn anthropic(ask: &Ask, decision: &Decision, u: &Usage, ids: &Ids) -> Reply {
    let usage = json!({"input_tokens": u.input, "cache_creation_input_tokens": u.cache_write,
        "cache_read_input_tokens": u.cache_read, "output_tokens": u.output,
        "service_tier": "standard"});
    let (block, stop) = match decision {
        Decision::Text => (json!({"type": "text", "text": SCRIPTED_TEXT}), "end_turn"),
        Decision::Tool { name, args } => (
            json!({"type": "tool_use", "id": ids.id("toolu_01"), "name": name, "input": args}),
            "tool_use",
        ),
    };
    let message = |content: Value, stop: Value, usage: Value| {
        json!({"id": ids.id("msg_01"), "type": "message", "role": "assistant", "model": ask.model,
            "content": content, "stop_reason": stop, "stop_sequence": null, "usage": usage})
    };
    if !ask.stream {
        return whole(message(json!([block]), json!(stop), usage.clone()), usage);
    }
    let mut start_usage = usage.clone();
    start_usage["output_tokens"] = json!(1);
    let mut f = vec![sse(
        Some("message_start"),
        &json!({"type": "message_start", "message": message(json!([]), Value::Null, start_usage)}),
    )];
    let (start_block, deltas) = match decision {
        Decision::Text => (
            json!({"type": "text", "text": ""}),
            chunks(SCRIPTED_TEXT)
                .into_iter()
                .map(|t| json!({"type": "text_delta", "text": t}))
                .collect::<Vec<_>>(),
        ),
        Decision::Tool { args, .. } => {
            let mut b = block.clone();
            b["input"] = json!({});
            let text = args.to_string();
            let mid = text.len() / 2;
            let (a, z) = text.split_at(text.char_indices().map(|(i, _)| i).find(|i| *i >= mid).unwrap_or(0));
            (
                b,
                ["", a, z]
                    .iter()
                    .map(|p| json!({"type": "input_json_delta", "partial_json": p}))
                    .collect(),
            )
        }
    };
    f.push(sse(
        Some("content_block_start"),
        &json!({"type": "content_block_start", "index": 0, "content_block": start_block}),
    ));
    f.push(sse(Some("ping"), &json!({"type": "ping"})));
    for d in deltas {
        f.push(sse(
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": 0, "delta": d}),
        ));
    }
    f.push(sse(
        Some("content_block_stop"),
        &json!({"type": "content_block_stop", "index": 0}),
    ));
    f.push(sse(
        Some("message_delta"),
        &json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": usage}),
    ));
    f.push(sse(Some("message_stop"), &json!({"type": "message_stop"})));
    streamed(f, usage)
}

fn chat(ask: &Ask, decision: &Decision, u: &Usage, ids: &Ids, request: &Value) -> Reply {
    let usage = json!({"prompt_tokens": u.input + u.cache_read, "completion_tokens": u.output,
        "total_tokens": u.input + u.cache_read + u.output,
        "prompt_tokens_details": {"cached_tokens": u.cache_read, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}});
    let id = ids.id("chatcmpl-");
    let call_id = ids.id("call_");
    let created = 1_763_000_000 + ids.n;
    let (message, finish) = match decision {
        Decision::Text => (
            json!({"role": "assistant", "content": SCRIPTED_TEXT, "refusal": null, "annotations": []}),
            "stop",
        ),
        Decision::Tool { name, args } => (
            json!({"role": "assistant", "content": null, "refusal": null, "annotations": [],
                "tool_calls": [{"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args.to_string()}}]}),
            "tool_calls",
        ),
    };
    if !ask.stream {
        return whole(
            json!({"id": id, "object": "chat.completion", "created": created, "model": ask.model,
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                "usage": usage, "service_tier": "default", "system_fingerprint": "fp_scripted"}),
            usage,
        );
    }
    let include_usage = request["stream_options"]["include_usage"].as_bool() == Some(true);
    let chunk = |delta: Value, finish: Value| {
        let mut c = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": ask.model,
            "service_tier": "default", "system_fingerprint": "fp_scripted",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]});
        if include_usage {
            c["usage"] = Value::Null;
        }
        sse(None, &c)
    };
    let mut f = Vec::new();
    match decision {
        Decision::Text => {
            f.push(chunk(
                json!({"role": "assistant", "content": "", "refusal": null}),
                Value::Null,
            ));
            for t in chunks(SCRIPTED_TEXT) {
                f.push(chunk(json!({"content": t}), Value::Null));
            }
        }
        Decision::Tool { name, args } => {
            f.push(chunk(
                json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0, "id": call_id,
                    "type": "function", "function": {"name": name, "arguments": ""}}], "refusal": null}),
                Value::Null,
            ));
            f.push(chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": args.to_string()}}]}),
                Value::Null,
            ));
        }
    }
    f.push(chunk(json!({}), json!(finish)));
    if include_usage {
        f.push(sse(
            None,
            &json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": ask.model,
                "service_tier": "default", "system_fingerprint": "fp_scripted", "choices": [], "usage": usage}),
        ));
    }
    f.push(Bytes::from_static(b"data: [DONE]\n\n"));
    // Without `include_usage` a real stream reports no usage; the log says so.
    streamed(f, if include_usage { usage } else { Value::Null })
}

fn responses(ask: &Ask, decision: &Decision, u: &Usage, ids: &Ids, request: &Value) -> Reply {
    let usage = json!({"input_tokens": u.input + u.cache_read,
        "input_tokens_details": {"cached_tokens": u.cache_read},
        "output_tokens": u.output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.input + u.cache_read + u.output});
    let resp_id = ids.id("resp_");
    let item_id = ids.id(match decision {
        Decision::Text => "msg_",
        Decision::Tool { .. } => "fc_",
    });
    let item = |done: bool| match decision {
        Decision::Text => json!({"type": "message", "id": item_id,
            "status": if done { "completed" } else { "in_progress" }, "role": "assistant",
            "content": if done { json!([{"type": "output_text", "text": SCRIPTED_TEXT, "annotations": [], "logprobs": []}]) } else { json!([]) }}),
        Decision::Tool { name, args } => json!({"type": "function_call", "id": item_id,
            "call_id": ids.id("call_"), "name": name,
            "arguments": if done { args.to_string() } else { String::new() },
            "status": if done { "completed" } else { "in_progress" }}),
    };
    let response = |status: &str, output: Value, usage: Value| {
        json!({"id": resp_id, "object": "response", "created_at": 1_763_000_000 + ids.n, "status": status,
            "background": false, "error": null, "incomplete_details": null,
            "instructions": request.get("instructions").cloned().unwrap_or(Value::Null),
            "max_output_tokens": null, "model": ask.model, "output": output, "parallel_tool_calls": true,
            "previous_response_id": request.get("previous_response_id").cloned().unwrap_or(Value::Null),
            "reasoning": {"effort": null, "summary": null}, "store": true, "temperature": 1.0,
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "tool_choice": "auto",
            "tools": request.get("tools").cloned().unwrap_or(json!([])), "top_p": 1.0,
            "truncation": "disabled", "usage": usage, "user": null, "metadata": {}})
    };
    if !ask.stream {
        return whole(response("completed", json!([item(true)]), usage.clone()), usage);
    }
    let mut seq = 0u64;
    let mut f = Vec::new();
    let mut ev = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(seq);
        seq += 1;
        f.push(sse(Some(name), &data));
    };
    ev(
        "response.created",
        json!({"response": response("in_progress", json!([]), Value::Null)}),
    );
    ev(
        "response.in_progress",
        json!({"response": response("in_progress", json!([]), Value::Null)}),
    );
    ev(
        "response.output_item.added",
        json!({"output_index": 0, "item": item(false)}),
    );
    match decision {
        Decision::Text => {
            let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
            ev(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part("")}),
            );
            for t in chunks(SCRIPTED_TEXT) {
                ev(
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": t, "logprobs": []}),
                );
            }
            ev(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": SCRIPTED_TEXT, "logprobs": []}),
            );
            ev(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part(SCRIPTED_TEXT)}),
            );
        }
        Decision::Tool { args, .. } => {
            ev(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": 0, "delta": args.to_string()}),
            );
            ev(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": 0, "arguments": args.to_string()}),
            );
        }
    }
    ev(
        "response.output_item.done",
        json!({"output_index": 0, "item": item(true)}),
    );
    ev(
        "response.completed",
        json!({"response": response("completed", json!([item(true)]), usage.clone())}),
    );
    streamed(f, usage)
}

fn gemini(ask: &Ask, decision: &Decision, u: &Usage, ids: &Ids, path: &str) -> Reply {
    let mut usage = json!({"promptTokenCount": u.input + u.cache_read, "candidatesTokenCount": u.output,
        "totalTokenCount": u.input + u.cache_read + u.output,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": u.input + u.cache_read}]});
    if u.cache_read > 0 {
        usage["cachedContentTokenCount"] = json!(u.cache_read);
    }
    let response_id = ids.id("")[..22].to_owned();
    let chunk = |parts: Value, finish: Option<&str>| {
        let mut c = json!({"content": {"parts": parts, "role": "model"}, "index": 0});
        if let Some(f) = finish {
            c["finishReason"] = json!(f);
        }
        json!({"candidates": [c], "usageMetadata": usage, "modelVersion": ask.model, "responseId": response_id})
    };
    let parts: Vec<Value> = match decision {
        Decision::Text if ask.stream => chunks(SCRIPTED_TEXT)
            .into_iter()
            .map(|t| json!([{"text": t}]))
            .collect(),
        Decision::Text => vec![json!([{"text": SCRIPTED_TEXT}])],
        Decision::Tool { name, args } => vec![json!([{"functionCall": {"name": name, "args": args}}])],
    };
    let last = parts.len() - 1;
    let bodies: Vec<Value> = parts
        .into_iter()
        .enumerate()
        .map(|(i, p)| chunk(p, (i == last).then_some("STOP")))
        .collect();
    if !ask.stream {
        return whole(bodies[0].clone(), usage);
    }
    if path.contains("alt=sse") {
        let frames = bodies
            .iter()
            .map(|b| Bytes::from(format!("data: {b}\r\n\r\n")))
            .collect();
        return streamed(frames, usage);
    }
    // Without `alt=sse`, one JSON array of the chunks.
    let text = format!(
        "[{}]",
        bodies.iter().map(Value::to_string).collect::<Vec<_>>().join(",\r\n")
    );
    let mut r = streamed(vec![Bytes::from(text)], usage);
    r.content_type = "application/json; charset=UTF-8";
    r
}
