//! The store's body codec on recorded traffic: compression ratio and time per body for the codec llmtap uses
//! (`llmtap::store::codec`: zstd, bodies below 1 KB plain) against zlib level 1 with a reused state (what the
//! store used before).
//! Bodies: every file of the shared corpus (`LLMTAP_FIXTURES`, default `tests/fixtures`), one thread.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flate2::{Compress, Compression, FlushCompress};

pub fn run(rounds: usize) {
    let root = std::env::var_os("LLMTAP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    let bodies: Vec<String> = files(&root)
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .filter(|b| !b.is_empty())
        .collect();
    if bodies.is_empty() {
        eprintln!("llmtap-bench codec: no bodies under {}", root.display());
        return;
    }
    println!(
        "== store body codec: {} bodies from {}, {rounds} rounds",
        bodies.len(),
        root.display()
    );
    let small: Vec<String> = bodies.iter().filter(|b| b.len() < 4096).cloned().collect();
    for (label, set) in [("all bodies", &bodies), ("bodies < 4 KB", &small)] {
        let total: usize = set.iter().map(String::len).sum();
        let mut zlib = Compress::new(Compression::fast(), true);
        let (zlib_out, zlib_us) = time(set, rounds, |b| {
            zlib.reset();
            let mut out = Vec::with_capacity(b.len() + 64);
            let _ = zlib.compress_vec(b.as_bytes(), &mut out, FlushCompress::Finish);
            out.len()
        });
        let (zstd_out, zstd_us) = time(set, rounds, |b| llmtap::store::codec::compress(b).len());
        let blobs: Vec<Vec<u8>> = set.iter().map(|b| llmtap::store::codec::compress(b)).collect();
        let started = Instant::now();
        for _ in 0..rounds {
            for blob in &blobs {
                std::hint::black_box(llmtap::store::codec::decompress(Some(blob.clone())));
            }
        }
        let read_us = started.elapsed().as_secs_f64() * 1e6 / (rounds * set.len()) as f64;
        println!(
            "  {label:14} ({:>4}, {:>8} bytes): llmtap (zstd 1, plain < 1 KB) {:.2}:1, {zstd_us:6.1} us/body, read {read_us:5.1} us/body | zlib 1 {:.2}:1, {zlib_us:6.1} us/body",
            set.len(),
            total,
            total as f64 / zstd_out as f64,
            total as f64 / zlib_out as f64,
        );
    }
}

/// Total compressed bytes of one round, and the mean time per body over all rounds.
fn time(set: &[String], rounds: usize, mut compress: impl FnMut(&str) -> usize) -> (usize, f64) {
    let mut out = 0;
    let started = Instant::now();
    for round in 0..rounds {
        let bytes: usize = set.iter().map(|b| compress(b)).sum();
        if round == 0 {
            out = bytes;
        }
    }
    (out, started.elapsed().as_secs_f64() * 1e6 / (rounds * set.len()) as f64)
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out
}
