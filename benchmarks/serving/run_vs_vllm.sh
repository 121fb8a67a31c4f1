#!/usr/bin/env bash
# `ember serve` vs vLLM's CPU build, back to back with the same client (docs/benchmarks.md, "Serving").
#   benchmarks/serving/run_vs_vllm.sh OUTDIR [--table-only]
# Needs vLLM in /tmp/peers/vllm and its HF folder in /tmp/peers/smollm2-hf (../shared/peers/README.md;
# the folder: benchmarks/serving/export_hf_folder.py). Runs issue 3's table (200-token prompts, c=32/8/1)
# and issue 4's sweep (256-token prompts, c=1..32, PNG; skipped with --table-only) against vLLM, stops it,
# then the same against ember.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_vs_vllm.sh OUTDIR [--table-only]}
table_only=${2:-}
mkdir -p "$out"
source benchmarks/serving/back_to_back.sh

run_all() {  # NAME URL
  local name=$1 url=$2
  bench_200 "$name" "$url" 32 64 100
  bench_200 "$name" "$url" 8 64 100
  bench_200 "$name" "$url" 1 16 100
  [[ $table_only == --table-only ]] && return
  "$ember" bench sweep --base-url "$url" "${bench_common[@]}" --input-len 256 --output-len 128 --num-prompts 32 \
    --concurrency 1,2,4,8,16,32 --seed 900 --json "$out/$name-sweep.json" --plot "$out/$name-sweep.png" \
    > "$out/$name-sweep.txt" 2>&1
}

start_vllm vllm bfloat16 && run_all vllm http://127.0.0.1:8100
stop_server
start_ember ember && run_all ember http://127.0.0.1:8000
stop_server
summarize
