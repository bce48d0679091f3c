//! Handing freed memory back to the OS.
//!
//! llmtap's binaries use mimalloc. mimalloc returns a page to the OS only from the thread that owns it, and a
//! block freed by another thread (a connection buffer allocated on one worker and dropped on the other, a
//! captured body freed on the pipeline thread) is only reclaimed when its owner next allocates. After a burst
//! of traffic the workers go idle and nothing reclaims those pages: `llmtap-bench memory` showed RSS staying at
//! ~120–140 MiB after 1,000 streams with a live heap of ~13 MiB (heaptrack). So every long-lived thread calls
//! [`release_freed_memory`] now and then when it has nothing else to do (see [`release_when_idle`]).
//!
//! This module holds llmtap's only `unsafe`: mimalloc's `mi_collect` has no safe wrapper.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A thread collects at most this often.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

thread_local! {
    static LAST_COLLECT: Cell<Option<Instant>> = const { Cell::new(None) };
    static LAST_TICK: Cell<u64> = const { Cell::new(0) };
}

/// Advanced once per [`MIN_INTERVAL`] by the task [`spawn_idle_wakers`] starts; see [`release_on_tick`].
static TICK: AtomicU64 = AtomicU64::new(0);

/// Reclaim what other threads freed in this thread's pages and return empty pages to the OS. Forced: a normal
/// collect skips pages that were full, which is where blocks freed by other threads wait.
#[allow(unsafe_code)]
pub fn release_freed_memory() {
    // SAFETY: `mi_collect` takes no pointers and only touches the calling thread's heap and mimalloc's own
    // thread-safe arena state; it is documented as callable at any time by any thread.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// [`release_freed_memory`], at most once per [`MIN_INTERVAL`] on this thread (a forced collect visits every
/// page of the thread's heap). For idle points: a worker about to park, the pipeline and store threads after a
/// second without work.
pub fn release_when_idle() {
    let now = Instant::now();
    let due = LAST_COLLECT.with(|last| match last.get() {
        Some(at) if now.duration_since(at) < MIN_INTERVAL => false,
        _ => {
            last.set(Some(now));
            true
        }
    });
    if due {
        release_freed_memory();
    }
}

/// For a proxy worker's park hook, which runs two or three times per proxied request: [`release_freed_memory`]
/// at most once per tick of [`spawn_idle_wakers`]' clock. One relaxed load of a value written once a second,
/// where [`release_when_idle`] read the clock (~400 instructions per request on the data path).
pub fn release_on_tick() {
    let tick = TICK.load(Ordering::Relaxed);
    if LAST_TICK.with(|last| last.replace(tick)) != tick {
        release_freed_memory();
    }
}

/// Advance [`release_on_tick`]'s clock once per [`MIN_INTERVAL`] and wake every worker of the current runtime
/// as often, so that each collects once traffic stops (its park hook runs [`release_on_tick`]). One ticking task
/// per worker: when the timer fires on one worker, the others are woken to take their share of the ready
/// tasks; the first task also advances the clock. Each runtime with hooked workers (the proxy's and the
/// caller's) starts its own: the clock counts intervals since the first of them, so however many runtimes tick
/// it, it moves once per interval.
pub fn spawn_idle_wakers(workers: usize) {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    for worker in 0..workers {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(MIN_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if worker == 0 {
                    let intervals = epoch.elapsed().as_millis() / MIN_INTERVAL.as_millis().max(1);
                    TICK.fetch_max(u64::try_from(intervals).unwrap_or(u64::MAX), Ordering::Relaxed);
                }
            }
        });
    }
}
