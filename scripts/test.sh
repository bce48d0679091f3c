#!/usr/bin/env bash
# The one test command: installs what the tests need (a Python virtualenv with the official provider SDKs and
# the OpenAI Agents SDK; the npm clients pinned in tests/clients: Claude Code, the Vercel AI SDK), then checks
# formatting and lints and runs every test, and the benchmark in its smoke configuration.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r tests/sdk/requirements.txt
# tests/clients_*.rs run real agent clients from npm, exactly as pinned by tests/clients/package-lock.json.
if ! command -v npm >/dev/null; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then as_root="sudo"; fi
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
fi
if [ ! -f tests/clients/node_modules/.package-lock.json ] \
  || [ tests/clients/package-lock.json -nt tests/clients/node_modules/.package-lock.json ]; then
  npm ci --prefix tests/clients --no-audit --no-fund --loglevel=error
fi
# tests/scale_out.rs runs llmtap replicas behind real nginx, exporting through a real OpenTelemetry collector
# (rotel). Installed only when missing; CI runs this as root on Debian.
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then as_root="sudo"; fi
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light
fi
# tests/cost_live.rs runs `llmtap tail` on a pseudo-terminal through script(1) (util-linux; essential on Debian,
# but not in every minimal image).
if ! command -v script >/dev/null; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then as_root="sudo"; fi
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bsdutils
fi
# tests/viewer.rs drives Debian's Chromium (headless) with playwright-core from npm (tests/browser).
if ! command -v chromium >/dev/null || ! command -v npm >/dev/null; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then as_root="sudo"; fi
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium npm
fi
(cd tests/browser && npm ci --no-audit --no-fund --silent)
if ! ls .venv/lib/python3*/site-packages/rotel/rotel-agent >/dev/null 2>&1; then
  .venv/bin/pip install --quiet --disable-pip-version-check --pre rotel==0.0.1a15
fi

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked
if [ -f scripts/bench.sh ]; then
  scripts/bench.sh --smoke
fi
