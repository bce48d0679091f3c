//! The native session of a call: the id the agent or its client already sends. Sources, first found wins:
//! 1. `x-llmtap-session` (or the `/s/<id>/` path form): set by the user, always wins;
//! 2. the client's own session header: Claude Code `x-claude-code-session-id` (2.1.86+), Codex CLI `session-id`
//!    (`session_id` / `conversation_id` in earlier releases);
//! 3. the session part of Claude Code's `metadata.user_id` (JSON `session_id` from 2.1.78, `_session_<uuid>`
//!    before).
//!
//! OpenAI Responses `conversation` and `previous_response_id` chains name a trajectory directly
//! (`identity::Resolver`); a call without any of these gets a derived session (`purpose::root_session`).

use crate::model::call::NormalizedCall;
use crate::model::trace::ProviderTrace;

/// The native session id, or "" when the call carries none.
pub fn native_scope(trace: &ProviderTrace, call: &NormalizedCall) -> String {
    trace
        .meta
        .session
        .as_deref()
        .or(trace.meta.client_session.as_deref())
        .or(call.client_session.as_deref())
        .unwrap_or("")
        .to_owned()
}
