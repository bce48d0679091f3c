//! The deriver's cross-call state: open trajectories and the global index of tool calls awaiting results.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::model::call::{NormalizedCall, ToolCall};
use crate::model::exchange::UnixMicros;
use crate::model::step::{CallType, Purpose, Step, TrajectorySummary};
use crate::model::trace::{ProviderTrace, rfc3339};

use super::prefix::LastCall;
use super::subagent::ParentCandidates;

/// The tool call of another trajectory that started this one.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentLink {
    pub trajectory_id: String,
    pub step_index: u32,
    pub tool_call_id: String,
    pub agent_role: Option<String>,
    /// Started by a delegation tool or a handoff (a sub-agent), rather than quoting an ordinary tool's
    /// argument (a side call about that tool's work).
    pub delegated: bool,
}

/// How a trajectory came to be: started by another's tool call, continuing one after compaction, or
/// summarizing one (a compaction call); its purpose and session.
#[derive(Debug, Default)]
pub struct Origin {
    pub parent: Option<ParentLink>,
    pub continues: Option<String>,
    pub summarizes: Option<String>,
    pub purpose: Option<Purpose>,
    /// The native session (empty when none): what the trajectory's root key was scoped by.
    pub scope: String,
    pub session: Option<String>,
}

pub struct Trajectory {
    pub summary: TrajectorySummary,
    /// Agent steps that may still receive late facts, by step index.
    pub steps: BTreeMap<u32, Step>,
    /// Tool call id → step index, for calls still waiting for their result.
    pub open_calls: HashMap<String, u32>,
    pub last: Option<LastCall>,
    pub last_end_us: UnixMicros,
    pub last_seen_us: UnixMicros,
    pub next_index: u32,
    /// How many calls were seen at each agent step index (retries repeat an index).
    attempts: HashMap<u32, u32>,
    pub parent: Option<ParentLink>,
    pub scope: String,
    pub purpose: Purpose,
    /// The step indexes this trajectory produced (STEPS is their count, not the largest index + 1: a
    /// trajectory that starts mid-conversation does not own the earlier indexes).
    indexes: BTreeSet<u32>,
    models: BTreeSet<String>,
    call_types: BTreeSet<&'static str>,
}

impl Trajectory {
    pub fn new(id: &str, trace: &ProviderTrace, origin: Origin) -> Trajectory {
        Trajectory {
            summary: TrajectorySummary {
                trajectory_id: id.to_owned(),
                session_id: origin.session.or_else(|| Some(id.to_owned())),
                agent: trace.meta.agent.clone(),
                started_at: rfc3339(trace.timings.start),
                continues: origin.continues,
                purpose: origin.purpose,
                parent_trajectory_id: origin.summarizes,
                ..TrajectorySummary::default()
            },
            steps: BTreeMap::new(),
            open_calls: HashMap::new(),
            last: None,
            last_end_us: 0,
            last_seen_us: trace.timings.start,
            next_index: 0,
            attempts: HashMap::new(),
            parent: origin.parent,
            scope: origin.scope,
            purpose: origin.purpose.unwrap_or(Purpose::Main),
            indexes: BTreeSet::new(),
            models: BTreeSet::new(),
            call_types: BTreeSet::new(),
        }
    }

    /// Record the step indexes a call produced.
    pub fn add_indexes(&mut self, indexes: impl IntoIterator<Item = u32>) {
        self.indexes.extend(indexes);
    }

    /// 1 for the first call at `index`, 2 for its first retry, ...
    pub fn next_attempt(&mut self, index: u32) -> u32 {
        let attempt = self.attempts.entry(index).or_insert(0);
        *attempt += 1;
        *attempt
    }

    /// Learn the call's system prompt and tool definitions; true when the summary's large parts changed.
    pub fn learn_definitions(&mut self, call: &NormalizedCall, sp_hash: Option<&str>) -> bool {
        let mut changed = false;
        if let (Some(h), Some(text)) = (sp_hash, &call.system)
            && !self.summary.system_prompts.contains_key(h)
        {
            self.summary.system_prompts.insert(h.to_owned(), text.clone());
            changed = true;
        }
        if self.summary.tool_definitions.is_empty() && !call.tools.is_empty() {
            self.summary.tool_definitions = call.tools.iter().filter_map(|t| serde_json::to_value(t).ok()).collect();
            changed = true;
        }
        changed
    }

    pub fn await_results(&mut self, calls: &[ToolCall], index: u32) {
        for c in calls {
            self.open_calls.insert(c.id.clone(), index);
        }
    }

    /// Add one call to the totals; the summary to emit (without the large parts unless they changed, since
    /// the store keeps the last ones it was given).
    pub fn record_call(&mut self, fact: &CallFacts<'_>, heavy_changed: bool) -> TrajectorySummary {
        let usage = fact.call.usage.unwrap_or_default();
        let end = fact.trace.timings.end;
        self.last_end_us = end;
        self.last_seen_us = end.max(fact.trace.timings.start);
        if let Some(m) = fact.model {
            self.models.insert(m.to_owned());
        }
        self.call_types.insert(fact.call_type.as_str());
        let s = &mut self.summary;
        s.llm_calls += 1;
        s.input_tokens += usage.input;
        s.output_tokens += usage.output;
        s.cache_read_tokens += usage.cache_read.unwrap_or(0);
        s.cache_write_tokens += usage.cache_write.unwrap_or(0);
        let mut cost = s.cost();
        cost.add_call(fact.trace.cost.as_ref());
        s.cost_usd = cost.usd;
        s.unpriced_calls = cost.unpriced_calls;
        s.ended_at = rfc3339(end);
        s.steps = self.indexes.len() as u32;
        s.models = self.models.iter().cloned().collect();
        s.call_types = self.call_types.iter().map(|c| (*c).to_owned()).collect();
        if s.agent.is_none() {
            s.agent = fact.trace.meta.agent.clone();
        }
        if let Some(p) = &self.parent {
            s.parent_trajectory_id = Some(p.trajectory_id.clone());
            s.parent_step = Some(p.step_index);
            s.parent_tool_call_id = Some(p.tool_call_id.clone());
        }
        if heavy_changed {
            s.clone()
        } else {
            s.without_heavy_parts()
        }
    }

    /// Keep only steps that can still change: those with open calls, and the latest.
    pub fn keep_live_steps(&mut self, latest: &Step) {
        let open: BTreeSet<u32> = self.open_calls.values().copied().collect();
        self.steps.retain(|idx, _| open.contains(idx));
        self.steps.insert(latest.step_index, latest.clone());
    }
}

/// What `record_call` needs to know about the call.
pub struct CallFacts<'a> {
    pub trace: &'a ProviderTrace,
    pub call: &'a NormalizedCall,
    /// The model that answered, else the one requested.
    pub model: Option<&'a str>,
    pub call_type: CallType,
}

/// Open trajectories and the tool calls that wait for results, across trajectories (a handoff carries the
/// parent's call into the child's request, so results are joined globally).
#[derive(Default)]
pub struct State {
    pub trajectories: HashMap<String, Trajectory>,
    /// Open tool call id → owning trajectory.
    pub call_owner: HashMap<String, String>,
    pub candidates: ParentCandidates,
}

impl State {
    /// Index a call's tool calls as waiting for results (and as possible sub-agent parents).
    pub fn index_open_calls(&mut self, owner: &str, calls: &[ToolCall], at: UnixMicros) {
        for c in calls {
            self.call_owner.insert(c.id.clone(), owner.to_owned());
            self.candidates.add(&c.id, owner, &c.name, &c.arguments, at);
        }
    }

    /// A call that got its result, or never will.
    pub fn forget_call(&mut self, call_id: &str) {
        self.call_owner.remove(call_id);
        self.candidates.remove(call_id);
    }
}
