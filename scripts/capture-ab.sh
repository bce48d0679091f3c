#!/usr/bin/env bash
# Capture-on throughput of two llmtap builds beside nginx, in alternated rounds (prints figures, asserts nothing).
#   scripts/capture-ab.sh OLD_DIR NEW_DIR [ROUNDS=8] [SECS=2]
# Each *_DIR holds an `llmtap` and an `llmtap-bench` (copy target/release/ of each build there). One upstream
# (`llmtap-bench upstream`), one OTLP receiver, nginx (Debian's package) as the reference hop and both llmtaps
# with capture, store and OTLP export on run at once; every round saturates nginx, OLD and NEW in turn
# (`llmtap-bench saturate`, 32 connections), and after an llmtap's round the next waits until it has caught up
# (nothing left in its queue or spill), so no round carries another's background work. On a noisy machine a
# single round says little: compare the medians and the per-round ratios to the nginx round beside them.
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2") rounds=${3:-8} secs=${4:-2}
work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
addr_of() { for _ in $(seq 100); do a=$(grep -o '127\.0\.0\.1:[0-9]*' "$1" 2>/dev/null | head -1) && [ -n "$a" ] && { echo "$a"; return; }; sleep 0.05; done; echo "no address in $1" >&2; exit 1; }

"$new/llmtap-bench" upstream > upstream.out & pids+=($!)
"$new/llmtap-bench" receiver > receiver.out & pids+=($!)
upstream=$(addr_of upstream.out) receiver=$(addr_of receiver.out)
declare -A addr
for build in old new; do
  dir=$([ $build = old ] && echo "$old" || echo "$new")
  mkdir -p $build
  cat > $build/llmtap.toml <<EOF
[capture]
enabled = true
[api]
listen = "off"
[viewer]
listen = "off"
[upstreams.bench]
url = "http://$upstream"
api = "openai"
[[export.otlp]]
name = "bench"
endpoint = "http://$receiver"
protocol = "grpc"
EOF
  RUST_LOG=error "$dir/llmtap" serve --listen 127.0.0.1:0 --config $build/llmtap.toml --data-dir $build > $build/out 2> $build/err &
  pids+=($!)
  addr[$build]=$(addr_of $build/out)
done
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p nginx/tmp
cat > nginx/nginx.conf <<EOF
worker_processes 2; error_log $work/nginx/error.log error; pid $work/nginx/nginx.pid;
events { worker_connections 8192; }
http {
  access_log off; client_body_temp_path $work/nginx/tmp; proxy_temp_path $work/nginx/tmp;
  fastcgi_temp_path $work/nginx/tmp; uwsgi_temp_path $work/nginx/tmp; scgi_temp_path $work/nginx/tmp;
  upstream up { server $upstream; keepalive 256; }
  server {
    listen 127.0.0.1:$port backlog=4096; client_max_body_size 64m;
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; proxy_request_buffering off; }
  }
}
EOF
/usr/sbin/nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" -g 'daemon off;' & pids+=($!)
sleep 1

metric() { curl -s "http://$1/metrics" | awk -v n="$2" '$1 == n { print $2 }'; }
caught_up() {
  local previous=-1
  for _ in $(seq 3000); do
    local processed; processed=$(metric "$1" llmtap_processed_total)
    if [ "$processed" = "$previous" ] && [ "$(metric "$1" llmtap_capture_spill_bytes)" = 0 ] &&
      [ "$(metric "$1" llmtap_capture_queue_bytes)" = 0 ]; then return; fi
    previous=$processed
    sleep 0.1
  done
}
declare -A url=([nginx]="http://127.0.0.1:$port/v1/chat/completions"
  [old]="http://${addr[old]}/bench/v1/chat/completions" [new]="http://${addr[new]}/bench/v1/chat/completions")
for _ in $(seq "$rounds"); do
  for target in nginx old new; do
    echo "$target $("$new/llmtap-bench" saturate "${url[$target]}" "$secs" 32 | awk '{ print $2 }')"
    [ $target = nginx ] || caught_up "${addr[$target]}"
  done
done > rates.txt
python3 - <<'EOF'
import statistics
rates = {}
for line in open("rates.txt"):
    target, rate = line.split()
    rate = rate.removesuffix("/s")
    rates.setdefault(target, []).append(float(rate[:-1]) * 1000 if rate.endswith("k") else float(rate))
nginx = statistics.median(rates["nginx"])
for target in ("nginx", "old", "new"):
    r = rates[target]
    print(f"{target:<6} median {statistics.median(r) / 1000:6.1f}k req/s ({statistics.median(r) / nginx:.2f}x nginx)"
          f"  rounds: {' '.join(f'{x / 1000:.1f}' for x in r)}")
for target in ("old", "new"):
    ratios = [a / b for a, b in zip(rates[target], rates["nginx"])]
    print(f"{target}: median ratio to the nginx round beside it {statistics.median(ratios):.2f}")
EOF
for build in old new; do
  echo "$build: dropped $(metric "${addr[$build]}" llmtap_capture_dropped_total)," \
    "pipeline waited for the data path $(metric "${addr[$build]}" llmtap_pipeline_deferred_milliseconds_total) ms"
done
