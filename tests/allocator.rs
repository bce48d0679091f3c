//! `allocator::release_freed_memory` against the real allocator the binaries use (mimalloc), in a process of
//! its own so that RSS is this test's alone.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib / 1024.0
}

/// The shape of the problem seen in `llmtap-bench memory`: buffers allocated on one thread (a worker) and
/// freed on another (the other worker, the pipeline). The owner's pages are only reclaimed when it collects.
#[test]
fn memory_freed_on_another_thread_goes_back_to_the_os_when_the_owner_collects() {
    let baseline = rss_mib();
    // 64 MiB in 16 KiB buffers (the size of a connection's read buffer), every page touched.
    let buffers: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8; 16 * 1024]).collect();
    let loaded = rss_mib();
    std::thread::spawn(move || drop(buffers))
        .join()
        .expect("freeing thread");
    let freed_elsewhere = rss_mib();
    llmtap::allocator::release_freed_memory();
    let collected = rss_mib();
    eprintln!(
        "RSS MiB: baseline {baseline:.1}, loaded {loaded:.1}, freed on another thread {freed_elsewhere:.1}, \
         after the owner's collect {collected:.1}"
    );
    assert!(loaded - baseline > 48.0, "the load is resident");
    assert!(
        freed_elsewhere - baseline > 32.0,
        "without a collect the owner keeps the pages (what this fixes)"
    );
    assert!(
        collected - baseline < 16.0,
        "after the collect most of the 64 MiB is back with the OS"
    );
}
