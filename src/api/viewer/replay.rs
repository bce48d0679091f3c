//! The viewer's Replay (`[viewer] replay = true`): `GET api/calls/<id>/replay` says what a replay of the call
//! would start from and links the call to its original and its replays; `POST api/calls/<id>/replay` re-sends
//! it, edited, through this llmtap's proxy (`api::replay`) and answers with the new call's id once it is captured.
//!
//! The POST carries the user's key, typed into the page: it goes into the replay's request and nowhere else (no
//! log line, no answer, no error message holds it). Like every `/api/` route it is refused from another site's
//! page (`api::auth`) and, beyond loopback, without the token; it also requires `Content-Type:
//! application/json`, which a cross-site form cannot send without a CORS preflight that the viewer never grants.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use serde_json::{Value, json};

use super::{Body, data, json_response};
use crate::api::replay::{self, Edits, ReplayError};
use crate::api::{LiveEvent, LiveTx};
use crate::model::trace::rfc3339;
use crate::store::{Query, Store, StoreError};

/// The largest replay request the page may post (an agent's request with its whole conversation, edited).
const MAX_REQUEST_BYTES: usize = 64 << 20;
/// How long the provider may take to answer a replay, stream included.
const ANSWER_WAIT: Duration = Duration::from_secs(600);
/// How long, after the answer, the replay's capture may take to reach the store.
const CAPTURE_WAIT: Duration = Duration::from_secs(20);

/// The page's replay request. The key is the user's (never stored); the rest are edits.
#[derive(serde::Deserialize)]
struct Posted {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    model: Option<String>,
    /// The whole edited body (the page's editor), instead of the captured one.
    #[serde(default)]
    body: Option<Value>,
    /// JSON pointer → new value.
    #[serde(default)]
    set: serde_json::Map<String, Value>,
}

/// What the call page shows about replays: whether it may replay (and if not, why), what a replay starts from
/// (model and body), the key it needs, the call it replayed and its own replays (oldest first).
pub fn info(reader: &dyn Query, ctx: &data::Context, id: &str) -> Result<Option<Value>, StoreError> {
    let Some(trace) = reader.trace(id)? else {
        return Ok(None);
    };
    let mut replays = Vec::new();
    for (rid, session) in reader.replays_of(id)? {
        let head = reader.call_head(&rid)?;
        replays.push(json!({
            "id": rid,
            "session": session,
            "model": head.as_ref().and_then(|h| h.model.clone()),
            "status": head.as_ref().and_then(|h| h.status),
            "outcome": head.as_ref().map(|h| h.outcome.as_str()),
            "started_at": head.as_ref().map(|h| rfc3339(h.timings.start)),
        }));
    }
    // Whether this call can be rebuilt at all (a route for its upstream, no signature, no key in the path).
    let refusal = replay::plan(&trace, &ctx.upstreams, &ctx.redactor, &Edits::default(), Some("k"))
        .err()
        .map(|e| e.to_string());
    let (key, key_needed) = replay::key_header(&trace);
    Ok(Some(json!({
        "id": trace.id,
        "enabled": ctx.replay_proxy.is_some(),
        "refusal": refusal,
        "replay_of": trace.meta.replay_of,
        "replays": replays,
        "model": replay::requested_model(&trace),
        "body": trace.request.to_value(),
        "streamed": trace.streamed,
        "key_header": key.name(),
        "key_needed": key_needed,
    })))
}

/// Re-send call `id` with the posted edits and key; answer `{id, session, status}` (`id` null when the capture
/// did not reach the store in time).
pub async fn post(
    store: Store,
    ctx: Arc<data::Context>,
    live: LiveTx,
    id: String,
    req: axum::extract::Request,
) -> Response<Body> {
    let Some(proxy) = ctx.replay_proxy else {
        return error(
            StatusCode::FORBIDDEN,
            "replay is off: set [viewer] replay = true in llmtap's config",
        );
    };
    let json_body = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json_body {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a replay is posted as application/json",
        );
    }
    let bytes = match Limited::new(req.into_body(), MAX_REQUEST_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "the replay request is too large or was cut",
            );
        }
    };
    // serde's message could quote the posted text, key included: a fixed message instead.
    let Ok(posted) = serde_json::from_slice::<Posted>(&bytes) else {
        return error(
            StatusCode::BAD_REQUEST,
            "the replay request is not JSON of the form {key, model, body, set}",
        );
    };
    drop(bytes);
    let edits = Edits {
        body: posted.body,
        set: posted.set.into_iter().collect(),
        unset: Vec::new(),
        model: posted.model.filter(|m| !m.is_empty()),
    };
    let lookup = id.clone();
    let reader = store.clone();
    let trace = match tokio::task::spawn_blocking(move || reader.read(|r| r.trace(&lookup))).await {
        Ok(Ok(Some(t))) => t,
        Ok(Ok(None)) => return error(StatusCode::NOT_FOUND, "no such call"),
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    let plan = match replay::plan(&trace, &ctx.upstreams, &ctx.redactor, &edits, posted.key.as_deref()) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    drop(posted.key);
    let session = plan.session.clone();
    // Subscribed before sending: the capture's event cannot pass unseen.
    let mut events = live.subscribe();
    let answered = tokio::time::timeout(ANSWER_WAIT, async {
        let response = replay::send(proxy, plan).await?;
        let status = response.status().as_u16();
        // Read to the end (a stream included): the call is captured once its response is over.
        let mut body = response.into_body();
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                break;
            }
        }
        Ok::<u16, ReplayError>(status)
    })
    .await;
    let status = match answered {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return error(StatusCode::BAD_GATEWAY, &e.to_string()),
        Err(_) => {
            return error(
                StatusCode::GATEWAY_TIMEOUT,
                "the provider did not finish answering in time",
            );
        }
    };
    // The new call: its live event names the replay's session; the store is asked too (a missed event, or a
    // viewer reading a shared store).
    let deadline = Instant::now() + CAPTURE_WAIT;
    let mut found = None;
    while found.is_none() && Instant::now() < deadline {
        let wait = tokio::time::timeout(Duration::from_millis(500), events.recv()).await;
        match wait {
            Ok(Ok(LiveEvent::Trace(t))) if t.session.as_deref() == Some(session.as_str()) => {
                found = Some(t.id.clone());
                continue;
            }
            Ok(Ok(_)) => continue,
            Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Ok(Err(_)) | Err(_) => {}
        }
        let (reader, original, s) = (store.clone(), id.clone(), session.clone());
        if let Ok(Ok(Some(new))) =
            tokio::task::spawn_blocking(move || reader.read(|r| replay::captured(r, &original, &s))).await
        {
            found = Some(new);
        }
    }
    json_response(
        StatusCode::OK,
        &json!({ "id": found, "replay_of": id, "session": session, "status": status }),
    )
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(status, &json!({ "error": message }))
}
