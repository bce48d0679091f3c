//! Where the machine's CPU goes, sampled between two moments: the whole machine, llmtap's background threads
//! (every thread that called [`super::run_in_background`]), and the rest of llmtap (the proxy's workers, the
//! capture spill). The pipeline's deferral ([`super::deferral`]) decides on these shares, and on how busy the
//! proxy's runtime workers were ([`workers`]): a CPU share says what the data path got, not what it wanted.
//!
//! Linux only (`/proc/stat` and per-thread CPU clocks); elsewhere [`Reading::now`] is `None` and nothing defers.

use std::time::Instant;

/// Fractions of the machine's whole CPU capacity (every core) used between two readings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Shares {
    /// Everything running on the machine, llmtap included.
    pub machine: f64,
    /// llmtap's background threads.
    pub background: f64,
    /// The rest of llmtap: the proxy's workers and the capture spill.
    pub data_path: f64,
    /// The fraction of the wall time the proxy's runtime workers had work (0 when no runtime is watched). Unlike
    /// `data_path`, it does not drop when other threads take the CPU from the workers: a worker preempted while
    /// it has tasks to run is still busy. On 2 cores the background threads' own work pushed the forward
    /// mode's saturated data path from ~0.4 of the machine down to ~0.25, below `DATA_PATH_BUSY`, so that the
    /// CPU share alone let them go on working through the load.
    pub workers_busy: f64,
}

/// One moment's counters.
#[derive(Debug, Clone)]
pub struct Reading {
    at: Instant,
    /// `/proc/stat` ticks: (busy, idle) summed over every core.
    machine_busy: u64,
    machine_idle: u64,
    cores: u32,
    process_ns: u64,
    /// Each background thread's CPU time, by its clock.
    background_ns: Vec<(ClockId, u64)>,
    /// The watched runtime's workers: (their busy time summed, how many).
    workers: Option<(u64, usize)>,
}

impl Reading {
    #[cfg(target_os = "linux")]
    pub fn now() -> Option<Reading> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let (machine_busy, machine_idle, cores) = parse_proc_stat(&stat)?;
        Some(Reading {
            at: Instant::now(),
            machine_busy,
            machine_idle,
            cores,
            process_ns: clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)?,
            background_ns: clocks::registered()
                .into_iter()
                .filter_map(|clock| Some((clock, clock_ns(clock)?)))
                .collect(),
            workers: workers::busy_ns(),
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn now() -> Option<Reading> {
        None
    }

    pub fn age(&self) -> std::time::Duration {
        self.at.elapsed()
    }

    /// The shares used since `earlier`. A background thread that started or ended in between counts for what
    /// it used while both readings saw it.
    pub fn since(&self, earlier: &Reading) -> Shares {
        let capacity_ns = self.at.duration_since(earlier.at).as_nanos() as f64 * f64::from(self.cores.max(1));
        let busy = self.machine_busy.saturating_sub(earlier.machine_busy) as f64;
        let idle = self.machine_idle.saturating_sub(earlier.machine_idle) as f64;
        let background_ns: u64 = self
            .background_ns
            .iter()
            .filter_map(|(clock, ns)| {
                let before = earlier.background_ns.iter().find(|(c, _)| c == clock)?.1;
                Some(ns.saturating_sub(before))
            })
            .sum();
        let process_ns = self.process_ns.saturating_sub(earlier.process_ns);
        let share = |ns: u64| {
            if capacity_ns > 0.0 {
                ns as f64 / capacity_ns
            } else {
                0.0
            }
        };
        let workers_busy = match (self.workers, earlier.workers) {
            (Some((now, n)), Some((before, m))) if n == m && n > 0 => {
                let wall_ns = self.at.duration_since(earlier.at).as_nanos() as f64 * n as f64;
                if wall_ns > 0.0 {
                    (now.saturating_sub(before) as f64 / wall_ns).min(1.0)
                } else {
                    0.0
                }
            }
            _ => 0.0,
        };
        Shares {
            machine: if busy + idle > 0.0 { busy / (busy + idle) } else { 0.0 },
            background: share(background_ns),
            data_path: share(process_ns.saturating_sub(background_ns)),
            workers_busy,
        }
    }
}

/// (busy ticks, idle ticks, cores) from `/proc/stat`: its first line sums every core's
/// `user nice system idle iowait irq softirq steal ...`; waiting for I/O counts as idle.
fn parse_proc_stat(stat: &str) -> Option<(u64, u64, u32)> {
    let mut lines = stat.lines();
    let total: Vec<u64> = lines
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let field = |i: usize| total.get(i).copied().unwrap_or(0);
    let busy = field(0) + field(1) + field(2) + field(5) + field(6) + field(7);
    let idle = field(3) + field(4);
    let cores = lines
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    Some((busy, idle, u32::try_from(cores).ok()?.max(1)))
}

#[cfg(target_os = "linux")]
type ClockId = libc::clockid_t;
#[cfg(not(target_os = "linux"))]
type ClockId = i32;

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn clock_ns(clock: ClockId) -> Option<u64> {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec to write to; an unknown clock (a thread that has ended) is an error return.
    if unsafe { libc::clock_gettime(clock, &mut t) } != 0 {
        return None;
    }
    Some(u64::try_from(t.tv_sec).ok()? * 1_000_000_000 + u64::try_from(t.tv_nsec).ok()?)
}

/// The proxy's runtime, whose workers' busy time every reading takes (tokio counts a worker busy from the moment
/// it has tasks to run until it has none left, preempted or not).
pub mod workers {
    use std::sync::OnceLock;

    static RUNTIME: OnceLock<tokio::runtime::RuntimeMetrics> = OnceLock::new();

    /// Watch this runtime's workers (the first call wins: one proxy runtime per process). Whether this runtime
    /// is the one watched.
    pub fn watch(runtime: &tokio::runtime::Handle) -> bool {
        RUNTIME.set(runtime.metrics()).is_ok()
    }

    /// (busy time of every worker summed, in ns; the number of workers).
    pub(super) fn busy_ns() -> Option<(u64, usize)> {
        let metrics = RUNTIME.get()?;
        let n = metrics.num_workers();
        let total = (0..n)
            .map(|w| u64::try_from(metrics.worker_total_busy_duration(w).as_nanos()).unwrap_or(u64::MAX))
            .fold(0u64, u64::saturating_add);
        Some((total, n))
    }
}

/// The background threads' CPU clocks. A thread registers once, the first time it calls `run_in_background`,
/// and is removed when it ends (a thread-local guard), so a clock is never read after its thread is gone.
pub(super) mod clocks {
    use std::sync::Mutex;

    use super::ClockId;

    static REGISTERED: Mutex<Vec<ClockId>> = Mutex::new(Vec::new());

    struct Registration(Option<ClockId>);

    impl Drop for Registration {
        fn drop(&mut self) {
            if let (Some(clock), Ok(mut list)) = (self.0, REGISTERED.lock()) {
                list.retain(|c| *c != clock);
            }
        }
    }

    thread_local! {
        static THIS_THREAD: std::cell::OnceCell<Registration> = const { std::cell::OnceCell::new() };
    }

    pub fn register_current_thread() {
        let _ = THIS_THREAD.try_with(|cell| {
            cell.get_or_init(|| {
                let clock = current_thread_clock();
                if let (Some(clock), Ok(mut list)) = (clock, REGISTERED.lock()) {
                    list.push(clock);
                }
                Registration(clock)
            });
        });
    }

    pub fn registered() -> Vec<ClockId> {
        REGISTERED.lock().map(|l| l.clone()).unwrap_or_default()
    }

    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    pub(in crate::background) fn current_thread_clock() -> Option<ClockId> {
        let mut clock: ClockId = 0;
        // SAFETY: pthread_self is this live thread; `clock` is a valid place to write its CPU clock id.
        (unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) } == 0).then_some(clock)
    }

    #[cfg(not(target_os = "linux"))]
    pub(in crate::background) fn current_thread_clock() -> Option<ClockId> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_sums_busy_and_idle_ticks_and_counts_cores() {
        let stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\n\
                    cpu1 50 3 25 400 10 2 1 5 0 0\nintr 12345\nctxt 999\n";
        assert_eq!(parse_proc_stat(stat), Some((100 + 5 + 50 + 3 + 2 + 10, 800 + 20, 2)));
        assert_eq!(parse_proc_stat("intr 1\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 x 3\n"), None);
    }

    /// A worker of the watched runtime running a task counts as busy for that time, whether or not it got the CPU.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_watched_runtime_s_busy_worker_shows_in_workers_busy() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        if !workers::watch(rt.handle()) {
            return; // another runtime of this test process is watched
        }
        let before = Reading::now().unwrap();
        rt.block_on(async {
            tokio::spawn(async {
                let start = Instant::now();
                while start.elapsed() < std::time::Duration::from_millis(150) {
                    std::hint::spin_loop();
                }
            })
            .await
            .unwrap()
        });
        // A worker hands its busy time to the runtime's metrics when it parks, which may come a moment after
        // the task's result reached this thread: wait for that hand-over (bounded), not a fixed time.
        let busy_before = before.workers.expect("the watched runtime").0;
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let after = loop {
            let now = Reading::now().unwrap();
            let busy = now.workers.expect("the watched runtime").0.saturating_sub(busy_before);
            if busy >= 100_000_000 || Instant::now() > deadline {
                break now;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        let busy_ns = after.workers.unwrap().0.saturating_sub(busy_before);
        assert!(busy_ns >= 100_000_000, "the 150 ms task counted {busy_ns} ns busy");
        let shares = after.since(&before);
        assert!(shares.workers_busy > 0.0, "{shares:?}");
        assert!(shares.workers_busy <= 1.0, "{shares:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_busy_background_thread_counts_in_the_background_share_until_it_ends() {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let spinner = std::thread::spawn(move || {
            clocks::register_current_thread();
            ready_tx.send(clocks::current_thread_clock()).unwrap();
            while done_rx.try_recv().is_err() {
                std::hint::black_box(0u64);
            }
        });
        let spinner_clock = ready_rx.recv().unwrap().expect("a thread CPU clock");
        let before = Reading::now().expect("linux has /proc/stat");
        // This thread sleeps: the process's CPU in the window is the spinner's.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let after = Reading::now().unwrap();
        done_tx.send(()).unwrap();
        spinner.join().unwrap();
        let shares = after.since(&before);
        let cores = f64::from(after.cores);
        // The spinner is one core's worth of the window at most (less while other tests run); other tests'
        // threads are in the process's CPU but not in the background share.
        assert!(shares.background > 0.05 / cores, "{shares:?}");
        assert!(shares.background <= 1.05 / cores, "{shares:?}");
        assert!(shares.machine >= shares.background * 0.8, "{shares:?}");
        assert!(after.background_ns.iter().any(|(c, _)| *c == spinner_clock));
        // After the thread ended, its clock is no longer read.
        let ended = Reading::now().unwrap();
        assert!(!ended.background_ns.iter().any(|(c, _)| *c == spinner_clock));
    }
}
