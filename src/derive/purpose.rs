//! Why a new root was called (its purpose) and which session it belongs to.
//!
//! Purposes come from how clients use the protocol, not from any one client's wording where avoidable:
//! - `warmup` / `quota`: at most one output token allowed; `warmup` offers tools (priming the agent's cached
//!   prompt), `quota` offers none (an access / rate-limit probe);
//! - `compaction`: `identity::is_compaction_request`;
//! - `subagent`: started by a delegation tool or a handoff (`subagent`);
//! - `side`: a one-shot call (no assistant turn in its request) that offers no tools and either quotes an
//!   ordinary tool call's argument (a summary of that tool's output) or runs in a session whose agent offers
//!   tools under another system prompt (topic detection and other helpers of the session's agent);
//! - `title`: such a side call whose system prompt asks for a title;
//! - `main`: everything else.

use crate::model::call::{NormalizedCall, Role};
use crate::model::step::Purpose;

use super::identity::{is_compaction_request, is_warmup, system_prompt_hash};
use super::state::{ParentLink, State};

/// The purpose a call has by itself, whatever trajectory it joins.
pub fn intrinsic(call: &NormalizedCall) -> Option<Purpose> {
    if is_warmup(call) {
        return Some(if call.tools.is_empty() {
            Purpose::Quota
        } else {
            Purpose::Warmup
        });
    }
    is_compaction_request(call).then_some(Purpose::Compaction)
}

fn is_one_shot(call: &NormalizedCall) -> bool {
    call.tools.is_empty() && !call.messages.iter().any(|m| m.role == Role::Assistant)
}

fn asks_for_title(call: &NormalizedCall) -> bool {
    call.system
        .as_deref()
        .is_some_and(|s| s.to_lowercase().contains("title"))
}

impl State {
    /// The purpose of a call that starts a new trajectory. `scope` is its native session (empty when none).
    pub fn root_purpose(&self, call: &NormalizedCall, scope: &str, parent: Option<&ParentLink>) -> Purpose {
        if let Some(p) = intrinsic(call) {
            return p;
        }
        if let Some(link) = parent {
            return if !link.delegated && call.tools.is_empty() {
                Purpose::Side
            } else {
                Purpose::Subagent
            };
        }
        if scope.is_empty() || !is_one_shot(call) {
            return Purpose::Main;
        }
        if asks_for_title(call) {
            return Purpose::Title;
        }
        let sp = call.system.as_deref().map(system_prompt_hash);
        let helper_of_agent = self.trajectories.values().any(|t| {
            t.scope == scope
                && t.purpose == Purpose::Main
                && t.has_tool_definitions()
                && t.last.as_ref().is_some_and(|l| l.system_hash() != sp.as_deref())
        });
        if helper_of_agent { Purpose::Side } else { Purpose::Main }
    }

    /// The session of a new trajectory: the native session; else the Responses conversation; else the session
    /// of the trajectory it is linked to (parent, summarized, continued); for a warmup, that of the open
    /// trajectory of the same agent and system prompt it primes. None: a session of its own (its id).
    pub fn root_session(
        &self,
        call: &NormalizedCall,
        scope: &str,
        agent: Option<&str>,
        linked: &[Option<&str>],
    ) -> Option<String> {
        if !scope.is_empty() {
            return Some(scope.to_owned());
        }
        if let Some(c) = &call.conversation_id {
            return Some(c.clone());
        }
        let session_of = |id: &str| self.trajectories.get(id).map(|t| t.session_id(id).to_owned());
        if let Some(s) = linked.iter().flatten().find_map(|id| session_of(id)) {
            return Some(s);
        }
        if is_warmup(call) {
            let sp = call.system.as_deref().map(system_prompt_hash);
            return self
                .trajectories
                .iter()
                .filter(|(_, t)| {
                    t.purpose == Purpose::Main
                        && t.agent() == agent
                        && t.last.as_ref().is_some_and(|l| l.system_hash() == sp.as_deref())
                })
                .max_by(|(a_id, a), (b_id, b)| (a.last_seen_us, a_id).cmp(&(b.last_seen_us, b_id)))
                .map(|(id, t)| t.session_id(id).to_owned());
        }
        None
    }
}
