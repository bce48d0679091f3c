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
#[derive(Debug, Default)]
pub struct YieldToDataPath {
    deferral: deferral::Deferral,
    last: Option<cpu::Reading>,
}

impl YieldToDataPath {
    pub const WINDOW: Duration = Duration::from_millis(200);

    /// Whether to sleep for one window instead of working. `room` is asked only at the end of a window: may
    /// the work wait without anything being lost (see [`deferral::Deferral::decide`])?
    pub fn should_wait(&mut self, room: impl FnOnce() -> bool) -> bool {
        let Some(last) = &self.last else {
            self.last = cpu::Reading::now();
            return false;
        };
        if last.age() < Self::WINDOW {
            return self.deferral.waiting();
        }
        let Some(now) = cpu::Reading::now() else {
            return false;
        };
        let shares = now.since(last);
        self.last = Some(now);
        let wait = self.deferral.decide(shares, room(), Instant::now());
        tracing::trace!(?shares, wait, "Background deferral");
        wait
    }
}
