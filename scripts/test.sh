#!/usr/bin/env bash
# The one test command: installs what the tests need (a Python virtualenv with the official provider SDKs),
# then checks formatting and lints and runs every test, and the benchmark in its smoke configuration.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r tests/sdk/requirements.txt

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked
if [ -f scripts/bench.sh ]; then
  scripts/bench.sh --smoke
fi
