//! The vocabulary of one HTTP exchange, shared by the data path (which records it), traces, derivation and
//! exports: which API it spoke, how it ended, its timings, the session metadata the agent passed.

/// Which API an exchange spoke, decided from the upstream's family and the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Api {
    #[serde(rename = "openai.chat")]
    OpenAiChat,
    #[serde(rename = "openai.responses")]
    OpenAiResponses,
    #[serde(rename = "anthropic.messages")]
    AnthropicMessages,
    #[serde(rename = "gemini.generate_content")]
    GeminiGenerateContent,
    /// AWS Bedrock's own Converse protocol (`/converse`, `/converse-stream`).
    #[serde(rename = "bedrock.converse")]
    BedrockConverse,
    /// Anything else on a configured upstream (embeddings, model lists, token counting, ...).
    #[serde(rename = "other")]
    Other,
}

impl Api {
    pub fn as_str(self) -> &'static str {
        match self {
            Api::OpenAiChat => "openai.chat",
            Api::OpenAiResponses => "openai.responses",
            Api::AnthropicMessages => "anthropic.messages",
            Api::GeminiGenerateContent => "gemini.generate_content",
            Api::BedrockConverse => "bedrock.converse",
            Api::Other => "other",
        }
    }

    pub fn parse(s: &str) -> Api {
        match s {
            "openai.chat" => Api::OpenAiChat,
            "openai.responses" => Api::OpenAiResponses,
            "anthropic.messages" => Api::AnthropicMessages,
            "gemini.generate_content" => Api::GeminiGenerateContent,
            "bedrock.converse" => Api::BedrockConverse,
            _ => Api::Other,
        }
    }
}

/// How an exchange ended, from the client's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The whole response reached the client and was captured.
    Complete,
    /// The client went away before the response ended; the upstream request was cancelled.
    ClientGone,
    /// The upstream could not be reached, failed mid-body, or answered with an error status (4xx/5xx; the
    /// trace's `status` says which).
    UpstreamError,
    /// The response was forwarded completely but exceeded the capture cap.
    Truncated,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::ClientGone => "client_gone",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Truncated => "truncated",
        }
    }

    pub fn parse(s: &str) -> Outcome {
        match s {
            "complete" => Outcome::Complete,
            "client_gone" => Outcome::ClientGone,
            "truncated" => Outcome::Truncated,
            _ => Outcome::UpstreamError,
        }
    }
}

/// Wall-clock microseconds since the Unix epoch.
pub type UnixMicros = i64;

pub fn now_micros() -> UnixMicros {
    // Straight from the clock: chrono's `Utc::now` also builds a calendar date, a few hundred instructions
    // per call on the data path (three calls per exchange).
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as UnixMicros)
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    /// Request head received from the client.
    pub start: UnixMicros,
    /// First response body byte from the upstream (None if none arrived).
    pub first_byte: Option<UnixMicros>,
    /// Response finished (or failed, or the client left).
    pub end: UnixMicros,
}

/// Session metadata the agent passed with `x-llmtap-*` headers or the `/s/<id>/` path form.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExchangeMeta {
    /// Explicit session: `x-llmtap-session` or the `/s/<id>/` path form.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The session id the client itself sends (Claude Code `x-claude-code-session-id`, Codex `session-id` /
    /// `session_id` / `conversation_id`). Read from the live headers before redaction: the stored header list
    /// keeps these values redacted (their names contain "session"), this typed field keeps the identifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// W3C trace context the agent sent, kept so exports can join the agent's own trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The call this one re-sent (`llmtap replay`, the viewer's Replay): the trace id in [`REPLAY_OF_HEADER`],
    /// set by the pipeline from the captured request headers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_of: Option<String>,
}

/// The request header a replay carries naming the call it re-sends. Unlike llmtap's other `x-llmtap-*` headers it
/// stays in the captured request headers (the pipeline reads it from there, so the data path and the spill's
/// record format know nothing of replays); like them it is never forwarded upstream.
pub const REPLAY_OF_HEADER: &str = "x-llmtap-replay-of";

/// `value` when it can be a trace id (letters, digits, `-`, `_`; at most 64): a header anyone can send names
/// no more than that.
pub fn replay_of_value(value: &str) -> Option<String> {
    let v = value.trim();
    (!v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
        .then(|| v.to_owned())
}
