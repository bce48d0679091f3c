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

/// Records of each kind held. An exporter that keeps up reads a batch within a few hundred milliseconds of its
/// commit; at 10,000 exchanges/s that is a few thousand of each. A trace without bodies or a trajectory without
/// prompts is ~1–2 KB, so the whole cache stays in the tens of MiB at most.
pub const DEFAULT_ENTRIES: usize = 8_192;

/// A map that forgets its oldest keys beyond `capacity` (by first insertion; replacing a value keeps its place).
struct Bounded<K, V> {
    map: FxHashMap<K, V>,
    order: VecDeque<K>,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V> Bounded<K, V> {
    fn new(capacity: usize) -> Self {
        Bounded {
            map: FxHashMap::default(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    fn insert(&mut self, key: K, value: V) {
        if self.map.insert(key.clone(), value).is_none() {
            self.order.push_back(key);
            while self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }

    fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
    {
        self.map.get(key)
    }

    fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }
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
                traces: Bounded::new(entries),
                steps_by_trace: Bounded::new(entries),
                trajectories: Bounded::new(entries),
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
                    inner.traces.insert(t.id.clone(), Arc::new(t));
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
                    inner.steps_by_trace.insert(trace_id.clone(), entry);
                }
                Record::Trajectory(t) => {
                    // What `TrajectorySummary::without_heavy_parts` keeps, without copying it.
                    let mut light = *t;
                    light.system_prompts = Default::default();
                    light.tool_definitions = Vec::new();
                    inner.trajectories.insert(light.trajectory_id.clone(), Arc::new(light));
                }
            }
        }
    }

    /// Retention deleted rows: forget everything rather than answer for a deleted record.
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
