//! WAL checkpoints mostly on a thread of their own, so that the store writer seldom waits on them.
//!
//! A checkpoint copies the WAL's pages into the database file and syncs both files (`synchronous = NORMAL`).
//! SQLite's automatic checkpoint runs it on the committing connection, inside the commit that crosses the
//! threshold: the writer would wait for the copy and the syncs of ~10,000 pages for as long as the disk takes,
//! with its core idle while the capture backlog grows (docs/performance.md, "Checkpoints off the writer").
//!
//! So the writer's connection only reports its WAL size after each commit (a WAL hook, which also turns
//! SQLite's automatic checkpoint off on that connection). Once [`CHECKPOINT_PAGES`] pages are not yet copied,
//! this thread copies and syncs them on its own connection; a passive checkpoint never blocks the writer. But
//! only a checkpoint that has copied everything lets the writer's next transaction restart the WAL from its
//! start, and under load the writer commits while a pass runs. So once a pass has left only a short tail
//! ([`TAIL_DIVISOR`]), the writer copies that tail itself between two transactions: a short stall instead of the
//! whole checkpoint. Past [`HARD_LIMIT_MULTIPLE`] (a disk that cannot keep up) the writer waits for the pass
//! in progress and copies the rest, slowing capture down rather than growing the WAL without bound.

use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use rusqlite::wal::CheckpointMode;

use super::StoreError;
use crate::telemetry::Metrics;

/// WAL pages (4 KiB) not yet copied that start a pass (SQLite's default checkpoint: 1,000). A checkpoint copies
/// the newest version of each page once, however many commits rewrote it since the last one: fewer, larger
/// checkpoints write a hot index page once instead of once per few commits.
pub const CHECKPOINT_PAGES: i64 = 10_000;

/// A tail of at most a quarter of [`CHECKPOINT_PAGES`] uncopied pages after a pass is copied by the writer itself,
/// so that its next transaction restarts the WAL.
const TAIL_DIVISOR: i64 = 4;

/// Past this many times [`CHECKPOINT_PAGES`] in the WAL, the writer copies everything itself, waiting for a pass
/// in progress first.
const HARD_LIMIT_MULTIPLE: i64 = 4;

/// What the writer and the thread know of the WAL.
#[derive(Default)]
struct State {
    /// Pages in the WAL after the writer's last commit.
    frames: i64,
    /// Pages of this WAL the thread's last pass left copied.
    copied: i64,
    /// A pass is running.
    running: bool,
    /// Bumped when the writer's own checkpoint lets the WAL restart: a pass that began before reports pages of
    /// the old WAL, and is not counted.
    generation: u64,
}

/// The writer's side of the checkpoint thread.
pub struct Checkpointer {
    state: Arc<Mutex<State>>,
    thread: JoinHandle<()>,
    pages: i64,
    hard_limit: i64,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Each update is a few field stores: a panic cannot leave the state half-made.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl Checkpointer {
    /// Start the checkpoint thread for the database `writer` has open, and hook `writer`'s commits to it; None
    /// for a database without a file. `pages`: [`CHECKPOINT_PAGES`] (smaller in tests), the tail and the hard
    /// limit in proportion.
    pub fn start(
        writer: &mut Connection,
        pages: i64,
        metrics: Arc<Metrics>,
    ) -> Result<Option<Checkpointer>, StoreError> {
        // The writer's store: its file's directory. An in-memory database has no file and no second connection
        // can reach it: None, and the writer keeps SQLite's own checkpoints.
        let Some(dir) = writer
            .path()
            .filter(|p| !p.is_empty())
            .and_then(|p| std::path::Path::new(p).parent().map(std::path::Path::to_path_buf))
        else {
            return Ok(None);
        };
        // Its checkpoints are the ones it asks for.
        let conn = super::open_without_checkpoints(&dir)?;
        let state = Arc::new(Mutex::new(State::default()));
        let (wake, woken) = sync_channel::<()>(1);
        let seen = state.clone();
        writer.wal_hook(Some(move |_: &mut rusqlite::hooks::Wal, now: std::ffi::c_int| {
            let mut s = lock(&seen);
            s.frames = i64::from(now);
            // A WAL that restarted is smaller than what was copied of the old one.
            if s.copied > s.frames {
                s.copied = 0;
            }
            let due = !s.running && s.frames - s.copied >= pages;
            drop(s);
            if due {
                // Full: a wake-up is already pending.
                let _ = wake.try_send(());
            }
            Ok(())
        }))?;
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name("llmtap-checkpoint".into())
            .spawn(move || run(conn, woken, shared, metrics))
            .map_err(StoreError::Thread)?;
        Ok(Some(Checkpointer {
            state,
            thread,
            pages,
            hard_limit: HARD_LIMIT_MULTIPLE * pages,
        }))
    }

    /// After a commit, between two transactions: copy the tail a pass left (or, past the hard limit, everything),
    /// so that the next transaction restarts the WAL.
    pub fn after_commit(&self, writer: &Connection) -> Result<(), StoreError> {
        let (frames, tail, running) = {
            let s = lock(&self.state);
            (s.frames, s.frames - s.copied, s.running)
        };
        // `tail < frames`: a pass has copied part of this WAL.
        let short_tail = !running && tail < frames && tail <= self.pages / TAIL_DIVISOR;
        let past_limit = frames >= self.hard_limit;
        if !short_tail && !past_limit {
            return Ok(());
        }
        // Past the limit, a pass in progress holds the checkpoint lock (SQLite answers busy at once, without a
        // busy handler): wait for it.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match writer
                .wal_checkpoint_v2(None::<&str>, CheckpointMode::PASSIVE)
                .map_err(StoreError::from)
            {
                Ok((log, copied)) => {
                    if copied >= log {
                        let mut s = lock(&self.state);
                        s.generation += 1;
                        s.copied = 0;
                    }
                    return Ok(());
                }
                Err(e) if e.is_busy() && past_limit && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) if e.is_busy() => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Stop the thread (after its current pass) and unhook `writer`.
    pub fn stop(self, writer: &mut Connection) {
        // Dropping the hook drops the sender the thread waits on.
        let _ = writer.wal_hook(None::<fn(&mut rusqlite::hooks::Wal, std::ffi::c_int) -> rusqlite::Result<()>>);
        let _ = self.thread.join();
    }
}

fn run(conn: Connection, woken: Receiver<()>, state: Arc<Mutex<State>>, metrics: Arc<Metrics>) {
    crate::background::run_in_background();
    loop {
        match woken.recv_timeout(Duration::from_secs(1)) {
            Ok(()) => {}
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let generation = {
            let mut s = lock(&state);
            s.running = true;
            s.generation
        };
        let result = conn
            .wal_checkpoint_v2(None::<&str>, CheckpointMode::PASSIVE)
            .map_err(StoreError::from);
        let mut s = lock(&state);
        s.running = false;
        match result {
            Ok((_, copied)) if s.generation == generation => {
                if i64::from(copied) > s.copied {
                    metrics.store_checkpoints.add(1);
                }
                s.copied = copied.into();
            }
            Ok(_) => {}
            // The writer's own checkpoint is running: it does the work.
            Err(e) if e.is_busy() => {}
            Err(e) => {
                drop(s);
                metrics.store_error(&e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store in a temporary directory with a scratch table, its connection run with `pragmas` first.
    fn scratch_store(pragmas: &str) -> (tempfile::TempDir, Connection) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let writer = super::super::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        writer
            .execute_batch(&format!("{pragmas} CREATE TABLE scratch (x BLOB)"))
            .unwrap_or_else(|e| panic!("{e}"));
        (dir, writer)
    }

    /// Commits that each add a few WAL pages: the thread copies them, the writer's tails let the WAL restart,
    /// and the WAL never grows past the hard limit (plus the one commit that crosses it).
    #[test]
    fn the_wal_is_checkpointed_off_the_writer_and_stays_bounded() {
        let (_dir, mut writer) = scratch_store("");
        let pages = 40;
        let metrics = Arc::new(Metrics::default());
        let Some(c) = Checkpointer::start(&mut writer, pages, metrics.clone()).unwrap_or_else(|e| panic!("{e}")) else {
            panic!("a store file gets a checkpoint thread")
        };
        let (mut most, mut restarts, mut last) = (0, 0, 0);
        // At least 400 commits, and on until the thread (at `SCHED_IDLE`, behind every busy test) has run a pass.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut commits = 0;
        while commits < 400 || (metrics.store_checkpoints.get() == 0 && Instant::now() < deadline) {
            writer
                .execute("INSERT INTO scratch (x) VALUES (?1)", [vec![commits as u8; 12_000]])
                .unwrap_or_else(|e| panic!("{e}"));
            commits += 1;
            c.after_commit(&writer).unwrap_or_else(|e| panic!("{e}"));
            let frames = lock(&c.state).frames;
            most = most.max(frames);
            restarts += usize::from(frames < last);
            last = frames;
            std::thread::sleep(Duration::from_millis(2));
        }
        c.stop(&mut writer);
        assert!(restarts >= 5, "the WAL restarted {restarts} times");
        assert!(metrics.store_checkpoints.get() > 0, "the thread's passes copied pages");
        assert!(most <= HARD_LIMIT_MULTIPLE * pages + 10, "the WAL reached {most} pages");
        let rows: i64 = writer
            .query_row("SELECT COUNT(*) FROM scratch", [], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rows, commits);
    }

    /// Without the thread's passes the WAL would only restart at the hard limit: the writer's hook has turned
    /// SQLite's automatic checkpoint off, so a connection that only reports never checkpoints by itself.
    #[test]
    fn the_writers_hook_turns_its_automatic_checkpoint_off() {
        let (_dir, mut writer) = scratch_store("PRAGMA wal_autocheckpoint = 10;");
        // Passes start at a size never reached, and the writer is never asked to copy a tail.
        let Some(c) = Checkpointer::start(&mut writer, i64::MAX / 8, Arc::new(Metrics::default()))
            .unwrap_or_else(|e| panic!("{e}"))
        else {
            panic!("no checkpoint thread")
        };
        for i in 0..50 {
            writer
                .execute("INSERT INTO scratch (x) VALUES (?1)", [vec![i as u8; 12_000]])
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let frames = lock(&c.state).frames;
        c.stop(&mut writer);
        assert!(frames > 100, "the WAL grew to {frames} pages without a checkpoint");
    }
}
