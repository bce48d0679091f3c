#!/usr/bin/env bash
# Benchmarks: builds release binaries and prints figures (nothing is asserted).
#   scripts/bench.sh            full run (~2 minutes): proxy latency/throughput/streams/memory, derivation
#   scripts/bench.sh --smoke    tiny configuration; CI runs it to check the benchmark still works
#   scripts/bench.sh proxy|derive [--smoke]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin llmtap --bin llmtap-bench
exec target/release/llmtap-bench "$@"
