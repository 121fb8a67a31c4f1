#!/usr/bin/env bash
# `ember serve` vs vLLM's CPU build with both servers up and the client alternating between them, point by
# point: on a machine whose speed drifts (a VM whose neighbours come and go; docs/benchmarks.md, "Emerald
# Rapids"), each ratio then compares runs a minute apart, not two servers' whole tables.
#   benchmarks/serving/run_vs_vllm_interleaved.sh OUTDIR [ROUNDS]
# Issue 3's table (200-token prompts, 128 out, 64 requests at c=32 and c=8, 16 at c=1), ROUNDS times (default
# 2), vLLM first in each pair; fresh prompts per round, the same for both servers within it. Needs what
# run_vs_vllm.sh needs. The idle server waits on its sockets: check with `ps` that it takes no CPU.
# vLLM runs in its best dtype for this CPU: bfloat16 where the CPU has AVX512-BF16 or AMX, float32 elsewhere
# (emulated bfloat16 is about 2x slower there; ../shared/peers/README.md); VLLM_DTYPE overrides it.
# EMBER_FLAGS adds `ember serve` flags (e.g. EMBER_FLAGS="--kv-cache-dtype int8"); ember's defaults without it.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_vs_vllm_interleaved.sh OUTDIR [ROUNDS]}
rounds=${2:-2}
mkdir -p "$out"
source benchmarks/serving/back_to_back.sh

vllm_dtype=${VLLM_DTYPE:-$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bfloat16 || echo float32)}
echo "vLLM dtype: $vllm_dtype" | tee "$out/vllm-dtype.txt"
start_vllm vllm "$vllm_dtype" || exit 1
vllm_pid=$server_pid
# shellcheck disable=SC2086  # EMBER_FLAGS: several flags, split on spaces
start_ember ember ${EMBER_FLAGS:-} || { server_pid=$vllm_pid; stop_server; exit 1; }
ember_pid=$server_pid
for round in $(seq 1 "$rounds"); do
  for point in "32 64" "8 64" "1 16"; do
    read -r concurrency prompts <<< "$point"
    bench_200 "r$round-vllm" http://127.0.0.1:8100 "$concurrency" "$prompts" $((1000 * round))
    bench_200 "r$round-ember" http://127.0.0.1:8000 "$concurrency" "$prompts" $((1000 * round))
  done
done
server_pid=$ember_pid; stop_server
server_pid=$vllm_pid; stop_server

# Per round and concurrency: both servers' output tok/s and TTFT p50, and ember's ratios.
.venv/bin/python - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("round  c   vLLM tok/s  ember tok/s  ratio  vLLM TTFT p50  ember TTFT p50  TTFT ratio")
for r in range(1, rounds + 1):
    for c in (32, 8, 1):
        v, e = (json.load(open(f"{out}/r{r}-{name}-200-c{c}.json")) for name in ("vllm", "ember"))
        print(f"{r:5d} {c:2d} {v['output_throughput']:11.1f} {e['output_throughput']:12.1f} "
              f"{e['output_throughput'] / v['output_throughput']:5.2f}x {v['median_ttft_ms']:11.0f} ms "
              f"{e['median_ttft_ms']:11.0f} ms {e['median_ttft_ms'] / v['median_ttft_ms']:9.2f}x")
PY
