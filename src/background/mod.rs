//! Background threads: what every thread off the data path (pipeline, store writer, exporters, API) does to stay
//! out of the way of the proxy's workers.
//! The capture spill's thread is the one exception: it must still run when the workers saturate the machine,
//! or capture drops what it could have put on disk (see `capture::spill`).
//!
//! A lower priority does not keep background work off a saturated machine, so the pipeline also waits by
//! itself while the data path needs the CPU ([`deferral`], [`YieldToDataPath`]).

pub mod cpu;
pub mod deferral;

use std::time::{Duration, Instant};

/// Capture work must never take CPU from the data path: on a busy machine the pipeline and store threads yield,
/// fall behind, and what waits goes to the capture spill (without one, the bounded capture queue drops and
/// counts) instead of slowing traffic. The thread's CPU counts as background in [`cpu::Shares`].
pub fn run_in_background() {
    cpu::clocks::register_current_thread();
    // Linux: SCHED_IDLE, so a data-path thread that wakes up preempts capture work at once instead of waiting
    // for the scheduler's next decision (nice 19 only shrinks the share). The work still gets every idle
    // cycle, and more than that on a saturated machine, hence the pipeline's own wait (`YieldToDataPath`).
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{
            NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy, thread_native_id,
        };
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        if set_thread_priority_and_policy(thread_native_id(), thread_priority::ThreadPriority::Min, idle).is_ok() {
            return;
        }
    }
    if let Err(error) = thread_priority::set_current_thread_priority(thread_priority::ThreadPriority::Min) {
        tracing::debug!(?error, "Could not lower the priority of a background thread");
    }
}

/// Samples the CPU shares once per [`YieldToDataPath::WINDOW`] and asks the [`deferral::Deferral`] whether
/// the calling background thread should wait through the next window.
///
/// Work that arrives after a quiet spell (no call for [`YieldToDataPath::QUIET`]: the thread was blocked on its
/// queue) is not started at once: the thread first waits one [`YieldToDataPath::FIRST_WINDOW`] and decides on
/// what the machine did meanwhile, by the rule for a wait under way (the background was idle in that window).
/// Deciding on a reading taken before the quiet spell (an idle machine) would let the pipeline, and the store
/// writer and exporters behind it, work through the first whole window of every burst that saturates the proxy:
/// on 2 cores, ~2,000 exchanges and 200–400 ms of background CPU in each 2 s round of the throughput benchmark.
/// Sparse traffic pays [`YieldToDataPath::FIRST_WINDOW`] of delay before it is processed, nothing else.
#[derive(Debug, Default)]
pub struct YieldToDataPath {
    deferral: deferral::Deferral,
    last: Option<cpu::Reading>,
    /// The window under way is the first after a quiet spell.
    first: bool,
    last_call: Option<Instant>,
}

impl YieldToDataPath {
    pub const WINDOW: Duration = Duration::from_millis(200);
    /// The look at the machine before work that arrived after a quiet spell.
    pub const FIRST_WINDOW: Duration = Duration::from_millis(100);
    /// No call for this long means the thread was idle. Longer than [`Self::WINDOW`]: a thread that waits calls
    /// once per window.
    pub const QUIET: Duration = Duration::from_millis(300);

    /// How long to wait instead of working, if at all. `room` is asked only at the end of a window: may the work
    /// wait without anything being lost (see [`deferral::Deferral::decide`])?
    pub fn pause(&mut self, room: impl FnOnce() -> bool) -> Option<Duration> {
        let now = Instant::now();
        let quiet = self.last_call.is_none_or(|t| now.duration_since(t) >= Self::QUIET);
        self.last_call = Some(now);
        if quiet || self.last.is_none() {
            self.last = cpu::Reading::now();
            self.first = self.last.is_some();
            return self.first.then_some(Self::FIRST_WINDOW);
        }
        let last = self.last.as_ref()?;
        let window = if self.first { Self::FIRST_WINDOW } else { Self::WINDOW };
        if last.age() < window {
            let waiting = self.first || self.deferral.waiting();
            return waiting.then(|| window - last.age());
        }
        let reading = cpu::Reading::now()?;
        let shares = reading.since(last);
        self.last = Some(reading);
        let wait = if std::mem::take(&mut self.first) {
            self.deferral.decide_after_look(shares, room())
        } else {
            self.deferral.decide(shares, room(), Instant::now())
        };
        tracing::trace!(?shares, wait, "Background deferral");
        wait.then_some(Self::WINDOW)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Work after a quiet spell waits one first window before anything is decided; a thread that keeps calling
    /// (working, or waiting window by window) gets no new first window.
    #[test]
    fn work_after_a_quiet_spell_waits_a_first_window() {
        let mut yielding = YieldToDataPath::default();
        let no_room = || false;
        assert_eq!(yielding.pause(no_room), Some(YieldToDataPath::FIRST_WINDOW));
        let rest = yielding.pause(no_room).expect("still in the first window");
        assert!(rest <= YieldToDataPath::FIRST_WINDOW);
        std::thread::sleep(rest);
        // The window is over: with no room in the spill the decision is to work, and it stays so while calls go on.
        assert_eq!(yielding.pause(no_room), None);
        assert_eq!(yielding.pause(no_room), None);
        std::thread::sleep(YieldToDataPath::QUIET);
        assert_eq!(yielding.pause(no_room), Some(YieldToDataPath::FIRST_WINDOW));
    }
}
