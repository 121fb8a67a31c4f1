#!/usr/bin/env bash
# Gateway overhead, measured back to back against direct access (docs/benchmarks.md, "Gateway overhead").
#   benchmarks/gateway/run_overhead.sh [SECONDS_PER_RUN] [ROUNDS]
# Starts the stub upstream (port 9101) and `ember gateway` in front of it (port 9100), then per round:
# wrk direct, wrk through the gateway (small non-streamed chat completions, 32 connections), the
# gateway's CPU time per request, and finally streamed TTFT direct vs gateway. Stops what it started.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-5}
rounds=${2:-3}
bin=.venv/bin
here=benchmarks/gateway
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

"$bin/python" "$here/stub_upstream.py" --port 9101 --tokens 16 --token-interval-ms 20 &
pids+=($!)
"$bin/ember" gateway --config "$here/fleet.yaml" --port 9100 &
gateway_pid=$!
pids+=("$gateway_pid")
for _ in $(seq 1 300); do
  curl -sf -o /dev/null http://127.0.0.1:9100/health && curl -sf -o /dev/null http://127.0.0.1:9101/health && break
  sleep 0.5
done

rps() { wrk -t1 -c32 -d"${seconds}s" -s "$here/post.lua" "$1" | awk '/Requests\/sec/ {print $2}'; }
for round in $(seq 1 "$rounds"); do
  direct=$(rps http://127.0.0.1:9101/v1/chat/completions)
  gateway=$(rps http://127.0.0.1:9100/v1/chat/completions)
  echo "round $round: direct $direct req/s, through the gateway $gateway req/s (load: $(cut -d' ' -f1 /proc/loadavg))"
done
echo -n "gateway CPU: "
"$here/cpu_per_request.sh" "$gateway_pid" http://127.0.0.1:9100/v1/chat/completions "$seconds"
"$bin/python" "$here/ttft.py" --direct http://127.0.0.1:9101 --gateway http://127.0.0.1:9100 -n 300
