//! llmtap's benchmark: prints figures, asserts nothing. `scripts/bench.sh` builds it in release and runs it.
//!
//! Modes: `all` (default), `proxy` (added latency, throughput, streams, memory), `forward` (the forward mode's
//! TLS-terminating hop against nginx's: added latency, throughput, new TLS connections per second), `latency` and `throughput`
//! (its first two phases, alone; in these and in `forward`, `LLMTAP_BENCH_BASELINE=<path to another build's
//! llmtap>` adds that build, capture on, as one more target of every round),
//! `derive` (normalize + derive throughput, latency to a stored step), `codec` (the store's body compression on
//! the recorded corpus), `viewer` (the web viewer's page reads on a store with a 10,000-call session, and
//! its sessions list on a store of 100,000 one-call sessions), `bytes` (store bytes per call of a 100-call
//! session), `lossless` (the lossless capture rate), `store-rate` (the pipeline and store writer's own
//! capacity), `search` (full-text search over a store of 100,000 calls: indexing rate, query latency);
//! `--smoke` runs a tiny configuration (CI checks it still runs).
//! Internal: `upstream`, `upstream-tls CERT KEY`, `passthrough PORT` (the child processes the proxy benchmark starts), `receiver` (an
//! OTLP/gRPC receiver that counts spans) and `saturate URL [SECS] [CONNS]` (the throughput phase's closed-loop
//! load against one URL), for profiling llmtap by hand.
#![allow(clippy::print_stdout)]

mod capture;
mod codec;
mod derive;
mod forward;
mod proxy;
mod search;
mod servers;
mod shared;
mod stats;
mod viewer;

/// mimalloc: the proxy and the pipeline allocate many short-lived buffers; glibc malloc spent ~35% of the
/// derivation benchmark in malloc/free, mimalloc cuts that substantially (see README, Benchmarks).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let smoke = args.iter().any(|a| a == "--smoke");
    let mode = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(String::as_str)
        .unwrap_or("all");
    // LLMTAP_BENCH_CALLS sets the derivation benches' call count (how many sessions interleave: calls / 10).
    let calls = if smoke {
        2_000
    } else {
        std::env::var("LLMTAP_BENCH_CALLS")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(100_000)
    };
    let mut scale = if smoke { proxy::SMOKE } else { proxy::FULL };
    // LLMTAP_BENCH_LATENCY_RATE sets the added-latency phase's request rate (requests per second, open loop).
    if let Some(rate) = std::env::var("LLMTAP_BENCH_LATENCY_RATE")
        .ok()
        .and_then(|r| r.parse().ok())
    {
        scale.latency_rate = rate;
    }
    // LLMTAP_BENCH_ROUNDS sets the throughput and stream phases' round count: more rounds, a steadier median
    // on a noisy machine.
    if let Some(rounds) = std::env::var("LLMTAP_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|r| *r > 0)
    {
        scale.rounds = rounds;
    }
    let scale = &scale;
    let codec_rounds = if smoke { 1 } else { 20 };
    match mode {
        "all" => {
            proxy::run(scale, proxy::Phases::All);
            forward::run(scale, smoke);
            proxy::export(if smoke { 500 } else { 20_000 });
            derive::run(calls);
            codec::run(codec_rounds);
            viewer_run(smoke);
            capture::bytes_per_call(100);
            capture::lossless(smoke);
            capture::store_rate(if smoke { 2_000 } else { 50_000 }, 1);
        }
        "proxy" => proxy::run(scale, proxy::Phases::All),
        "latency" => proxy::run(scale, proxy::Phases::Latency),
        "throughput" => proxy::run(scale, proxy::Phases::Throughput),
        "memory" => proxy::memory(scale),
        "forward" => forward::run(scale, smoke),
        "upstream" => report(servers::upstream()),
        "upstream-tls" => {
            let mut rest = args.iter().filter(|a| !a.starts_with("--")).skip(1);
            let (cert, key) = (
                rest.next().cloned().unwrap_or_default(),
                rest.next().cloned().unwrap_or_default(),
            );
            report(servers::upstream_tls(&cert, &key))
        }
        "passthrough" => {
            let port = args
                .iter()
                .filter(|a| !a.starts_with("--"))
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            report(servers::passthrough(port))
        }
        "receiver" => match servers::otlp_receiver() {
            Ok((addr, _)) => {
                println!("listening on {addr}");
                loop {
                    std::thread::park();
                }
            }
            Err(e) => eprintln!("llmtap-bench: {e}"),
        },
        "saturate" => {
            let mut rest = args.iter().filter(|a| !a.starts_with("--")).skip(1);
            let url = rest.next().cloned().unwrap_or_default();
            let secs = rest.next().and_then(|s| s.parse().ok()).unwrap_or(10);
            let conns = rest.next().and_then(|s| s.parse().ok()).unwrap_or(32);
            proxy::saturate(&url, secs, conns);
        }
        "pace" => {
            let mut rest = args.iter().filter(|a| !a.starts_with("--")).skip(1);
            let url = rest.next().cloned().unwrap_or_default();
            let rate = rest.next().and_then(|s| s.parse().ok()).unwrap_or(1_000);
            let secs = rest.next().and_then(|s| s.parse().ok()).unwrap_or(5.0);
            proxy::pace(&url, rate, secs);
        }
        "derive" => derive::run(calls),
        "derive-throughput" => derive::throughput(calls),
        "derive-steady" => derive::steady(calls),
        "derive-split" => derive::split(calls, 5..15),
        "codec" => codec::run(codec_rounds),
        "viewer" => viewer_run(smoke),
        "shared-store" => {
            let n = args
                .iter()
                .filter(|a| !a.starts_with("--"))
                .nth(1)
                .and_then(|s| s.parse().ok());
            shared::run(n.unwrap_or(if smoke { 2_000 } else { 100_000 }))
        }
        "bytes" => capture::bytes_per_call(100),
        "lossless" => capture::lossless(smoke),
        "store-rate" => {
            let mut rest = args.iter().filter(|a| !a.starts_with("--")).skip(1);
            let n = rest.next().and_then(|s| s.parse().ok());
            let rounds = rest.next().and_then(|s| s.parse().ok()).unwrap_or(1);
            capture::store_rate(n.unwrap_or(if smoke { 2_000 } else { 50_000 }), rounds)
        }
        "export" => proxy::export(if smoke { 500 } else { 20_000 }),
        // LLMTAP_BENCH_SEARCH_CALLS sets the store's call count (default 100,000).
        "search" => search::run(
            std::env::var("LLMTAP_BENCH_SEARCH_CALLS")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(if smoke { 2_000 } else { 100_000 }),
        ),
        other => eprintln!(
            "unknown mode {other:?}; modes: all, proxy, forward, latency, throughput, memory, export, derive, codec, viewer, shared-store [N], bytes, lossless, \
             store-rate [N] [ROUNDS], saturate URL [SECS] [CONNS], pace URL [RATE] [SECS]"
        ),
    }
}

/// LLMTAP_BENCH_VIEWER_CALLS sets the big session's call count (default 10,000), LLMTAP_BENCH_VIEWER_FLOOD the
/// number of one-call sessions of the second store (default 100,000).
fn viewer_run(smoke: bool) {
    let calls = std::env::var("LLMTAP_BENCH_VIEWER_CALLS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(if smoke { 500 } else { 10_000 });
    viewer::run(calls, if smoke { 50 } else { 2_000 });
    let flood = std::env::var("LLMTAP_BENCH_VIEWER_FLOOD")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(if smoke { 500 } else { 100_000 });
    viewer::run_flood(flood);
}

fn report(r: std::io::Result<()>) {
    if let Err(e) = r {
        eprintln!("llmtap-bench: {e}");
    }
}
