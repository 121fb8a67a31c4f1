#!/usr/bin/env bash
# CPU time one server process spends per request under a wrk load: robust on a shared, loaded machine
# where wall-clock req/s swings with what else runs. Usage: cpu_per_request.sh PID URL [SECONDS] [CONNECTIONS]
set -euo pipefail
pid=$1 url=$2 seconds=${3:-5} connections=${4:-32}
here=$(dirname "$0")
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
before=$(cpu)
out=$(wrk -t1 -c"$connections" -d"${seconds}s" -s "$here/post.lua" "$url")
after=$(cpu)
requests=$(echo "$out" | awk '/requests in/ {print $1}')
rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
awk -v b="$before" -v a="$after" -v t="$ticks" -v n="$requests" -v r="$rps" -v e="${non2xx:-0}" 'BEGIN {
  us = (a - b) / t / n * 1e6
  printf "requests %d  wall req/s %.0f  non-2xx %d  cpu %.1f us/request  -> one free core: %.0f req/s\n", n, r, e, us, 1e6 / us
}'
