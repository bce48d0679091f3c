//! Replay: re-send a captured call to its provider, edited, through this llmtap's own proxy, so that the new call
//! is captured like any other and linked to the original. Shared by `llmtap replay` (src/cli/replay.rs) and the
//! viewer's Replay (src/api/viewer/replay.rs).
//!
//! The store keeps a call's request with its credentials redacted, so a replay is rebuilt: the captured body
//! (edited), the captured path (the upstream's own prefix taken off, a redacted key in the query left out), the
//! headers the provider needs (content type, `anthropic-version`, betas, ... everything captured except
//! credentials, framing, tracing and llmtap's own) and the key the user gives, in the header the original carried
//! it in. Three llmtap headers go with it, none of them upstream: `x-llmtap-replay-of` (the link the pipeline
//! records), `x-llmtap-session` (each replay is a session of its own, `replay-<uuid>`, so it never joins or
//! re-derives the original's trajectory, and so that the caller finds exactly its replay in the store) and the
//! original's `x-llmtap-agent`. The key exists only in the request being sent: it is never part of an error, a
//! log line or an answer.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method};
use http_body_util::Full;
use serde_json::Value;

use crate::model::exchange::{Api, REPLAY_OF_HEADER};
use crate::model::trace::ProviderTrace;
use crate::proxy::redact::{REDACTED, Redactor};
use crate::store::{Query, StoreError};
use crate::telemetry::error_chain;

/// What to change in the captured request before sending it again.
#[derive(Debug, Default, Clone)]
pub struct Edits {
    /// A whole new body in place of the captured one (applied first).
    pub body: Option<Value>,
    /// JSON pointers (RFC 6901, the leading `/` optional) and their new values: an object member is added or
    /// replaced, an array element replaced (`-` appends).
    pub set: Vec<(String, Value)>,
    /// JSON pointers removed.
    pub unset: Vec<String>,
    /// The model: the body's `model`, or the path's where the provider names it there (Gemini and Vertex
    /// `models/<model>:`, Bedrock `model/<model>/`).
    pub model: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "the call went to {0:?}, which is not a configured upstream: add it as [upstreams.<name>] url = \"https://{0}\" \
         to replay it through llmtap"
    )]
    NoRoute(String),
    #[error("the captured path {path:?} does not start with upstream {upstream:?}'s path {prefix:?}")]
    PathOutsideUpstream {
        path: String,
        upstream: String,
        prefix: String,
    },
    #[error("the captured path held a key (stored redacted): such a call cannot be replayed")]
    KeyInPath,
    #[error("the call was signed with AWS SigV4 (x-amz-date): llmtap cannot sign a replay")]
    Signed,
    #[error("the captured request body is not JSON: {0} cannot be applied")]
    NotJson(&'static str),
    #[error("edit {pointer:?}: {reason}")]
    Edit { pointer: String, reason: String },
    #[error("the call was sent with a key and none was given for the replay")]
    KeyMissing,
    #[error("the key is not a valid header value (a control character or a line break)")]
    BadKey,
    #[error("the edited model {0:?} cannot go in a header or path")]
    BadModel(String),
    #[error("cannot send the replay to llmtap's proxy at {addr}: {reason}")]
    Proxy { addr: SocketAddr, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A replay ready to send to the proxy.
#[derive(Debug)]
pub struct Plan {
    pub method: Method,
    /// The proxy's route for it: `/<upstream>/<path>[?query]`.
    pub path: String,
    /// With the key (marked sensitive: hyper never indexes it in HPACK, `Debug` shows `Sensitive`).
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The replay's session (`replay-<uuid>`): how its capture is found.
    pub session: String,
}

/// How the original sent its key, and so how the replay sends the user's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHeader {
    /// `Authorization: Bearer <key>` (OpenAI, current Anthropic SDKs, Vertex, most others).
    Bearer,
    /// The key as the whole value of this header (`x-api-key`, `x-goog-api-key`, Azure's `api-key`).
    Plain(&'static str),
}

impl KeyHeader {
    pub fn name(self) -> &'static str {
        match self {
            KeyHeader::Bearer => "authorization",
            KeyHeader::Plain(name) => name,
        }
    }
}

/// Where the original carried a key (None: it was sent without one, e.g. to a local model server), else
/// where the provider takes one.
pub fn key_header(trace: &ProviderTrace) -> (KeyHeader, bool) {
    for (k, _) in &trace.request_headers {
        match k.to_ascii_lowercase().as_str() {
            "authorization" => return (KeyHeader::Bearer, true),
            "x-api-key" => return (KeyHeader::Plain("x-api-key"), true),
            "x-goog-api-key" => return (KeyHeader::Plain("x-goog-api-key"), true),
            "api-key" => return (KeyHeader::Plain("api-key"), true),
            _ => {}
        }
    }
    // Gemini's `?key=`: the replay sends it as the header Gemini also takes, so it stays out of the URL.
    if query_params(&trace.path).any(|(_, v)| v == REDACTED) {
        return (KeyHeader::Plain("x-goog-api-key"), true);
    }
    let default = match trace.api {
        Api::AnthropicMessages => KeyHeader::Plain("x-api-key"),
        Api::GeminiGenerateContent => KeyHeader::Plain("x-goog-api-key"),
        _ => KeyHeader::Bearer,
    };
    (default, false)
}

/// The variable standing for an upstream's key, in the environment and in the viewer's curl command:
/// `<UPSTREAM>_API_KEY`, every other character `_`.
pub fn key_variable(upstream: &str) -> String {
    let name: String = upstream
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    // A leading digit would read as a positional parameter.
    if name.starts_with(|c: char| c.is_ascii_digit()) {
        format!("_{name}_API_KEY")
    } else {
        format!("{name}_API_KEY")
    }
}

/// The environment variables `llmtap replay` reads the key from, first set wins: `<UPSTREAM>_API_KEY` (so
/// `ANTHROPIC_API_KEY`, `OPENAI_API_KEY`, `GEMINI_API_KEY` for the built-in routes, `GROQ_API_KEY` for an
/// upstream named groq), and `GOOGLE_API_KEY` after it for Gemini.
pub fn key_variables(trace: &ProviderTrace) -> Vec<String> {
    let mut vars = vec![key_variable(&trace.upstream)];
    if trace.api == Api::GeminiGenerateContent {
        vars.push("GOOGLE_API_KEY".into());
    }
    vars
}

/// The model the original asked for (the one an edit replaces).
pub fn requested_model(trace: &ProviderTrace) -> Option<String> {
    trace
        .facts
        .as_ref()
        .and_then(|f| f.model_requested.clone())
        .or_else(|| trace.model.clone())
}

/// Request headers never copied into a replay: framing and hop-by-hop (hyper sets its own), encodings of a body
/// that is sent decoded, the agent's trace context (a replay is not part of its trace), and credentials.
const NOT_COPIED: [&str; 19] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "expect",
    "accept-encoding",
    "content-encoding",
    "traceparent",
    "tracestate",
    "baggage",
    "authorization",
    "proxy-authorization",
    "cookie",
    "api-key",
];

/// Build the replay of `trace` with `edits`. `upstreams`: upstream name → base URL, as configured. `key`: the
/// user's, required when the original carried one.
pub fn plan(
    trace: &ProviderTrace,
    upstreams: &BTreeMap<String, String>,
    redactor: &Redactor,
    edits: &Edits,
    key: Option<&str>,
) -> Result<Plan, ReplayError> {
    let base = upstreams
        .get(&trace.upstream)
        .ok_or_else(|| ReplayError::NoRoute(trace.upstream.clone()))?;
    let prefix = base
        .parse::<http::Uri>()
        .map(|u| u.path().trim_end_matches('/').to_owned())
        .unwrap_or_default();
    let (path, query) = trace.path.split_once('?').unwrap_or((&trace.path, ""));
    if path.split('/').any(|s| s == REDACTED) {
        return Err(ReplayError::KeyInPath);
    }
    let rest = path
        .strip_prefix(prefix.as_str())
        .filter(|r| r.is_empty() || r.starts_with('/'))
        .ok_or_else(|| ReplayError::PathOutsideUpstream {
            path: path.to_owned(),
            upstream: trace.upstream.clone(),
            prefix: prefix.clone(),
        })?;
    let mut rest = rest.to_owned();

    // The body: as captured unless edited (then re-serialized; serde_json keeps member order).
    let captured = trace.request.to_value();
    let edited = edits.body.is_some() || !edits.set.is_empty() || !edits.unset.is_empty() || edits.model.is_some();
    let mut value = edits.body.clone().unwrap_or(captured);
    for (pointer, v) in &edits.set {
        set_pointer(&mut value, pointer, v.clone())?;
    }
    for pointer in &edits.unset {
        unset_pointer(&mut value, pointer)?;
    }
    if let Some(model) = &edits.model {
        set_model(&mut value, &mut rest, model)?;
    }
    let body = match &value {
        Value::Null => Bytes::new(),
        // Captured text that was not JSON (kept as a JSON string): its text as it was.
        Value::String(text) => Bytes::from(text.clone()),
        _ if !edited => Bytes::from(trace.request.as_str().to_owned()),
        v => Bytes::from(serde_json::to_vec(v).unwrap_or_default()),
    };

    let mut headers = HeaderMap::new();
    for (k, v) in &trace.request_headers {
        let name = k.to_ascii_lowercase();
        if matches!(name.as_str(), "x-amz-date" | "x-amz-content-sha256") {
            return Err(ReplayError::Signed);
        }
        if NOT_COPIED.contains(&name.as_str())
            || name.starts_with("x-llmtap-")
            || v == REDACTED
            || redactor.is_secret_name(name.as_bytes())
        {
            continue;
        }
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(v)) {
            headers.append(n, v);
        }
    }
    if !body.is_empty() && !headers.contains_key(http::header::CONTENT_TYPE) && !matches!(value, Value::String(_)) {
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    let (how, needed) = key_header(trace);
    match key.filter(|k| !k.is_empty()) {
        Some(key) => {
            let text = match how {
                KeyHeader::Bearer => format!("Bearer {key}"),
                KeyHeader::Plain(_) => key.to_owned(),
            };
            let mut v = HeaderValue::from_str(&text).map_err(|_| ReplayError::BadKey)?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static(how.name()), v);
        }
        None if needed => return Err(ReplayError::KeyMissing),
        None => {}
    }
    let session = format!("replay-{}", uuid::Uuid::now_v7().simple());
    let own = [
        (REPLAY_OF_HEADER, Some(trace.id.as_str())),
        ("x-llmtap-session", Some(session.as_str())),
        ("x-llmtap-agent", trace.meta.agent.as_deref()),
    ];
    for (name, value) in own {
        if let Some(v) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(HeaderName::from_static(name), v);
        }
    }

    // The query without a redacted key (sent as a header instead).
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split_once('=').is_none_or(|(_, v)| v != REDACTED))
        .collect();
    let mut route = format!("/{}{}", trace.upstream, rest);
    if !kept.is_empty() {
        route.push('?');
        route.push_str(&kept.join("&"));
    }
    Ok(Plan {
        method: Method::from_bytes(trace.method.as_bytes()).unwrap_or(Method::POST),
        path: route,
        headers,
        body,
        session,
    })
}

fn query_params(path: &str) -> impl Iterator<Item = (&str, &str)> {
    path.split_once('?')
        .map_or("", |(_, q)| q)
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
}

/// `/a/b` or `a/b` → the parent's pointer and the last token, unescaped (`~1` is `/`, `~0` is `~`).
fn split_pointer(pointer: &str) -> Result<(String, String), ReplayError> {
    let p = if pointer.starts_with('/') {
        pointer.to_owned()
    } else {
        format!("/{pointer}")
    };
    let Some((parent, last)) = p.rsplit_once('/') else {
        return Err(edit_error(pointer, "empty pointer"));
    };
    if p == "/" {
        return Err(edit_error(pointer, "names the whole body (use a body file for that)"));
    }
    Ok((parent.to_owned(), last.replace("~1", "/").replace("~0", "~")))
}

fn edit_error(pointer: &str, reason: impl Into<String>) -> ReplayError {
    ReplayError::Edit {
        pointer: pointer.to_owned(),
        reason: reason.into(),
    }
}

fn set_pointer(body: &mut Value, pointer: &str, v: Value) -> Result<(), ReplayError> {
    if matches!(body, Value::String(_) | Value::Null) {
        return Err(ReplayError::NotJson("a --set edit"));
    }
    let (parent, last) = split_pointer(pointer)?;
    match body.pointer_mut(&parent) {
        Some(Value::Object(map)) => {
            map.insert(last, v);
            Ok(())
        }
        Some(Value::Array(items)) => {
            if last == "-" {
                items.push(v);
                return Ok(());
            }
            match last.parse::<usize>() {
                Ok(i) if i < items.len() => {
                    items[i] = v;
                    Ok(())
                }
                Ok(i) if i == items.len() => {
                    items.push(v);
                    Ok(())
                }
                _ => Err(edit_error(
                    pointer,
                    format!("no element {last} in an array of {}", items.len()),
                )),
            }
        }
        Some(_) => Err(edit_error(pointer, "its parent is neither an object nor an array")),
        None => Err(edit_error(pointer, "its parent is not in the body")),
    }
}

fn unset_pointer(body: &mut Value, pointer: &str) -> Result<(), ReplayError> {
    let (parent, last) = split_pointer(pointer)?;
    let removed = match body.pointer_mut(&parent) {
        Some(Value::Object(map)) => map.shift_remove(&last).is_some(),
        Some(Value::Array(items)) => match last.parse::<usize>() {
            Ok(i) if i < items.len() => {
                items.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    };
    if removed {
        Ok(())
    } else {
        Err(edit_error(pointer, "not in the body"))
    }
}

/// Characters a model id keeps in a path segment.
const PATH_SAFE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

fn set_model(body: &mut Value, path: &mut String, model: &str) -> Result<(), ReplayError> {
    if model.is_empty() || model.chars().any(char::is_control) {
        return Err(ReplayError::BadModel(model.to_owned()));
    }
    if let Value::Object(map) = body
        && map.contains_key("model")
    {
        map.insert("model".into(), Value::String(model.to_owned()));
        return Ok(());
    }
    let encoded = percent_encoding::utf8_percent_encode(model, PATH_SAFE).to_string();
    // Gemini and Vertex: `.../models/<model>:generateContent`; Bedrock: `/model/<model>/invoke`.
    for (marker, ends) in [("/models/", &[':', '/'][..]), ("/model/", &['/'][..])] {
        if let Some(i) = path.find(marker) {
            let start = i + marker.len();
            let end = path[start..].find(ends).map_or(path.len(), |e| start + e);
            path.replace_range(start..end, &encoded);
            return Ok(());
        }
    }
    match body {
        Value::Object(map) => {
            map.insert("model".into(), Value::String(model.to_owned()));
            Ok(())
        }
        _ => Err(ReplayError::NotJson("a model edit")),
    }
}

/// Where to reach a proxy listening on `addr` from this host (an unspecified address is reached on loopback).
pub fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port()))
        }
        _ => addr,
    }
}

/// Send `plan` to the proxy at `proxy`; the response's body streams as the provider sends it.
pub async fn send(proxy: SocketAddr, plan: Plan) -> Result<http::Response<hyper::body::Incoming>, ReplayError> {
    let addr = reachable(proxy);
    let uri: http::Uri = format!("http://{addr}{}", plan.path)
        .parse()
        .map_err(|e: http::uri::InvalidUri| ReplayError::Proxy {
            addr,
            reason: e.to_string(),
        })?;
    let mut request = http::Request::new(Full::new(plan.body));
    *request.method_mut() = plan.method;
    *request.uri_mut() = uri;
    *request.headers_mut() = plan.headers;
    let client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Full<Bytes>>();
    client.request(request).await.map_err(|e| ReplayError::Proxy {
        addr,
        reason: error_chain(&e),
    })
}

/// The replay of `original` in `session` once the store holds it.
pub fn captured(reader: &dyn Query, original: &str, session: &str) -> Result<Option<String>, StoreError> {
    Ok(reader
        .replays_of(original)?
        .into_iter()
        .find(|(_, s)| s.as_deref() == Some(session))
        .map(|(id, _)| id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::json::JsonText;

    fn trace(api: Api, upstream: &str, path: &str, headers: &[(&str, &str)], body: &str) -> ProviderTrace {
        let mut t = crate::derive::testkit::trace(api, 1, 2);
        t.id = "call-1".into();
        t.upstream = upstream.into();
        t.path = path.into();
        t.request_headers = headers.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
        t.request = JsonText::from_value(&serde_json::from_str(body).unwrap());
        t
    }

    fn upstreams() -> BTreeMap<String, String> {
        [
            ("anthropic", "https://api.anthropic.com"),
            ("gemini", "https://generativelanguage.googleapis.com/"),
            ("groq", "https://api.groq.com/openai"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn rebuilds_headers_without_credentials_and_puts_the_key_where_the_original_had_it() {
        let t = trace(
            Api::AnthropicMessages,
            "anthropic",
            "/v1/messages?beta=true",
            &[
                ("content-type", "application/json"),
                ("anthropic-version", "2023-06-01"),
                ("anthropic-beta", "tools-2024"),
                ("x-api-key", REDACTED),
                ("x-claude-code-session-id", REDACTED),
                ("content-length", "99"),
                ("accept-encoding", "gzip"),
                ("traceparent", "00-1-2-01"),
                ("x-llmtap-replay-of", "older"),
            ],
            r#"{"model":"claude-a","max_tokens":10,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        );
        let redactor = Redactor::new(&[]);
        let edits = Edits {
            set: vec![
                ("max_tokens".into(), 100.into()),
                (
                    "/messages/-".into(),
                    serde_json::json!({"role": "user", "content": "more"}),
                ),
            ],
            model: Some("claude-b".into()),
            ..Edits::default()
        };
        let p = plan(&t, &upstreams(), &redactor, &edits, Some("sk-user")).unwrap();
        assert_eq!(p.path, "/anthropic/v1/messages?beta=true");
        let names: Vec<&str> = p.headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "anthropic-version",
                "anthropic-beta",
                "x-api-key",
                "x-llmtap-replay-of",
                "x-llmtap-session"
            ]
        );
        assert_eq!(p.headers["x-api-key"], "sk-user");
        assert!(p.headers["x-api-key"].is_sensitive());
        assert_eq!(p.headers["x-llmtap-replay-of"], "call-1");
        assert_eq!(p.headers["x-llmtap-session"], p.session.as_str());
        let body: Value = serde_json::from_slice(&p.body).unwrap();
        assert_eq!(body["model"], "claude-b");
        assert_eq!(body["max_tokens"], 100);
        assert_eq!(body["stream"], true);
        assert_eq!(body["messages"][1]["content"], "more");
        // Member order as captured.
        let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["model", "max_tokens", "stream", "messages"]);
        // No key given for a call that had one: refused, not sent without.
        assert!(matches!(
            plan(&t, &upstreams(), &redactor, &Edits::default(), None),
            Err(ReplayError::KeyMissing)
        ));
        // A key that would split the header.
        assert!(matches!(
            plan(&t, &upstreams(), &redactor, &Edits::default(), Some("k\r\nx-evil: 1")),
            Err(ReplayError::BadKey)
        ));
    }

    #[test]
    fn unedited_bodies_go_as_captured_and_paths_lose_the_upstream_prefix_and_a_redacted_query_key() {
        let text = "{\"model\": \"llama\",  \"messages\": []}";
        let mut t = trace(
            Api::OpenAiChat,
            "groq",
            "/openai/v1/chat/completions",
            &[("authorization", REDACTED)],
            "null",
        );
        t.request = JsonText::from_value(&serde_json::from_str::<Value>(text).unwrap());
        let p = plan(&t, &upstreams(), &Redactor::new(&[]), &Edits::default(), Some("gk")).unwrap();
        assert_eq!(p.path, "/groq/v1/chat/completions");
        assert_eq!(p.body, t.request.as_str().as_bytes());
        assert_eq!(p.headers["authorization"], "Bearer gk");

        let g = trace(
            Api::GeminiGenerateContent,
            "gemini",
            "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse&key=REDACTED",
            &[],
            r#"{"contents":[]}"#,
        );
        let edits = Edits {
            model: Some("gemini-2.5-pro".into()),
            ..Edits::default()
        };
        let p = plan(&g, &upstreams(), &Redactor::new(&[]), &edits, Some("AIza")).unwrap();
        assert_eq!(
            p.path,
            "/gemini/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
        );
        assert_eq!(p.headers["x-goog-api-key"], "AIza");
        assert!(serde_json::from_slice::<Value>(&p.body).unwrap().get("model").is_none());
        assert_eq!(key_variables(&g), ["GEMINI_API_KEY", "GOOGLE_API_KEY"]);

        // Forward-proxy capture of a host without a route; a SigV4-signed call; a bad pointer.
        let other = trace(Api::OpenAiChat, "api.example.com", "/v1/chat/completions", &[], "{}");
        assert!(matches!(
            plan(&other, &upstreams(), &Redactor::new(&[]), &Edits::default(), None),
            Err(ReplayError::NoRoute(_))
        ));
        let signed = trace(
            Api::AnthropicMessages,
            "anthropic",
            "/v1/messages",
            &[("x-amz-date", "2026")],
            "{}",
        );
        assert!(matches!(
            plan(&signed, &upstreams(), &Redactor::new(&[]), &Edits::default(), None),
            Err(ReplayError::Signed)
        ));
        let bad = Edits {
            set: vec![("/messages/7/content".into(), 1.into())],
            ..Edits::default()
        };
        assert!(matches!(
            plan(&t, &upstreams(), &Redactor::new(&[]), &bad, Some("k")),
            Err(ReplayError::Edit { .. })
        ));
    }
}
