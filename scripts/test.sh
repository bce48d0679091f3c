#!/usr/bin/env bash
# The one test command: installs what the tests need, then checks formatting and lints, runs every test, and the
# benchmark in its smoke configuration. Installs (each only when missing):
# - a Python virtualenv (.venv) with the official provider SDKs, the OpenAI Agents SDK, google-genai and rotel
#   (a real OpenTelemetry collector, for tests/scale_out.rs), exactly as locked with hashes in
#   tests/sdk/requirements.txt (its input and how to regenerate it: tests/sdk/requirements.in);
# - from Debian: nginx (tests/scale_out.rs), Chromium (tests/viewer.rs), script(1) (tests/cost_live.rs runs
#   `llmtap tail` on a pseudo-terminal), PostgreSQL (a real server per test process, tests/common/postgres.rs),
#   Node.js and npm;
# - from npm, exactly as locked: the agent clients in tests/clients (Claude Code, the Vercel AI SDK) and
#   playwright-core in tests/browser.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages, installed together in one apt run when any is missing (sudo when not root; CI runs as root).
missing=()
command -v npm >/dev/null || missing+=(nodejs npm)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v script >/dev/null || missing+=(bsdutils)
command -v chromium >/dev/null || missing+=(chromium)
command -v initdb >/dev/null || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then as_root="sudo"; fi
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check --require-hashes -r tests/sdk/requirements.txt

for dir in tests/clients tests/browser; do
  if [ ! -f "$dir/node_modules/.package-lock.json" ] || [ "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
    npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error
  fi
done

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked --no-fail-fast
if [ -f scripts/bench.sh ]; then
  scripts/bench.sh --smoke
fi
