#!/usr/bin/env bash
# Benchmarks: builds release binaries and prints figures (nothing is asserted).
#   scripts/bench.sh            full run (~9 minutes): proxy latency/throughput/streams/memory, forward mode, export,
#                               derivation
#   scripts/bench.sh --smoke    tiny configuration on the debug build; CI runs it to check the benchmark still works
#   scripts/bench.sh proxy|forward|derive [--smoke]
set -euo pipefail
cd "$(dirname "$0")/.."
# The smoke run only checks that the benchmark still works: it uses the test profile's build, which CI has
# just made for `cargo test`, instead of a release build of its own (half of CI's time). Figures need release.
# `--all-targets` resolves features as `cargo test` did (dev-dependencies included), so nothing is rebuilt.
if [[ " $* " == *" --smoke "* ]]; then
  cargo build --locked --all-targets
  exec target/debug/llmtap-bench "$@"
fi
cargo build --release --locked --bin llmtap --bin llmtap-bench
exec target/release/llmtap-bench "$@"
