//! What the writer committed last, kept in memory for the exporters.
//!
//! An exporter builds each call's span from the trace row, its agent step and the trajectory's parent chain (the
//! trace the span belongs to), usually a fraction of a second after the writer committed them. Rather than
//! SQLite lookups and JSON (and zstd) decoding of records the writer held in memory a moment before, the writer
//! hands each committed batch to [`RecentRecords`] (it owns the records by then: bodies are dropped, nothing is
//! copied), and a [`super::StoreReader`] given this cache answers those three lookups from it, and from the
//! store for whatever it does not hold (a backlog beyond its bounds, a restart). The same goes for an agent
//! span, built from the trajectory's summary as the batch that closed it left it (without its system prompts
//! and tool definitions, as `StoreReader::trajectory_light` reads it).
//!
//! Each answer equals what the store gives for the same record: the writer's own normalization is applied on
//! the way in (a trace's session id falls back to its session header, bodies are left out), and
//! `tests/export_recent.rs` reads both over every recorded call. The cache holds the last version committed, as
//! the store does. A call leaves it once every sink has read it. Everything is bounded (oldest out first), and
//! cleared when retention deletes rows (so the cache never answers for a record the store no longer has) and
//! when the writer has been idle for a second.

use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::{Mutex, MutexGuard};

use rustc_hash::FxHashMap;

use crate::model::json::JsonText;
use crate::model::record::Record;
use crate::model::step::{StepRole, StepSpanFacts, TrajectorySummary};
use crate::model::trace::ProviderTrace;

/// Calls (a trace and its agent step) held at most, and their estimated bytes (see `held_bytes`). A call leaves
/// once every sink has read it, so the cache holds what the sinks have yet to read: a few hundred calls while
/// they keep up (they look at the export log every 200 ms at most), up to this bound while they lag (a burst, a
/// sink that is down), after which they read the rest from the store.
const CALLS: usize = 16_384;
const CALL_BYTES: usize = 8 << 20;

/// Trajectories whose parent link is held at most, and their estimated bytes. A link stays when read (each of
/// the trajectory's calls looks it up), so these bounds are what it holds under steady traffic.
const TRAJECTORIES: usize = 16_384;
const TRAJECTORY_BYTES: usize = 2 << 20;

/// Closed trajectories' summaries held at most, and their estimated bytes. Like a call, a summary leaves once
/// every sink has read its agent span.
const CLOSED: usize = 16_384;
const CLOSED_BYTES: usize = 8 << 20;

/// A map that forgets its oldest keys beyond `capacity` entries or `max_bytes` estimated bytes (by first
/// insertion; replacing a value keeps its place). A removed key keeps its place in the order until it comes up:
/// the bounds then count it, which only makes the map hold a little less.
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

    fn get_mut<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: std::borrow::Borrow<Q>,
    {
        self.map.get_mut(key).map(|(v, _)| v)
    }

    fn contains<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> bool
    where
        K: std::borrow::Borrow<Q>,
    {
        self.map.contains_key(key)
    }

    /// Remove `key` (its place in the eviction order is dropped when it comes up).
    fn remove<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
    {
        let (value, size) = self.map.remove(key)?;
        self.bytes -= size;
        Some(value)
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

fn summary_bytes(t: &TrajectorySummary) -> usize {
    held_bytes(
        std::mem::size_of::<TrajectorySummary>(),
        [t.trajectory_id.as_str(), &t.started_at, &t.ended_at]
            .into_iter()
            .chain(t.models.iter().chain(&t.call_types).map(String::as_str))
            .chain(
                [
                    &t.session_id,
                    &t.agent,
                    &t.parent_trajectory_id,
                    &t.parent_tool_call_id,
                    &t.continues,
                ]
                .into_iter()
                .filter_map(|s| s.as_deref()),
            ),
    )
}

/// The agent step a trace id leads to, as `StoreReader::step_span_facts_for_trace` finds it. A step's trace id
/// is set when the deriver makes the step and stays with every later version of it.
#[derive(Clone)]
enum StepOfTrace {
    Step {
        step_id: String,
        facts: StepSpanFacts,
    },
    /// Two steps named this trace: the store knows which one its query picks.
    AskTheStore,
}

/// A value each reader (sink) takes once: the last one's read removes it. Each export-log entry of a call is read
/// once per sink, so what the sinks have read leaves the cache at once, and the cache holds about what the sinks
/// have yet to read.
struct ReadOnce<V> {
    value: V,
    reads_left: usize,
}

struct Inner {
    traces: Bounded<String, ReadOnce<ProviderTrace>>,
    steps_by_trace: Bounded<String, ReadOnce<StepOfTrace>>,
    /// Trajectory id → its parent's (None: a root). Kept when read.
    parents: Bounded<String, Option<String>>,
    /// Trajectory id → its summary, without system prompts and tool definitions, while its last committed
    /// version is closed.
    closed: Bounded<String, ReadOnce<TrajectorySummary>>,
}

/// The exporters' view of the last committed records (see the module doc).
pub struct RecentRecords {
    inner: Mutex<Inner>,
    /// The sinks that read it; with none, nothing is held.
    readers: usize,
}

impl std::fmt::Debug for RecentRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("RecentRecords")
            .field("traces", &inner.traces.map.len())
            .field("parents", &inner.parents.map.len())
            .finish_non_exhaustive()
    }
}

/// A cache with no readers: it holds nothing (a store without sinks).
impl Default for RecentRecords {
    fn default() -> Self {
        RecentRecords::new(0)
    }
}

impl RecentRecords {
    /// A cache for `readers` sinks (see [`ReadOnce`]).
    pub fn new(readers: usize) -> RecentRecords {
        RecentRecords::bounded(readers, CALLS)
    }

    fn bounded(readers: usize, entries: usize) -> RecentRecords {
        RecentRecords {
            inner: Mutex::new(Inner {
                traces: Bounded::new(entries, CALL_BYTES),
                steps_by_trace: Bounded::new(entries, CALL_BYTES),
                parents: Bounded::new(TRAJECTORIES, TRAJECTORY_BYTES),
                closed: Bounded::new(CLOSED, CLOSED_BYTES),
            }),
            readers,
        }
    }

    fn read_once<V>(&self, value: V) -> ReadOnce<V> {
        ReadOnce {
            value,
            reads_left: self.readers,
        }
    }

    /// How many traces are held: read by fewer than every sink, not yet evicted.
    pub fn held_traces(&self) -> usize {
        self.lock().traces.map.len()
    }

    /// How many closed trajectories' summaries are held: read by fewer than every sink, not yet evicted.
    pub fn held_closed(&self) -> usize {
        self.lock().closed.map.len()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-made entry (each insert is one map operation), so
        // a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take in a batch the writer has committed, in the batch's order (a later version replaces an earlier one).
    pub fn remember(&self, batch: impl IntoIterator<Item = Record>) {
        if self.readers == 0 {
            return;
        }
        let mut inner = self.lock();
        // A trace is read for its call's span, which is logged with the call's agent step: a trace whose batch
        // has no agent step for it (a call no adapter read) is never read, and is not held.
        let mut traces: FxHashMap<String, ProviderTrace> = FxHashMap::default();
        for record in batch {
            match record {
                Record::Trace(t) => {
                    let t = as_stored_without_bodies(*t);
                    traces.insert(t.id.clone(), t);
                }
                Record::Step(s) => {
                    // Its call's span reads the step with the trace: a step is held while its trace is (a later
                    // version, after the span was built, is not needed).
                    let (StepRole::Agent, Some(trace_id)) = (s.role, &s.provider_trace_id) else {
                        continue;
                    };
                    if let Some(t) = traces.remove(trace_id) {
                        let size = trace_bytes(&t);
                        inner.traces.insert(trace_id.clone(), self.read_once(t), size);
                    } else if !inner.traces.contains(trace_id.as_str()) {
                        continue;
                    }
                    let entry = match inner.steps_by_trace.get(trace_id.as_str()).map(|e| &e.value) {
                        Some(StepOfTrace::Step { step_id, .. }) if *step_id != s.step_id => StepOfTrace::AskTheStore,
                        Some(StepOfTrace::AskTheStore) => StepOfTrace::AskTheStore,
                        _ => StepOfTrace::Step {
                            step_id: s.step_id.clone(),
                            facts: StepSpanFacts::from(&*s),
                        },
                    };
                    let size = held_bytes(std::mem::size_of::<StepOfTrace>(), [trace_id.as_str(), &s.step_id]);
                    inner
                        .steps_by_trace
                        .insert(trace_id.clone(), self.read_once(entry), size);
                }
                Record::Trajectory(mut t) => {
                    let size = held_bytes(
                        std::mem::size_of::<(String, Option<String>)>(),
                        [t.trajectory_id.as_str()]
                            .into_iter()
                            .chain(t.parent_trajectory_id.as_deref()),
                    );
                    let id = t.trajectory_id.clone();
                    inner.parents.insert(id.clone(), t.parent_trajectory_id.clone(), size);
                    // The store's row is the last version: one that reopens the trajectory takes the closed
                    // one's place, and its agent span (if any is still to be read) reads the store.
                    if t.closed {
                        t.system_prompts = Default::default();
                        t.tool_definitions = Vec::new();
                        let size = summary_bytes(&t);
                        inner.closed.insert(id, self.read_once(*t), size);
                    } else {
                        inner.closed.remove(id.as_str());
                    }
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
        inner.parents.clear();
        inner.closed.clear();
    }

    /// The trace without its bodies, as `StoreReader::trace_without_bodies` reads it (a read, see [`ReadOnce`]);
    /// None: not held.
    pub fn trace_without_bodies(&self, id: &str) -> Option<ProviderTrace> {
        read_once(&mut self.lock().traces, id)
    }

    /// The span facts of the agent step that made trace `trace_id` (a read, see [`ReadOnce`]); None: not held
    /// (ask the store).
    pub fn step_span_facts_for_trace(&self, trace_id: &str) -> Option<StepSpanFacts> {
        match read_once(&mut self.lock().steps_by_trace, trace_id)? {
            StepOfTrace::Step { facts, .. } => Some(facts),
            StepOfTrace::AskTheStore => None,
        }
    }

    /// The closed trajectory's summary without its system prompts and tool definitions, as
    /// `StoreReader::trajectory_light` reads it (a read, see [`ReadOnce`]); None: not held.
    pub fn trajectory_light(&self, id: &str) -> Option<TrajectorySummary> {
        read_once(&mut self.lock().closed, id)
    }

    /// The trajectory's parent: outer None when the trajectory is not held.
    pub fn parent_trajectory(&self, id: &str) -> Option<Option<String>> {
        self.lock().parents.get(id).cloned()
    }
}

/// One reader's read of `key`: a copy while other readers have yet to read it, the value itself for the last one.
fn read_once<V: Clone>(map: &mut Bounded<String, ReadOnce<V>>, key: &str) -> Option<V> {
    let entry = map.get_mut(key)?;
    if entry.reads_left > 1 {
        entry.reads_left -= 1;
        return Some(entry.value.clone());
    }
    map.remove(key).map(|e| e.value)
}

/// A trace as the store's row gives it back without bodies: its `session_id` column holds
/// [`ProviderTrace::session`].
fn as_stored_without_bodies(mut t: ProviderTrace) -> ProviderTrace {
    t.request = JsonText::default();
    t.response = JsonText::default();
    t.raw_response = None;
    t.session_id = t.session().cloned();
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

    /// A real agent step (derived from one call) made the step of trace `trace-{n}`.
    fn agent_step(n: i64) -> Record {
        let mut h = Harness::new(Api::OpenAiChat);
        let mut step = h.send(call("sys", vec![user("hello")], text_out("hi"))).agent().clone();
        step.step_id = format!("step-{n}");
        step.provider_trace_id = Some(format!("trace-{n}"));
        Record::Step(Box::new(step))
    }

    /// One call's records as the pipeline sends them: the trace, then its agent step.
    fn call_records(ns: std::ops::Range<i64>) -> Vec<Record> {
        ns.flat_map(|n| [trace_record(n), agent_step(n)]).collect()
    }

    fn held(recent: &RecentRecords, ids: std::ops::Range<i64>) -> Vec<i64> {
        ids.filter(|n| recent.trace_without_bodies(&format!("trace-{n}")).is_some())
            .collect()
    }

    #[test]
    fn the_oldest_records_go_first_beyond_the_bound() {
        let recent = RecentRecords::bounded(1, 3);
        recent.remember(call_records(0..5));
        assert_eq!(recent.held_traces(), 3);
        assert_eq!(held(&recent, 0..5), [2, 3, 4]);
    }

    #[test]
    fn each_sink_reads_a_call_once_and_the_last_read_lets_it_go() {
        let recent = RecentRecords::new(2);
        recent.remember(call_records(1..2));
        assert!(recent.trace_without_bodies("trace-1").is_some(), "first sink");
        assert_eq!(recent.held_traces(), 1, "the second sink has yet to read it");
        assert!(recent.trace_without_bodies("trace-1").is_some(), "second sink");
        assert_eq!(recent.held_traces(), 0);
        assert!(
            recent.trace_without_bodies("trace-1").is_none(),
            "a third read asks the store"
        );
        // Without sinks nothing is held.
        let none = RecentRecords::default();
        none.remember(call_records(2..3));
        assert_eq!(none.held_traces(), 0);
        // A trace without an agent step in its batch is never read for a span: not held.
        recent.remember([trace_record(3)]);
        assert_eq!(recent.held_traces(), 0);
    }

    #[test]
    fn large_records_are_bounded_by_their_size() {
        let recent = RecentRecords::new(1);
        // Ten traces with 1 MiB of headers each: the 8 MiB budget holds the newest seven.
        recent.remember((0..10).flat_map(|n| {
            let Record::Trace(mut t) = trace_record(n) else {
                unreachable!()
            };
            t.response_headers.push(("x-large".into(), "x".repeat(1 << 20)));
            [Record::Trace(t), agent_step(n)]
        }));
        assert_eq!(held(&recent, 0..10), [3, 4, 5, 6, 7, 8, 9]);
        // Small records are held by count, far below the budget.
        recent.remember(call_records(10..1_010));
        assert_eq!(recent.held_traces(), 1_000);
    }

    #[test]
    fn bodies_are_left_out_and_the_session_header_stands_in_for_a_missing_session_id() {
        let mut t = trace(Api::OpenAiChat, 1, 2);
        t.request = JsonText::from_redacted("{\"model\":\"m\"}".into());
        t.raw_response = Some("data: {}".into());
        t.meta.session = Some("from-header".into());
        t.session_id = None;
        let id = t.id.clone();
        let recent = RecentRecords::new(1);
        recent.remember([Record::Trace(Box::new(t)), agent_step(0)].map(|r| match r {
            Record::Step(mut s) => {
                s.provider_trace_id = Some(id.clone());
                Record::Step(s)
            }
            r => r,
        }));
        let held = recent.trace_without_bodies(&id).unwrap_or_else(|| panic!("not held"));
        assert!(held.request.is_null() && held.response.is_null() && held.raw_response.is_none());
        assert_eq!(held.session_id.as_deref(), Some("from-header"));
    }

    #[test]
    fn a_step_is_held_with_its_trace_and_a_trace_two_steps_name_is_left_to_the_store() {
        let mut h = Harness::new(Api::OpenAiChat);
        let mut t = trace(Api::OpenAiChat, h.now, h.now + 1_000_000);
        t.id = "the-trace".into();
        let records = h
            .deriver
            .observe(t, Some(call("sys", vec![user("hello")], text_out("hi"))));
        let step = records
            .iter()
            .find_map(|r| match r {
                Record::Step(s) if s.role == StepRole::Agent => Some((**s).clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no agent step"));
        assert_eq!(step.provider_trace_id.as_deref(), Some("the-trace"));
        // Without its trace the step is not held.
        let recent = RecentRecords::new(1);
        recent.remember([Record::Step(Box::new(step.clone()))]);
        assert_eq!(recent.step_span_facts_for_trace("the-trace"), None);
        // With it, it is, once; a later version replaces it.
        let recent = RecentRecords::new(1);
        recent.remember(records.clone());
        recent.remember([Record::Step(Box::new(step.clone()))]);
        assert_eq!(
            recent.step_span_facts_for_trace("the-trace"),
            Some(StepSpanFacts::from(&step))
        );
        assert_eq!(recent.step_span_facts_for_trace("the-trace"), None, "read once");
        // Another step naming the same trace: the store decides.
        let recent = RecentRecords::new(1);
        recent.remember(records);
        let mut other = step;
        other.step_id.push_str("#2");
        recent.remember([Record::Step(Box::new(other))]);
        assert_eq!(recent.step_span_facts_for_trace("the-trace"), None);
    }

    /// A closed trajectory is held without its prompts and tool definitions until each sink has read it; a later
    /// version that reopens it takes its place in the store, so the cache lets the store answer.
    #[test]
    fn a_closed_trajectory_is_held_until_read_and_a_reopened_one_is_left_to_the_store() {
        let summary = |closed: bool| {
            let mut t = TrajectorySummary {
                trajectory_id: "tr_1".into(),
                closed,
                tool_definitions: vec![serde_json::json!({"name": "read"})],
                ..TrajectorySummary::default()
            };
            t.system_prompts.insert("h".into(), "You are careful.".into());
            Record::Trajectory(Box::new(t))
        };
        let recent = RecentRecords::new(2);
        recent.remember([summary(false)]);
        assert_eq!(recent.held_closed(), 0, "an open trajectory has no agent span yet");
        recent.remember([summary(true)]);
        let first = recent.trajectory_light("tr_1");
        assert!(
            first
                .as_ref()
                .is_some_and(|t| t.closed && t.system_prompts.is_empty() && t.tool_definitions.is_empty()),
            "{first:?}"
        );
        assert_eq!(recent.trajectory_light("tr_1"), first, "the second sink");
        assert_eq!(recent.trajectory_light("tr_1"), None, "both sinks read it");
        recent.remember([summary(true), summary(false)]);
        assert_eq!(recent.held_closed(), 0, "reopened in the same batch");
        recent.remember([summary(true)]);
        recent.remember([summary(false)]);
        assert_eq!(recent.trajectory_light("tr_1"), None, "reopened by a later batch");
        let no_sinks = RecentRecords::default();
        no_sinks.remember([summary(true)]);
        assert_eq!(no_sinks.held_closed(), 0, "no sink, nothing held");
    }
}
