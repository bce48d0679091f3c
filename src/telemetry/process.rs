//! The process metrics (CPU, resident memory, open descriptors), read from the operating system when collected.
//! A value the platform cannot give is left out rather than reported as 0.

use super::instruments::{Point, Value};

fn point(value: Value) -> Point {
    Point {
        value,
        attributes: Vec::new(),
    }
}

/// User and system CPU time of the whole process: the process CPU clock (POSIX), which std does not expose.
#[allow(unsafe_code)]
pub fn cpu_seconds(out: &mut Vec<Point>) {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own; the clock id is a constant the platform defines.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) } == 0 {
        out.push(point(Value::F64(t.tv_sec as f64 + t.tv_nsec as f64 / 1e9)));
    }
}

/// `VmRSS` of `/proc/self/status` (Linux; in kB there).
pub fn rss_bytes(out: &mut Vec<Point>) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return;
    };
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    if let Some(kb) = kb {
        out.push(point(Value::U64(kb * 1024)));
    }
}

/// Entries of `/proc/self/fd` (Linux; the directory handle read here is among them, as in every such count).
pub fn open_fds(out: &mut Vec<Point>) {
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        out.push(point(Value::U64(dir.count() as u64)));
    }
}
