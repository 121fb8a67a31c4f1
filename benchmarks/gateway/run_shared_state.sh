#!/usr/bin/env bash
# Gateway throughput with shared state vs embedded (docs/benchmarks.md, "Shared state"; docs/ha.md).
#   benchmarks/gateway/run_shared_state.sh [SECONDS_PER_RUN] [ROUNDS]
# Starts the stub upstream (port 9101), then per round one `ember gateway` (port 9100) with the
# limiter in process (fleet-limits.yaml) and one with it in Redis and keys/usage in PostgreSQL
# (fleet-shared.yaml), and drives each with wrk (small non-streamed chat completions, 32 connections).
# Needs wrk, and PostgreSQL and Redis on 127.0.0.1:5432 / :6379. Stops what it started.
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

run() {  # run CONFIG: the gateway's req/s on it
  "$bin/ember" gateway --config "$1" --port 9100 >/dev/null 2>&1 &
  local gateway_pid=$!
  pids+=("$gateway_pid")
  for _ in $(seq 1 120); do curl -sf -o /dev/null http://127.0.0.1:9100/health && break; sleep 0.5; done
  wrk -t1 -c32 -d"${seconds}s" -s "$here/post.lua" http://127.0.0.1:9100/v1/chat/completions | awk '/Requests\/sec/ {print $2}'
  kill "$gateway_pid"
  wait "$gateway_pid" 2>/dev/null || true
}
for round in $(seq 1 "$rounds"); do
  embedded=$(run "$here/fleet-limits.yaml")
  shared=$(run "$here/fleet-shared.yaml")
  echo "round $round: embedded limits $embedded req/s, shared (Redis) limits $shared req/s (load: $(cut -d' ' -f1 /proc/loadavg))"
done
