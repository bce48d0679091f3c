//! When capture's background work waits for the data path.
//!
//! The pipeline and store threads run at `SCHED_IDLE`, but that does not keep them off a saturated machine:
//! measured on a 2-core VM (Linux 6.18), two spinning `SCHED_IDLE` threads still got 10–15% of the CPU while a
//! closed-loop load saturated the proxy, and cut its throughput by 10–28%; capture's own background threads took
//! ~20% of the machine the same way (docs/performance.md, "Capture's background work waits for the data path").
//! So the pipeline also steps aside by itself: while the machine is full and the data path is a large part of
//! it, the pipeline takes nothing, exchanges wait in the capture spill, and the work is done once the
//! machine has room.
//!
//! [`Deferral`] decides once per sampling window, from the CPU shares of the window ([`super::cpu`]):
//! - **working → waiting** when the machine was full (≥ [`MACHINE_FULL`], background work included) and the
//!   data path was busy: it used at least [`DATA_PATH_BUSY`] of the machine, or the proxy's runtime workers had
//!   work at least [`WORKERS_BUSY`] of the time (the share drops when the background threads take CPU from the
//!   workers, the busy time does not). A full machine alone is not enough: with a backlog the
//!   background threads fill every idle cycle themselves, and another program keeping the machine busy is no
//!   reason to stop showing the agent's calls.
//! - **waiting → waiting** for the first [`PROBE_WINDOWS`], then while the machine, the background threads'
//!   own share taken out, is still mostly busy ([`OTHERS_FULL`]) and the data path still busy: what the data
//!   path and the rest of the machine want leaves no room.
//! - **waiting → working** otherwise. A wait that ends after its probe windows was a probe that found room
//!   (the machine was full only because of the background work): the next probe comes after a back-off that
//!   doubles up to [`MAX_BACKOFF`], so a backlog drained beside steady traffic pauses for two windows at most
//!   every few seconds.
//! - A wait ends on a quiet data path only after [`QUIET_WINDOWS`] windows in a row, and such an end leaves no
//!   back-off (it found no room, the load eased): the next saturation is met at once. The forward mode's
//!   saturated data path sits near the bars (0.2–0.3 of the machine, workers busy 0.4–0.7): a single window
//!   under them used to end the wait and hold the next one back for [`MIN_BACKOFF`], so the pipeline and
//!   store writer ran through half of a 2 s benchmark round.
//! - The caller says whether waiting is allowed at all ([`Deferral::decide`]'s `room`): the spill must have
//!   room for what arrives meanwhile, so the work that waits is never work that gets dropped.

use std::time::{Duration, Instant};

use super::cpu::Shares;

/// The whole machine busy at or above this fraction counts as full.
pub const MACHINE_FULL: f64 = 0.9;
/// While waiting: what runs besides llmtap's background threads still uses at least this fraction of the
/// machine. Well below [`MACHINE_FULL`]: the exporter and the checkpointer still run while the pipeline waits
/// (at `SCHED_IDLE` they too take CPU from the rest), and `/proc/stat` counts 10 ms ticks, a few per window
/// and core. Measured at saturation on 2 cores: 0.77–1.0 per window; beside 20k/s of paced traffic: ~0.45.
pub const OTHERS_FULL: f64 = 0.75;
/// A wait lasts at least this many windows: in the first one, the store writer still commits what the pipeline
/// handed it before the wait, so the machine without the background threads is only seen from the second.
pub const PROBE_WINDOWS: u32 = 2;
/// The data path (the proxy's workers and the capture spill) using at least this fraction of the machine
/// counts as busy. Measured on 2 cores with the load generator and the upstream beside it: 0.45–0.53 at
/// saturation, ~0.2 at 10k exchanges/s (where the background threads, working at their own limit, fill the
/// machine and a wait would only make them fall behind).
pub const DATA_PATH_BUSY: f64 = 0.3;
/// The proxy's runtime workers busy for at least this fraction of the wall time also counts as a busy data path
/// (`Shares::workers_busy`): it holds while the background threads squeeze the workers' CPU share.
pub const WORKERS_BUSY: f64 = 0.45;
/// A wait ends after this many windows in a row without a busy data path (or at once without room in the
/// spill): one window under the bars is noise at saturation, and the drain after the load ends starts one
/// window later.
pub const QUIET_WINDOWS: u32 = 2;
/// How long the first probe after a wait that found room is held back.
pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(16);

#[derive(Debug)]
pub struct Deferral {
    /// Windows waited since the wait began; 0 while working.
    waited: u32,
    /// Windows in a row, during a wait, without a busy data path.
    quiet: u32,
    backoff: Duration,
    no_probe_before: Option<Instant>,
}

impl Default for Deferral {
    fn default() -> Self {
        Deferral {
            waited: 0,
            quiet: 0,
            backoff: MIN_BACKOFF,
            no_probe_before: None,
        }
    }
}

impl Deferral {
    pub fn waiting(&self) -> bool {
        self.waited > 0
    }

    /// Whether to wait through the next window, given the last window's shares. `room`: waiting cannot
    /// lose anything (the spill can take what arrives meanwhile).
    pub fn decide(&mut self, shares: Shares, room: bool, now: Instant) -> bool {
        let data_path_busy = data_path_busy(&shares);
        if !room {
            self.stop_waiting(now);
            return false;
        }
        if !data_path_busy {
            if self.waiting() {
                self.quiet += 1;
                if self.quiet < QUIET_WINDOWS {
                    self.waited += 1;
                    return true;
                }
                // The load eased: no room was found, so nothing to back off from.
                self.waited = 0;
                self.quiet = 0;
                self.no_probe_before = None;
            }
            return false;
        }
        self.quiet = 0;
        if self.waiting() {
            if self.waited < PROBE_WINDOWS || shares.machine - shares.background >= OTHERS_FULL {
                self.waited += 1;
                return true;
            }
            self.stop_waiting(now);
            return false;
        }
        let may_probe = self.no_probe_before.is_none_or(|t| now >= t);
        if shares.machine >= MACHINE_FULL && may_probe {
            self.waited = 1;
            return true;
        }
        false
    }

    /// Whether to wait, given the shares of the window the thread has just waited through before work that
    /// arrived after a quiet spell (see `YieldToDataPath`). The background threads were idle in it, so the rule
    /// is the one for a wait under way: the rest of the machine mostly busy and the data path busy. A look that
    /// finds room leaves the probe back-off as it was: it probed nothing.
    pub fn decide_after_look(&mut self, shares: Shares, room: bool) -> bool {
        let full = data_path_busy(&shares) && shares.machine - shares.background >= OTHERS_FULL;
        if room && full {
            // Past the probe windows: when the load ends, the wait counts as one that found the data path busy.
            self.waited = PROBE_WINDOWS + 1;
        }
        room && full
    }

    fn stop_waiting(&mut self, now: Instant) {
        match self.waited {
            0 => return,
            w if w <= PROBE_WINDOWS => self.backoff = (self.backoff * 2).min(MAX_BACKOFF),
            _ => self.backoff = MIN_BACKOFF,
        }
        self.waited = 0;
        self.quiet = 0;
        self.no_probe_before = Some(now + self.backoff);
    }
}

/// The data path used a large share of the machine, or its workers had work most of the time.
fn data_path_busy(shares: &Shares) -> bool {
    shares.data_path >= DATA_PATH_BUSY || shares.workers_busy >= WORKERS_BUSY
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (whole machine, background threads, data path)
    const fn shares(machine: f64, background: f64, data_path: f64) -> Shares {
        Shares {
            machine,
            background,
            data_path,
            workers_busy: 0.0,
        }
    }

    const SATURATED_WORKING: Shares = shares(0.96, 0.21, 0.45);
    const SATURATED_WAITING: Shares = shares(0.97, 0.01, 0.48);
    /// A backlog drained beside steady traffic: the background fills the machine, the rest leaves room.
    const DRAINING_BESIDE_TRAFFIC: Shares = shares(1.0, 0.45, 0.35);
    const ROOM_WHILE_WAITING: Shares = shares(0.7, 0.01, 0.35);
    const WINDOW: Duration = Duration::from_millis(200);

    #[test]
    fn a_saturated_data_path_makes_the_background_wait_until_the_load_ends() {
        let mut d = Deferral::default();
        let mut now = Instant::now();
        assert!(d.decide(SATURATED_WORKING, true, now));
        for _ in 0..20 {
            now += WINDOW;
            assert!(d.decide(SATURATED_WAITING, true, now));
        }
        let idle = shares(0.3, 0.0, 0.05);
        for _ in 1..QUIET_WINDOWS {
            now += WINDOW;
            assert!(d.decide(idle, true, now), "one quiet window does not end a wait");
        }
        now += WINDOW;
        assert!(!d.decide(idle, true, now));
        // A wait that ended with the load leaves no back-off: the next saturation is met at once.
        now += WINDOW;
        assert!(d.decide(SATURATED_WORKING, true, now));
    }

    /// The forward mode's saturated data path dips under the bars for a window now and then: the wait goes on,
    /// and when the load eases and comes back the next wait starts at once, without a back-off.
    #[test]
    fn a_window_under_the_bars_neither_ends_a_wait_nor_holds_back_the_next() {
        let borderline = Shares {
            workers_busy: 0.4,
            ..shares(0.97, 0.01, 0.27)
        };
        let mut d = Deferral::default();
        let mut now = Instant::now();
        assert!(d.decide(SATURATED_WORKING, true, now));
        for window in [
            SATURATED_WAITING,
            borderline,
            SATURATED_WAITING,
            SATURATED_WAITING,
            borderline,
        ] {
            now += WINDOW;
            assert!(d.decide(window, true, now), "{window:?}");
        }
        now += WINDOW;
        assert!(!d.decide(borderline, true, now), "two quiet windows in a row end it");
        now += WINDOW;
        assert!(
            d.decide(SATURATED_WORKING, true, now),
            "no back-off after the load eased"
        );
    }

    #[test]
    fn a_look_at_a_saturated_machine_waits_until_the_load_ends() {
        let mut d = Deferral::default();
        let mut now = Instant::now();
        assert!(d.decide_after_look(SATURATED_WAITING, true));
        for _ in 0..5 {
            now += WINDOW;
            assert!(d.decide(SATURATED_WAITING, true, now));
        }
        for _ in 1..QUIET_WINDOWS {
            now += WINDOW;
            assert!(d.decide(shares(0.3, 0.0, 0.05), true, now));
        }
        now += WINDOW;
        assert!(!d.decide(shares(0.3, 0.0, 0.05), true, now));
        // The wait found the data path busy: the next saturation is met at once.
        now += WINDOW;
        assert!(d.decide(SATURATED_WORKING, true, now));
    }

    #[test]
    fn a_look_that_finds_room_leaves_the_probes_as_they_were() {
        let mut d = Deferral::default();
        let now = Instant::now();
        assert!(!d.decide_after_look(ROOM_WHILE_WAITING, true));
        assert!(
            !d.decide_after_look(shares(0.97, 0.0, 0.1), true),
            "a busy machine, a quiet data path"
        );
        assert!(!d.decide_after_look(SATURATED_WAITING, false), "no room in the spill");
        assert!(!d.waiting());
        assert!(d.decide(SATURATED_WORKING, true, now), "no back-off");
    }

    /// The forward mode's saturated data path on 2 cores: the background threads squeeze its CPU share below
    /// `DATA_PATH_BUSY`, but its workers are busy nearly all the time.
    #[test]
    fn busy_workers_count_as_a_busy_data_path_when_their_share_is_squeezed() {
        let squeezed = Shares {
            workers_busy: 0.9,
            ..shares(0.98, 0.2, 0.25)
        };
        let mut d = Deferral::default();
        let now = Instant::now();
        assert!(
            !d.decide(shares(0.98, 0.2, 0.25), true, now),
            "the share alone is below the bar"
        );
        assert!(d.decide(squeezed, true, now));
        assert!(d.decide_after_look(squeezed, true));
        let paced = Shares {
            workers_busy: 0.3,
            ..shares(1.0, 0.6, 0.2)
        };
        let mut d = Deferral::default();
        assert!(
            !d.decide(paced, true, now),
            "paced traffic with room to spare: the background keeps up"
        );
    }

    #[test]
    fn no_wait_without_room_in_the_spill() {
        let mut d = Deferral::default();
        let now = Instant::now();
        assert!(!d.decide(SATURATED_WORKING, false, now));
        assert!(d.decide(SATURATED_WORKING, true, now));
        assert!(
            !d.decide(SATURATED_WAITING, false, now + WINDOW),
            "a wait ends as soon as the spill is half full, probe or not"
        );
    }

    #[test]
    fn a_full_machine_without_a_busy_data_path_is_no_reason_to_wait() {
        let mut d = Deferral::default();
        let other_program = shares(1.0, 0.02, 0.03);
        assert!(!d.decide(other_program, true, Instant::now()));
    }

    #[test]
    fn probes_that_find_room_back_off_and_keep_the_drain_going() {
        let mut d = Deferral::default();
        let start = Instant::now();
        let mut now = start;
        let mut waited = 0;
        let windows = 60 * 5; // one minute
        for _ in 0..windows {
            let shares = if d.waiting() {
                ROOM_WHILE_WAITING
            } else {
                DRAINING_BESIDE_TRAFFIC
            };
            if d.decide(shares, true, now) {
                waited += 1;
            }
            now += WINDOW;
        }
        // Probes at ~0, 2, 6, 15, 31 and 47 s (a back-off of 2, 4, 8, 16, 16 s after each probe), two
        // windows each.
        assert!((10..=16).contains(&waited), "waited {waited} of {windows} windows");
        assert_eq!(d.backoff, MAX_BACKOFF);
    }
}
