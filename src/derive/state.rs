//! The deriver's cross-call state: open trajectories and the global index of tool calls awaiting results.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::Value;

use crate::model::call::{NormalizedCall, ToolCall};
use crate::model::cost::CostSum;
use crate::model::exchange::UnixMicros;
use crate::model::step::{CallType, Purpose, Step, TrajectorySummary};
use crate::model::trace::{ProviderTrace, rfc3339};

use super::context;
use super::prefix::LastCall;
use super::shared::Shared;
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

/// An open trajectory: what its next calls, late tool results and closing need, held compactly. Its summary
/// is built when emitted ([`Trajectory::summary`]); steps are kept only while they can still change.
pub struct Trajectory {
    /// Agent steps that may still receive late facts (those with calls waiting for results), by step index.
    pub steps: BTreeMap<u32, Box<Step>>,
    /// The latest call's step index when its step is not kept in `steps` (it waits for no result): it still
    /// counts as the newest step when deciding whether an answered step can change again.
    newest_unkept: Option<u32>,
    /// Tool call id → step index, for calls still waiting for their result.
    pub open_calls: HashMap<String, u32>,
    pub last: Option<LastCall>,
    pub last_end_us: UnixMicros,
    pub last_seen_us: UnixMicros,
    pub next_index: u32,
    /// (step index, how many calls were seen at it), by index (retries repeat an index).
    attempts: Vec<(u32, u32)>,
    pub parent: Option<ParentLink>,
    pub scope: String,
    pub purpose: Purpose,
    /// The step indexes this trajectory produced, sorted (STEPS is their count, not the largest index + 1: a
    /// trajectory that starts mid-conversation does not own the earlier indexes).
    indexes: Vec<u32>,
    totals: Totals,
}

/// The summary's own facts (the rest is derived from the trajectory's fields when it is built).
struct Totals {
    /// The native or derived session; `None`: the trajectory's own id.
    session: Option<String>,
    agent: Option<String>,
    /// The purpose of the first call.
    first_purpose: Option<Purpose>,
    continues: Option<String>,
    /// The trajectory a compaction call summarizes.
    summarizes: Option<String>,
    /// What the trajectory is about (`learn_title`).
    title: Option<String>,
    started_us: UnixMicros,
    /// The end of the latest call; `None` before the first.
    ended_us: Option<UnixMicros>,
    llm_calls: u32,
    input_tokens: u64,
    output_tokens: u64,
    cache_read_tokens: u64,
    cache_write_tokens: u64,
    cost: CostSum,
    /// Sorted, shared with other trajectories.
    models: Vec<Arc<str>>,
    /// Bit `CallType as u8` per call type seen.
    call_types: u8,
    /// (system prompt hash, its text) in the order first seen, shared with other trajectories.
    system_prompts: Vec<(Arc<str>, Arc<str>)>,
    tool_definitions: Option<Arc<[Value]>>,
}

const CALL_TYPES: [CallType; 3] = [CallType::Main, CallType::Subagent, CallType::Warmup];

impl Trajectory {
    pub fn new(trace: &ProviderTrace, origin: Origin) -> Trajectory {
        Trajectory {
            steps: BTreeMap::new(),
            newest_unkept: None,
            open_calls: HashMap::new(),
            last: None,
            last_end_us: 0,
            last_seen_us: trace.timings.start,
            next_index: 0,
            attempts: Vec::new(),
            parent: origin.parent,
            scope: origin.scope,
            purpose: origin.purpose.unwrap_or(Purpose::Main),
            indexes: Vec::new(),
            totals: Totals {
                session: origin.session,
                agent: trace.meta.agent.clone(),
                first_purpose: origin.purpose,
                continues: origin.continues,
                summarizes: origin.summarizes,
                title: None,
                started_us: trace.timings.start,
                ended_us: None,
                llm_calls: 0,
                input_tokens: 0,
                output_tokens: 0,
                cache_read_tokens: 0,
                cache_write_tokens: 0,
                cost: CostSum::default(),
                models: Vec::new(),
                call_types: 0,
                system_prompts: Vec::new(),
                tool_definitions: None,
            },
        }
    }

    /// The session the trajectory's steps and summary name (`id` is the trajectory's own).
    pub fn session_id<'a>(&'a self, id: &'a str) -> &'a str {
        self.totals.session.as_deref().unwrap_or(id)
    }

    pub fn agent(&self) -> Option<&str> {
        self.totals.agent.as_deref()
    }

    /// The trajectory this one is linked to: its parent's, else the one it summarizes.
    pub fn linked(&self) -> Option<&str> {
        self.parent
            .as_ref()
            .map(|p| p.trajectory_id.as_str())
            .or(self.totals.summarizes.as_deref())
    }

    pub fn has_tool_definitions(&self) -> bool {
        self.totals.tool_definitions.is_some()
    }

    /// Record the step indexes a call produced.
    pub fn add_indexes(&mut self, indexes: impl IntoIterator<Item = u32>) {
        for i in indexes {
            // Indexes mostly grow: appending is the common case.
            match self.indexes.last() {
                Some(last) if *last >= i => {
                    if let Err(at) = self.indexes.binary_search(&i) {
                        self.indexes.insert(at, i);
                    }
                }
                _ => self.indexes.push(i),
            }
        }
    }

    /// 1 for the first call at `index`, 2 for its first retry, ...
    pub fn next_attempt(&mut self, index: u32) -> u32 {
        match self.attempts.binary_search_by_key(&index, |(i, _)| *i) {
            Ok(at) => {
                self.attempts[at].1 += 1;
                self.attempts[at].1
            }
            Err(at) => {
                self.attempts.insert(at, (index, 1));
                1
            }
        }
    }

    /// Learn the trajectory's title from its call, until it has one: a title call's answer; for a trajectory of
    /// the agent's own, its first user text without injected context. Warmups, quota probes and compaction
    /// summaries (whose first user text is the run's they summarize) get none.
    pub fn learn_title(&mut self, call: &NormalizedCall) {
        if self.totals.title.is_some() {
            return;
        }
        self.totals.title = match self.purpose {
            Purpose::Warmup | Purpose::Quota | Purpose::Compaction => None,
            Purpose::Title => call.output.text.as_deref().and_then(context::title_from_answer),
            Purpose::Main | Purpose::Subagent | Purpose::Side => call
                .messages
                .iter()
                .filter(|m| m.has_user_text())
                .find_map(|m| context::title_from_user_text(&m.text())),
        };
    }

    /// Learn the call's system prompt and tool definitions; true when the summary's large parts changed.
    pub fn learn_definitions(&mut self, call: &NormalizedCall, sp_hash: Option<&str>, shared: &mut Shared) -> bool {
        let mut changed = false;
        let t = &mut self.totals;
        if let (Some(h), Some(text)) = (sp_hash, &call.system)
            && !t.system_prompts.iter().any(|(known, _)| &**known == h)
        {
            t.system_prompts.push((shared.str(h), shared.str(text)));
            changed = true;
        }
        if t.tool_definitions.is_none() && !call.tools.is_empty() {
            t.tool_definitions = Some(shared.tools(&call.tools));
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
    pub fn record_call(
        &mut self,
        id: &str,
        fact: &CallFacts<'_>,
        heavy_changed: bool,
        shared: &mut Shared,
    ) -> TrajectorySummary {
        let usage = fact.call.usage.unwrap_or_default();
        let end = fact.trace.timings.end;
        self.last_end_us = end;
        self.last_seen_us = end.max(fact.trace.timings.start);
        let t = &mut self.totals;
        if let Some(m) = fact.model
            && let Err(at) = t.models.binary_search_by(|known| (**known).cmp(m))
        {
            t.models.insert(at, shared.str(m));
        }
        t.call_types |= 1 << fact.call_type as u8;
        t.llm_calls += 1;
        t.input_tokens += usage.input;
        t.output_tokens += usage.output;
        t.cache_read_tokens += usage.cache_read.unwrap_or(0);
        t.cache_write_tokens += usage.cache_write.unwrap_or(0);
        t.cost.add_call(fact.trace.cost.as_ref());
        t.ended_us = Some(end);
        if t.agent.is_none() {
            t.agent = fact.trace.meta.agent.clone();
        }
        self.summary(id, heavy_changed)
    }

    /// The trajectory's summary as of its latest call; with its system prompts and tool definitions when
    /// `heavy`.
    pub fn summary(&self, id: &str, heavy: bool) -> TrajectorySummary {
        let t = &self.totals;
        let mut call_types: Vec<&str> = CALL_TYPES
            .iter()
            .filter(|c| t.call_types & (1 << **c as u8) != 0)
            .map(|c| c.as_str())
            .collect();
        call_types.sort_unstable();
        let (system_prompts, tool_definitions) = if heavy {
            let prompts = t
                .system_prompts
                .iter()
                .map(|(h, text)| (h.to_string(), text.to_string()))
                .collect();
            (
                prompts,
                t.tool_definitions.as_deref().map(<[Value]>::to_vec).unwrap_or_default(),
            )
        } else {
            Default::default()
        };
        TrajectorySummary {
            trajectory_id: id.to_owned(),
            session_id: Some(self.session_id(id).to_owned()),
            agent: t.agent.clone(),
            models: t.models.iter().map(|m| m.to_string()).collect(),
            steps: self.indexes.len() as u32,
            llm_calls: t.llm_calls,
            call_types: call_types.into_iter().map(str::to_owned).collect(),
            purpose: t.first_purpose,
            title: t.title.clone(),
            input_tokens: t.input_tokens,
            output_tokens: t.output_tokens,
            cache_read_tokens: t.cache_read_tokens,
            cache_write_tokens: t.cache_write_tokens,
            cost_usd: t.cost.usd,
            unpriced_calls: t.cost.unpriced_calls,
            started_at: rfc3339(t.started_us),
            ended_at: t.ended_us.map(rfc3339).unwrap_or_default(),
            parent_trajectory_id: self.linked().map(str::to_owned),
            parent_step: self.parent.as_ref().map(|p| p.step_index),
            parent_tool_call_id: self.parent.as_ref().map(|p| p.tool_call_id.clone()),
            continues: t.continues.clone(),
            system_prompts,
            tool_definitions,
            closed: false,
        }
    }

    /// Keep only steps that can still change: those with open calls, and the latest if it has some.
    pub fn keep_live_steps(&mut self, latest: &Step) {
        let open: BTreeSet<u32> = self.open_calls.values().copied().collect();
        self.steps.retain(|idx, _| open.contains(idx));
        if open.contains(&latest.step_index) {
            self.steps.insert(latest.step_index, Box::new(latest.clone()));
            self.newest_unkept = None;
        } else {
            self.newest_unkept = Some(latest.step_index);
        }
    }

    /// The largest step index among the steps kept and the latest call's.
    pub fn newest_step(&self) -> Option<u32> {
        self.steps.keys().next_back().copied().max(self.newest_unkept)
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
    /// Boxed: the table keeps room for more entries than it holds, at the size of a pointer each.
    pub trajectories: HashMap<String, Box<Trajectory>>,
    /// Open tool call id → owning trajectory.
    pub call_owner: HashMap<String, String>,
    pub candidates: ParentCandidates,
    pub shared: Shared,
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
