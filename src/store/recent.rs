//! What the writer committed last, kept in memory for the exporters.
//!
//! An exporter builds each call's span from the trace row, its agent step and, when the trajectory closes, the
//! trajectory row, usually a fraction of a second after the writer committed them. Reading them back meant
//! SQLite lookups and JSON (and zstd) decoding for records the writer had just held in memory. The writer now
//! hands each committed batch to [`RecentRecords`] (it owns the records by then: nothing is copied but what an
//! exporter reads), and a [`super::StoreReader`] given this cache answers the exporters' four lookups from it,
//! and from the store for whatever the cache does not hold (a backlog older than the cache, a restart).
//!
//! Each answer equals what the store gives for the same record: the writer's own normalization is applied on
//! the way in (a trace's session id falls back to its session header, bodies are left out; a trajectory is held
//! without its system prompts and tool definitions), and the test
//! `store::recent::tests::answers_equal_the_stores` reads both over real derivations. The cache holds the last
//! version committed, as the store does. It is bounded by entries (oldest out first) and cleared when
//! retention deletes rows, so it never answers for a record the store no longer has.

use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

use rustc_hash::FxHashMap;

use crate::model::json::JsonText;
use crate::model::record::Record;
use crate::model::step::{StepRole, StepSpanFacts, TrajectorySummary};
use crate::model::trace::ProviderTrace;

/// Records of each kind held. An exporter that keeps up reads the export log every 200 ms at most, so at 10,000
/// exchanges/s what it reads was committed within the last few thousand; one that lags reads the rest from the
/// store.
pub const DEFAULT_ENTRIES: usize = 4_096;

/// Estimated bytes held for each kind at most (see `held_bytes`): the whole cache stays within ~10 MiB however
/// large the records' headers or summaries are. The writer empties it after a second without records.
const DEFAULT_BYTES: usize = 3 << 20;

/// A map that forgets its oldest keys beyond `capacity` entries or `max_bytes` estimated bytes (by first
/// insertion; replacing a value keeps its place).
struct Bounded<K, V> {
    map: FxHashMap<K, (V, usize)>,
    order: VecDeque<K>,
    capacity: usize,
    bytes: usize,
    max_bytes: usize,
}

impl<K: Hash + Eq + Clone, V> Bounded<K, V> {
    fn new(capacity: usize, max_bytes: usize) -> Self {
        Bounded {
            map: FxHashMap::default(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
            bytes: 0,
            max_bytes,
        }
    }

    /// Insert `value`, estimated at `size` bytes.
    fn insert(&mut self, key: K, value: V, size: usize) {
        self.bytes += size;
        match self.map.insert(key.clone(), (value, size)) {
            Some((_, old)) => self.bytes -= old,
            None => self.order.push_back(key),
        }
        while self.order.len() > self.capacity || (self.bytes > self.max_bytes && self.order.len() > 1) {
            let Some(old) = self.order.pop_front() else { break };
            if let Some((_, size)) = self.map.remove(&old) {
                self.bytes -= size;
            }
        }
    }

    fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
    {
        self.map.get(key).map(|(v, _)| v)
    }

    fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
        self.bytes = 0;
    }
}

/// A rough size of what a held record keeps on the heap: the record's own struct, its variable-length texts, and
/// an allocator's overhead for each of them. It only has to grow with the record, so that large headers or
/// summaries cannot hold many megabytes.
fn held_bytes<'a>(fixed: usize, texts: impl IntoIterator<Item = &'a str>) -> usize {
    const PER_ALLOCATION: usize = 32;
    fixed + texts.into_iter().map(|t| t.len() + PER_ALLOCATION).sum::<usize>()
}

fn trace_bytes(t: &ProviderTrace) -> usize {
    let headers = t.request_headers.iter().chain(&t.response_headers);
    held_bytes(
        std::mem::size_of::<ProviderTrace>() + 512,
        [t.id.as_str(), &t.upstream, &t.path, &t.method]
            .into_iter()
            .chain(headers.flat_map(|(k, v)| [k.as_str(), v.as_str()]))
            .chain(t.error.as_deref())
            .chain(t.model.as_deref()),
    )
}

fn trajectory_bytes(t: &TrajectorySummary) -> usize {
    held_bytes(
        std::mem::size_of::<TrajectorySummary>() + 256,
        [t.trajectory_id.as_str(), &t.started_at, &t.ended_at]
            .into_iter()
            .chain(t.models.iter().map(String::as_str))
            .chain(t.session_id.as_deref())
            .chain(t.agent.as_deref())
            .chain(t.parent_trajectory_id.as_deref())
            .chain(t.parent_tool_call_id.as_deref()),
    )
}

/// The agent step a trace id leads to, as `StoreReader::step_span_facts_for_trace` finds it. A step's trace id
/// is set when the deriver makes the step and stays with every later version of it.
enum StepOfTrace {
    Step {
        step_id: String,
        facts: StepSpanFacts,
    },
    /// Two steps named this trace: the store knows which one its query picks.
    AskTheStore,
}

struct Inner {
    traces: Bounded<String, Arc<ProviderTrace>>,
    steps_by_trace: Bounded<String, StepOfTrace>,
    trajectories: Bounded<String, Arc<TrajectorySummary>>,
}

/// The exporters' view of the last committed records (see the module doc).
pub struct RecentRecords {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for RecentRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("RecentRecords")
            .field("traces", &inner.traces.map.len())
            .field("trajectories", &inner.trajectories.map.len())
            .finish_non_exhaustive()
    }
}

impl Default for RecentRecords {
    fn default() -> Self {
        RecentRecords::new(DEFAULT_ENTRIES)
    }
}

impl RecentRecords {
    pub fn new(entries: usize) -> RecentRecords {
        RecentRecords {
            inner: Mutex::new(Inner {
                traces: Bounded::new(entries, DEFAULT_BYTES),
                steps_by_trace: Bounded::new(entries, DEFAULT_BYTES),
                trajectories: Bounded::new(entries, DEFAULT_BYTES),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-made entry (each insert is one map operation), so
        // a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take in a batch the writer has committed, in the batch's order (a later version replaces an earlier one).
    pub fn remember(&self, batch: impl IntoIterator<Item = Record>) {
        let mut inner = self.lock();
        for record in batch {
            match record {
                Record::Trace(t) => {
                    let t = as_stored_without_bodies(*t);
                    let size = trace_bytes(&t);
                    inner.traces.insert(t.id.clone(), Arc::new(t), size);
                }
                Record::Step(s) => {
                    let (StepRole::Agent, Some(trace_id)) = (s.role, &s.provider_trace_id) else {
                        continue;
                    };
                    let entry = match inner.steps_by_trace.get(trace_id.as_str()) {
                        Some(StepOfTrace::Step { step_id, .. }) if *step_id != s.step_id => StepOfTrace::AskTheStore,
                        Some(StepOfTrace::AskTheStore) => StepOfTrace::AskTheStore,
                        _ => StepOfTrace::Step {
                            step_id: s.step_id.clone(),
                            facts: StepSpanFacts::from(&*s),
                        },
                    };
                    let size = held_bytes(std::mem::size_of::<StepOfTrace>(), [trace_id.as_str(), &s.step_id]);
                    inner.steps_by_trace.insert(trace_id.clone(), entry, size);
                }
                Record::Trajectory(t) => {
                    // What `TrajectorySummary::without_heavy_parts` keeps, without copying it.
                    let mut light = *t;
                    light.system_prompts = Default::default();
                    light.tool_definitions = Vec::new();
                    let size = trajectory_bytes(&light);
                    inner
                        .trajectories
                        .insert(light.trajectory_id.clone(), Arc::new(light), size);
                }
            }
        }
    }

    /// Forget everything: retention deleted rows (never answer for a deleted record), or the writer has been idle
    /// (an exporter reads within a fraction of a second of a commit; holding records longer only holds memory).
    pub fn forget(&self) {
        let mut inner = self.lock();
        inner.traces.clear();
        inner.steps_by_trace.clear();
        inner.trajectories.clear();
    }

    /// The trace without its bodies, as `StoreReader::trace_without_bodies` reads it; None: not held.
    pub fn trace_without_bodies(&self, id: &str) -> Option<ProviderTrace> {
        self.lock().traces.get(id).map(|t| ProviderTrace::clone(t))
    }

    /// The span facts of the agent step that made trace `trace_id`; None: not held (ask the store).
    pub fn step_span_facts_for_trace(&self, trace_id: &str) -> Option<StepSpanFacts> {
        match self.lock().steps_by_trace.get(trace_id)? {
            StepOfTrace::Step { facts, .. } => Some(facts.clone()),
            StepOfTrace::AskTheStore => None,
        }
    }

    /// The trajectory without its system prompts and tool definitions; None: not held.
    pub fn trajectory_light(&self, id: &str) -> Option<TrajectorySummary> {
        self.lock().trajectories.get(id).map(|t| TrajectorySummary::clone(t))
    }

    /// The trajectory's parent: outer None when the trajectory is not held.
    pub fn parent_trajectory(&self, id: &str) -> Option<Option<String>> {
        self.lock().trajectories.get(id).map(|t| t.parent_trajectory_id.clone())
    }
}

/// A trace as the store's row gives it back without bodies: the writer stores the session header when the
/// trace has no session id of its own (`write::insert_trace`).
fn as_stored_without_bodies(mut t: ProviderTrace) -> ProviderTrace {
    t.request = JsonText::default();
    t.response = JsonText::default();
    t.raw_response = None;
    if t.session_id.is_none() {
        t.session_id = t.meta.session.clone();
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::derive::testkit::{Harness, call, text_out, trace, user};
    use crate::model::exchange::Api;

    fn trace_record(n: i64) -> Record {
        let mut t = trace(Api::OpenAiChat, n, n + 1);
        t.id = format!("trace-{n}");
        Record::Trace(Box::new(t))
    }

    #[test]
    fn the_oldest_records_go_first_beyond_the_bound() {
        let recent = RecentRecords::new(3);
        recent.remember((0..5).map(trace_record));
        let held: Vec<bool> = (0..5)
            .map(|n| recent.trace_without_bodies(&format!("trace-{n}")).is_some())
            .collect();
        assert_eq!(held, [false, false, true, true, true]);
        // A newer version replaces the value and keeps the place.
        recent.remember([trace_record(2), trace_record(5)]);
        assert!(recent.trace_without_bodies("trace-2").is_none());
        assert!(recent.trace_without_bodies("trace-5").is_some());
    }

    #[test]
    fn large_records_are_bounded_by_their_size() {
        let recent = RecentRecords::default();
        // Ten traces with 1 MiB of headers each: the 3 MiB budget holds the newest two.
        recent.remember((0..10).map(|n| {
            let Record::Trace(mut t) = trace_record(n) else {
                unreachable!()
            };
            t.response_headers.push(("x-large".into(), "x".repeat(1 << 20)));
            Record::Trace(t)
        }));
        let held: Vec<i64> = (0..10)
            .filter(|n| recent.trace_without_bodies(&format!("trace-{n}")).is_some())
            .collect();
        assert_eq!(held, [8, 9]);
        // Small records are held by count, far below the budget.
        recent.remember((10..1_010).map(trace_record));
        assert!((10..1_010).all(|n| recent.trace_without_bodies(&format!("trace-{n}")).is_some()));
    }

    #[test]
    fn bodies_are_left_out_and_the_session_header_stands_in_for_a_missing_session_id() {
        let mut t = trace(Api::OpenAiChat, 1, 2);
        t.request = JsonText::from_redacted("{\"model\":\"m\"}".into());
        t.raw_response = Some("data: {}".into());
        t.meta.session = Some("from-header".into());
        t.session_id = None;
        let id = t.id.clone();
        let recent = RecentRecords::default();
        recent.remember([Record::Trace(Box::new(t))]);
        let held = recent.trace_without_bodies(&id).unwrap_or_else(|| panic!("not held"));
        assert!(held.request.is_null() && held.response.is_null() && held.raw_response.is_none());
        assert_eq!(held.session_id.as_deref(), Some("from-header"));
    }

    #[test]
    fn a_trace_two_agent_steps_name_is_left_to_the_store() {
        let mut h = Harness::new(Api::OpenAiChat);
        let out = h.send(call("sys", vec![user("hello")], text_out("hi")));
        let step = out.agent().clone();
        let Some(trace_id) = step.provider_trace_id.clone() else {
            panic!("an agent step names its trace")
        };
        let recent = RecentRecords::default();
        recent.remember([Record::Step(Box::new(step.clone()))]);
        assert_eq!(
            recent.step_span_facts_for_trace(&trace_id),
            Some(StepSpanFacts::from(&step))
        );
        // Its next version still answers; another step naming the same trace does not.
        recent.remember([Record::Step(Box::new(step.clone()))]);
        assert!(recent.step_span_facts_for_trace(&trace_id).is_some());
        let mut other = step;
        other.step_id.push_str("#2");
        recent.remember([Record::Step(Box::new(other))]);
        assert_eq!(recent.step_span_facts_for_trace(&trace_id), None);
    }
}
