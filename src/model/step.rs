//! `Step`: one turn of an agent trajectory, in the field names of the opentraces Step (seed 001) plus the facts
//! only a proxy sees (trajectory and trace ids, finish reason, status, timings, reasoning tokens).

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepRole {
    System,
    User,
    Agent,
}

impl StepRole {
    /// The serialized name (as in the step JSON).
    pub fn as_str(self) -> &'static str {
        match self {
            StepRole::System => "system",
            StepRole::User => "user",
            StepRole::Agent => "agent",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CallType {
    Main,
    Subagent,
    Warmup,
}

impl CallType {
    pub fn as_str(self) -> &'static str {
        match self {
            CallType::Main => "main",
            CallType::Subagent => "subagent",
            CallType::Warmup => "warmup",
        }
    }
}

/// Why a call was made: finer than `CallType` (which keeps the seed's main | subagent | warmup), mapped onto
/// each export format's own vocabulary (docs/architecture.md, "Call purpose").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Purpose {
    /// The agent's own conversation.
    Main,
    /// A delegated agent started by another trajectory's tool call (Task, handoff, transfer).
    Subagent,
    /// Cache priming: a one-token call that offers the agent's tools.
    Warmup,
    /// A one-token probe without tools (quota / access check).
    Quota,
    /// Summarizing a trajectory's history to continue it in a fresh context.
    Compaction,
    /// A one-shot call naming the conversation.
    Title,
    /// Any other auxiliary one-shot call (a tool's output summary, topic detection, ...).
    Side,
}

impl Purpose {
    pub fn as_str(self) -> &'static str {
        match self {
            Purpose::Main => "main",
            Purpose::Subagent => "subagent",
            Purpose::Warmup => "warmup",
            Purpose::Quota => "quota",
            Purpose::Compaction => "compaction",
            Purpose::Title => "title",
            Purpose::Side => "side",
        }
    }

    /// The seed's call_type for this purpose (auxiliary calls of the agent are `main`).
    pub fn call_type(self) -> CallType {
        match self {
            Purpose::Subagent => CallType::Subagent,
            Purpose::Warmup | Purpose::Quota => CallType::Warmup,
            _ => CallType::Main,
        }
    }

    /// Auxiliary calls that `llmtap sessions` folds into a count.
    pub fn is_auxiliary(self) -> bool {
        matches!(self, Purpose::Warmup | Purpose::Quota | Purpose::Title | Purpose::Side)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepToolCall {
    pub tool_call_id: String,
    pub tool_name: String,
    pub input: Value,
    /// Time from the end of this call's response to the request that carried the result: an upper bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub source_call_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_summary: Option<String>,
    /// `"tool_error"` when the client flagged the result as an error, `"no_result"` when it never arrived.
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snippet {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_line: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_line: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_step: Option<u32>,
}

/// Per-step tokens in the seed's names; values follow `model::usage` (input includes cache).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    pub prefix_reuse_tokens: u64,
    pub reasoning_tokens: u64,
    /// prefix_reuse_tokens was estimated from the common prefix rather than known exactly.
    #[serde(default)]
    pub prefix_reuse_estimated: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimings {
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_at: Option<String>,
    pub ended_at: String,
    pub duration_ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_first_token_ms: Option<f64>,
}

/// What an agent step adds to its call's span (`export::otlp::spans`). Deserialized from a stored step on its
/// own, it passes over the content, tool calls and observations (most of a step's bytes) without building them:
/// the exporter reads one per exported call.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StepSpanFacts {
    pub step_index: u32,
    #[serde(default)]
    pub agent_role: Option<String>,
    #[serde(default)]
    pub call_type: Option<CallType>,
    #[serde(default)]
    pub purpose: Option<Purpose>,
    pub token_usage: PrefixReuse,
}

/// The part of a step's [`TokenUsage`] its span carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct PrefixReuse {
    pub prefix_reuse_tokens: u64,
    #[serde(default)]
    pub prefix_reuse_estimated: bool,
}

impl From<&Step> for StepSpanFacts {
    fn from(s: &Step) -> Self {
        StepSpanFacts {
            step_index: s.step_index,
            agent_role: s.agent_role.clone(),
            call_type: s.call_type,
            purpose: s.purpose,
            token_usage: PrefixReuse {
                prefix_reuse_tokens: s.token_usage.prefix_reuse_tokens,
                prefix_reuse_estimated: s.token_usage.prefix_reuse_estimated,
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// `<trajectory_id>/<step_index>`: stable across replicas.
    pub step_id: String,
    pub trajectory_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    pub step_index: u32,
    pub role: StepRole,
    pub content: Option<String>,
    pub reasoning_content: Option<String>,
    pub model: Option<String>,
    pub system_prompt_hash: Option<String>,
    pub agent_role: Option<String>,
    pub parent_step: Option<u32>,
    pub call_type: Option<CallType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<Purpose>,
    pub tools_available: Vec<String>,
    pub tool_calls: Vec<StepToolCall>,
    pub observations: Vec<Observation>,
    pub snippets: Vec<Snippet>,
    pub token_usage: TokenUsage,
    pub timestamp: String,
    // --- beyond the seed ---
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_trajectory_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_trace_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// `ok`, `error` or `cancelled` (agent steps); `ok` otherwise.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<StepTimings>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    /// Agent steps: the cost of the step's call (see `ProviderTrace::cost`); absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<crate::model::cost::CostBreakdown>,
}

impl TrajectorySummary {
    /// The session the trajectory is grouped under: its session id, else (a row written without one) its own id.
    /// The store's queries spell the same rule in SQL (`store::sql`).
    pub fn session_key(&self) -> &str {
        self.session_id.as_deref().unwrap_or(&self.trajectory_id)
    }

    /// The trajectory this one hangs under in a session's tree: its parent, else the one it continues.
    pub fn tree_parent(&self) -> Option<&str> {
        self.parent_trajectory_id.as_deref().or(self.continues.as_deref())
    }

    /// A side call, title, warmup or quota probe: folded by `llmtap sessions`, dimmed by the viewer.
    pub fn is_auxiliary(&self) -> bool {
        self.purpose.is_some_and(Purpose::is_auxiliary)
    }

    /// Whether this is a run of the session's own (not auxiliary, not a compaction summary, not under another).
    fn is_top_level_run(&self) -> bool {
        !self.is_auxiliary() && self.purpose != Some(Purpose::Compaction) && self.tree_parent().is_none()
    }

    /// The cost of the trajectory's calls as a sum (see [`crate::model::cost::CostSum`]).
    pub fn cost(&self) -> crate::model::cost::CostSum {
        crate::model::cost::CostSum {
            usd: self.cost_usd,
            unpriced_calls: self.unpriced_calls,
        }
    }

    /// Add the part of this trajectory another replica saw (the shared store keeps one part per replica): the
    /// calls each replica derived are disjoint, so counts, tokens and cost add up; the steps seen are the most
    /// either saw (step indexes agree across replicas); the span is the union; links and purpose are taken from
    /// whichever part has them (only the replica that saw a sub-agent's parent call links it).
    pub fn absorb(&mut self, other: TrajectorySummary) {
        let earlier = other.started_at < self.started_at;
        self.session_id = match (self.session_id.take(), other.session_id) {
            // A part that names a session other than the trajectory itself knows more (a derived session).
            (Some(mine), Some(theirs)) if mine == self.trajectory_id && theirs != self.trajectory_id => Some(theirs),
            (mine, theirs) => mine.or(theirs),
        };
        self.agent = self.agent.take().or(other.agent);
        for m in other.models {
            if !self.models.contains(&m) {
                self.models.push(m);
            }
        }
        for c in other.call_types {
            if !self.call_types.contains(&c) {
                self.call_types.push(c);
            }
        }
        self.steps = self.steps.max(other.steps);
        self.llm_calls += other.llm_calls;
        // Purpose and title are learned from a trajectory's first call: the earlier part's win.
        self.purpose = if earlier {
            other.purpose.or(self.purpose)
        } else {
            self.purpose.or(other.purpose)
        };
        self.title = if earlier {
            other.title.or(self.title.take())
        } else {
            self.title.take().or(other.title)
        };
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens += other.cache_read_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
        self.cost_usd = match (self.cost_usd, other.cost_usd) {
            (Some(a), Some(b)) => a.checked_add(&b).or(Some(a)),
            (a, b) => a.or(b),
        };
        self.unpriced_calls += other.unpriced_calls;
        if earlier {
            self.started_at = other.started_at;
        }
        if other.ended_at > self.ended_at {
            self.ended_at = other.ended_at;
            if !other.tool_definitions.is_empty() {
                self.tool_definitions = other.tool_definitions;
            }
        } else if self.tool_definitions.is_empty() {
            self.tool_definitions = other.tool_definitions;
        }
        if self.parent_trajectory_id.is_none() {
            self.parent_trajectory_id = other.parent_trajectory_id;
            self.parent_step = other.parent_step;
            self.parent_tool_call_id = other.parent_tool_call_id;
        }
        self.continues = self.continues.take().or(other.continues);
        for (hash, text) in other.system_prompts {
            self.system_prompts.entry(hash).or_insert(text);
        }
        self.closed = self.closed && other.closed;
    }

    /// A copy without `system_prompts` and `tool_definitions` (an update that leaves them as they are).
    pub fn without_heavy_parts(&self) -> TrajectorySummary {
        TrajectorySummary {
            trajectory_id: self.trajectory_id.clone(),
            session_id: self.session_id.clone(),
            agent: self.agent.clone(),
            models: self.models.clone(),
            steps: self.steps,
            llm_calls: self.llm_calls,
            call_types: self.call_types.clone(),
            purpose: self.purpose,
            title: self.title.clone(),
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            cache_read_tokens: self.cache_read_tokens,
            cache_write_tokens: self.cache_write_tokens,
            cost_usd: self.cost_usd,
            unpriced_calls: self.unpriced_calls,
            started_at: self.started_at.clone(),
            ended_at: self.ended_at.clone(),
            parent_trajectory_id: self.parent_trajectory_id.clone(),
            parent_step: self.parent_step,
            parent_tool_call_id: self.parent_tool_call_id.clone(),
            continues: self.continues.clone(),
            system_prompts: Default::default(),
            tool_definitions: Vec::new(),
            closed: self.closed,
        }
    }
}

/// A session's title, from its trajectories (oldest first): the latest title a title call answered, else the
/// title (first user text) of its first run, else of its first trajectory that has one.
pub fn session_title<'a>(trajectories: impl IntoIterator<Item = &'a TrajectorySummary>) -> Option<&'a str> {
    let all: Vec<&TrajectorySummary> = trajectories.into_iter().collect();
    all.iter()
        .rev()
        .filter(|t| t.purpose == Some(Purpose::Title))
        .find_map(|t| t.title.as_deref())
        .or_else(|| {
            all.iter()
                .filter(|t| t.is_top_level_run())
                .find_map(|t| t.title.as_deref())
        })
        .or_else(|| {
            all.iter()
                .filter(|t| t.purpose != Some(Purpose::Title))
                .find_map(|t| t.title.as_deref())
        })
}

/// A trajectory as `llmtap sessions` shows it; rewritten as steps arrive and at close.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrajectorySummary {
    pub trajectory_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub models: Vec<String>,
    pub steps: u32,
    pub llm_calls: u32,
    pub call_types: Vec<String>,
    /// The purpose of the trajectory's first call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<Purpose>,
    /// What the trajectory is about, in a line (`derive::context`): for a title call the title it answered,
    /// otherwise its first user text without injected context. None for warmups, quota probes and compaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// The sum of the trajectory's calls' costs (null when no call had a known cost) and how many calls had
    /// none (then the sum is a lower bound).
    #[serde(default)]
    pub cost_usd: Option<crate::model::cost::CostBreakdown>,
    #[serde(default)]
    pub unpriced_calls: u32,
    pub started_at: String,
    pub ended_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_trajectory_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_step: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_tool_call_id: Option<String>,
    /// Set when this trajectory continues another after context compaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continues: Option<String>,
    /// system_prompt_hash → text.
    #[serde(default)]
    pub system_prompts: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub tool_definitions: Vec<Value>,
    pub closed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_roles_name_is_its_serialized_name() {
        for role in [StepRole::System, StepRole::User, StepRole::Agent] {
            assert_eq!(serde_json::to_value(role).ok(), Some(serde_json::json!(role.as_str())));
        }
    }
}
