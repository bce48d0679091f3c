//! Background threads: what every thread off the data path (pipeline, store writer, exporters, API) does to stay
//! out of the way of the proxy's workers.
//! The capture spill's thread is the one exception: it must still run when the workers saturate the machine,
//! or capture drops what it could have put on disk (see `capture::spill`).

/// Capture work must never take CPU from the data path: on a busy machine the pipeline and store threads yield
/// (nice 19), fall behind, and the bounded capture queue drops and counts instead of slowing traffic.
pub fn run_in_background() {
    // Linux: SCHED_IDLE, so a data-path thread that wakes up preempts capture work at once instead of waiting
    // for the scheduler's next decision (nice 19 only shrinks the share). The work still gets every idle
    // cycle; under sustained saturation the bounded capture queue drops and counts instead of slowing traffic.
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
