//! The read seam: one typed query layer that the viewer, the CLI, the gRPC API and the file exports use, whatever
//! backend holds the data. [`Query`] is what a reader answers; [`Store`] is the handle the rest of llmtap keeps
//! (cheap to clone) and lends a reader from its pool for one unit of blocking work.
//!
//! Backends: the embedded SQLite file (`StoreReader`, pooled here) and the shared PostgreSQL store
//! (`postgres::PgStore`). The exporters keep reading the local SQLite store directly: it is their outbox.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::browse::{CallHead, SessionHead, SessionQuery};
use super::costs::{CostQuery, CostReport};
use super::read::{SessionRow, StoreReader, TraceFilter};
use super::search::{SearchHit, SearchQuery};
use super::{StoreError, postgres::PgStore};
use crate::model::annotation::Annotation;
use crate::model::step::{Step, TrajectorySummary};
use crate::model::trace::ProviderTrace;

/// What every store backend answers. Lists come oldest first unless a method says otherwise; pages are keyset
/// pages (resumed after the last row seen), never offsets.
pub trait Query {
    /// Sessions newest first by their first trajectory's start, one page.
    fn session_page(&self, q: &SessionQuery) -> Result<Vec<SessionHead>, StoreError>;
    /// The session `id` names: a session key, else the session of the trajectory with that id.
    fn session_of(&self, id: &str) -> Result<Option<String>, StoreError>;
    /// Every trajectory of a session, oldest first, with its start in Unix micros, without system prompts and
    /// tool definitions.
    fn session_trajectories(&self, session: &str) -> Result<Vec<(i64, TrajectorySummary)>, StoreError>;
    /// One trajectory by id, with its system prompts and tool definitions.
    fn trajectory(&self, id: &str) -> Result<Option<TrajectorySummary>, StoreError>;
    /// Every call of a trajectory, oldest first, without bodies.
    fn call_heads(&self, trajectory_id: &str) -> Result<Vec<CallHead>, StoreError>;
    /// One call without bodies.
    fn call_head(&self, id: &str) -> Result<Option<CallHead>, StoreError>;
    /// A page of a trajectory's steps after index `after` (exclusive), by index.
    fn steps_page(&self, trajectory_id: &str, after: Option<u32>, limit: u32) -> Result<Vec<Step>, StoreError>;
    /// One call with its bodies.
    fn trace(&self, id: &str) -> Result<Option<ProviderTrace>, StoreError>;
    /// The call of the same trajectory just before `trace` (bodies included), if any.
    fn previous_call(&self, trace: &ProviderTrace) -> Result<Option<ProviderTrace>, StoreError>;
    /// The agent step derived from a call.
    fn step_for_trace(&self, trace_id: &str) -> Result<Option<Step>, StoreError>;
    /// The calls that re-sent call `id` (`ExchangeMeta::replay_of`), oldest first: (trace id, session id).
    fn replays_of(&self, id: &str) -> Result<Vec<(String, Option<String>)>, StoreError>;
    /// Trajectories that match `filter`, oldest first, with system prompts and tool definitions.
    fn sessions(&self, filter: &TraceFilter) -> Result<Vec<SessionRow>, StoreError>;
    /// Each matching call, oldest first, bodies included, read in pages (`f` runs between them).
    fn for_each_trace(
        &self,
        filter: &TraceFilter,
        f: &mut dyn FnMut(ProviderTrace) -> Result<(), StoreError>,
    ) -> Result<(), StoreError>;
    /// Steps in trajectory order (trajectories by start, steps by index), read in pages.
    fn for_each_step(
        &self,
        filter: &TraceFilter,
        f: &mut dyn FnMut(Step) -> Result<(), StoreError>,
    ) -> Result<(), StoreError>;
    /// Annotations made in any of `sessions` or on any of `trajectories` (theirs and their steps'), oldest
    /// first, each once.
    fn annotations(&self, sessions: &[String], trajectories: &[String]) -> Result<Vec<Annotation>, StoreError>;
    /// The calls started in the report's range added up: in total, by day, model and agent, and the most
    /// expensive sessions (`store::costs`).
    fn cost_report(&self, q: &CostQuery) -> Result<CostReport, StoreError>;

    /// Steps whose text (prompt, output, reasoning, tool arguments and results; see `store::search`) holds every
    /// term of `q` and that pass its filters, newest first, each with a snippet around the match.
    fn search(&self, q: &SearchQuery) -> Result<Vec<SearchHit>, StoreError>;

    /// [`session_trajectories`](Self::session_trajectories) of several sessions, in their order: a page of the
    /// sessions list in one read where the backend is a round trip away.
    fn trajectories_of_sessions(&self, sessions: &[String]) -> Result<Vec<Vec<(i64, TrajectorySummary)>>, StoreError> {
        sessions.iter().map(|s| self.session_trajectories(s)).collect()
    }

    /// [`call_heads`](Self::call_heads) of several trajectories, in their order.
    fn call_heads_of(&self, trajectory_ids: &[String]) -> Result<Vec<Vec<CallHead>>, StoreError> {
        trajectory_ids.iter().map(|t| self.call_heads(t)).collect()
    }

    fn steps(&self, filter: &TraceFilter) -> Result<Vec<Step>, StoreError> {
        let mut out = Vec::new();
        self.for_each_step(filter, &mut |s| {
            out.push(s);
            Ok(())
        })?;
        Ok(out)
    }
}

impl Query for StoreReader {
    fn session_page(&self, q: &SessionQuery) -> Result<Vec<SessionHead>, StoreError> {
        StoreReader::session_page(self, q)
    }
    fn session_of(&self, id: &str) -> Result<Option<String>, StoreError> {
        StoreReader::session_of(self, id)
    }
    fn session_trajectories(&self, session: &str) -> Result<Vec<(i64, TrajectorySummary)>, StoreError> {
        StoreReader::session_trajectories(self, session)
    }
    fn trajectory(&self, id: &str) -> Result<Option<TrajectorySummary>, StoreError> {
        StoreReader::trajectory(self, id)
    }
    fn call_heads(&self, trajectory_id: &str) -> Result<Vec<CallHead>, StoreError> {
        StoreReader::call_heads(self, trajectory_id)
    }
    fn call_head(&self, id: &str) -> Result<Option<CallHead>, StoreError> {
        StoreReader::call_head(self, id)
    }
    fn steps_page(&self, trajectory_id: &str, after: Option<u32>, limit: u32) -> Result<Vec<Step>, StoreError> {
        StoreReader::steps_page(self, trajectory_id, after, limit)
    }
    fn trace(&self, id: &str) -> Result<Option<ProviderTrace>, StoreError> {
        StoreReader::trace(self, id)
    }
    fn previous_call(&self, trace: &ProviderTrace) -> Result<Option<ProviderTrace>, StoreError> {
        StoreReader::previous_call(self, trace)
    }
    fn step_for_trace(&self, trace_id: &str) -> Result<Option<Step>, StoreError> {
        StoreReader::step_for_trace(self, trace_id)
    }
    fn replays_of(&self, id: &str) -> Result<Vec<(String, Option<String>)>, StoreError> {
        StoreReader::replays_of(self, id)
    }
    fn sessions(&self, filter: &TraceFilter) -> Result<Vec<SessionRow>, StoreError> {
        StoreReader::sessions(self, filter)
    }
    fn search(&self, q: &SearchQuery) -> Result<Vec<SearchHit>, StoreError> {
        StoreReader::search(self, q)
    }
    fn for_each_trace(
        &self,
        filter: &TraceFilter,
        f: &mut dyn FnMut(ProviderTrace) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        StoreReader::for_each_trace(self, filter, f)
    }
    fn for_each_step(
        &self,
        filter: &TraceFilter,
        f: &mut dyn FnMut(Step) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        StoreReader::for_each_step(self, filter, f)
    }
    fn annotations(&self, sessions: &[String], trajectories: &[String]) -> Result<Vec<Annotation>, StoreError> {
        StoreReader::annotations(self, sessions, trajectories)
    }
    fn cost_report(&self, q: &CostQuery) -> Result<CostReport, StoreError> {
        StoreReader::cost_report(self, q)
    }
}

/// Where llmtap reads its data from: the local SQLite store, or the team's shared PostgreSQL store.
#[derive(Clone)]
pub enum Store {
    Sqlite(Arc<ReaderPool>),
    Postgres(Arc<PgStore>),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Store::Sqlite(p) => write!(f, "Store::Sqlite({})", p.data_dir.display()),
            Store::Postgres(p) => write!(f, "Store::Postgres({})", p.describe()),
        }
    }
}

impl Store {
    /// The store `url` names (`postgres://…` or `postgresql://…`), else the SQLite store in `data_dir`.
    pub fn open(data_dir: &Path, url: Option<&str>) -> Result<Store, StoreError> {
        match url {
            Some(url) => Ok(Store::Postgres(Arc::new(PgStore::connect(url)?))),
            None => Ok(Store::Sqlite(Arc::new(ReaderPool::new(data_dir)))),
        }
    }

    /// The shared store, when this is one.
    pub fn shared(&self) -> Option<Arc<PgStore>> {
        match self {
            Store::Postgres(pg) => Some(pg.clone()),
            Store::Sqlite(_) => None,
        }
    }

    /// Run `f` with a reader. Blocking: call it from a blocking thread (`spawn_blocking`) or the CLI.
    pub fn read<T>(&self, f: impl FnOnce(&dyn Query) -> Result<T, StoreError>) -> Result<T, StoreError> {
        match self {
            Store::Sqlite(pool) => {
                let reader = pool.take()?;
                let result = f(&reader);
                // A reader that just failed may hold a broken connection: only a good one goes back.
                if result.is_ok() {
                    pool.give_back(reader);
                }
                result
            }
            Store::Postgres(pg) => f(pg.as_ref()),
        }
    }
}

/// SQLite readers kept open between requests: opening one costs a file open, the schema read and every
/// statement prepared again, which per viewer or gRPC request was most of a small page's cost. A reader is
/// taken for one unit of work and given back; at most `IDLE` wait idle (more are opened under a burst and
/// closed after it). Hand-written because it is this small: a pool crate would have to match rusqlite's
/// version and knows nothing of the readers' own setup.
pub struct ReaderPool {
    data_dir: std::path::PathBuf,
    idle: Mutex<Vec<StoreReader>>,
}

impl ReaderPool {
    const IDLE: usize = 4;

    /// The data directory of the store read (where annotations are written).
    pub(super) fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn new(data_dir: &Path) -> ReaderPool {
        ReaderPool {
            data_dir: data_dir.to_owned(),
            idle: Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> Result<StoreReader, StoreError> {
        let pooled = self.idle.lock().map(|mut idle| idle.pop()).unwrap_or(None);
        match pooled {
            Some(r) => Ok(r),
            None => StoreReader::open(&self.data_dir),
        }
    }

    fn give_back(&self, reader: StoreReader) {
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < Self::IDLE
        {
            idle.push(reader);
        }
    }
}
