#!/usr/bin/env bash
# `ember serve` vs vLLM's CPU build, back to back with the same client (docs/benchmarks.md, "Serving").
#   benchmarks/serving/run_vs_vllm.sh OUTDIR
# Needs vLLM in /tmp/peers/vllm and its HF folder in /tmp/peers/smollm2-hf (../shared/peers/README.md;
# the folder: benchmarks/serving/export_hf_folder.py). Runs issue 3's table (200-token prompts, c=32/8/1)
# and issue 4's sweep (256-token prompts, c=1..32, PNG) against vLLM, stops it, then the same against ember.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_vs_vllm.sh OUTDIR}
mkdir -p "$out"
ember=.venv/bin/ember
common=(--model smollm2-135m-instruct --tokenizer smollm2-135m-instruct --temperature 0 --ignore-eos
        --disable-progress --num-warmups 2)

run_all() {  # NAME URL
  local name=$1 url=$2
  for point in "32 64" "8 64" "1 16"; do
    set -- $point
    "$ember" bench serve --base-url "$url" "${common[@]}" --input-len 200 --output-len 128 --num-prompts "$2" \
      --max-concurrency "$1" --seed $((100 + $1)) --json "$out/$name-200-c$1.json" > "$out/$name-200-c$1.txt" 2>&1
  done
  "$ember" bench sweep --base-url "$url" "${common[@]}" --input-len 256 --output-len 128 --num-prompts 32 \
    --concurrency 1,2,4,8,16,32 --seed 900 --json "$out/$name-sweep.json" --plot "$out/$name-sweep.png" \
    > "$out/$name-sweep.txt" 2>&1
}

wait_for() { for _ in $(seq 1 600); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done; return 1; }

VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 \
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
  /tmp/peers/vllm/bin/vllm serve /tmp/peers/smollm2-hf --served-model-name smollm2-135m-instruct \
  --host 127.0.0.1 --port 8100 --dtype bfloat16 > "$out/vllm_serve.log" 2>&1 &
vllm_pid=$!
wait_for http://127.0.0.1:8100/v1/models && run_all vllm http://127.0.0.1:8100
kill "$vllm_pid"; wait "$vllm_pid" 2>/dev/null; sleep 5

"$ember" serve --host 127.0.0.1 --port 8000 > "$out/ember_serve.log" 2>&1 &
ember_pid=$!
wait_for http://127.0.0.1:8000/ready && run_all ember http://127.0.0.1:8000
kill "$ember_pid"; wait "$ember_pid" 2>/dev/null
grep -h -E "Output token throughput|Median TTFT|Median TPOT" "$out"/*-200-c*.txt
