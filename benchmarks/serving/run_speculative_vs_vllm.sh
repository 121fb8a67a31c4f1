#!/usr/bin/env bash
# Issue 3's c=32 and c=8 points (200-token prompts, 128 out, greedy, ignore_eos) against four servers, back to
# back with the same client: vLLM and ember as they start, then both with the same speculative decoding
# (prompt lookup, 4 draft tokens). docs/benchmarks.md, "Serving" -> "Speculative decoding".
#   benchmarks/serving/run_speculative_vs_vllm.sh OUTDIR
# Needs vLLM in /tmp/peers/vllm and its HF folder in /tmp/peers/smollm2-hf (see run_vs_vllm.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_speculative_vs_vllm.sh OUTDIR}
mkdir -p "$out"
ember=.venv/bin/ember
spec='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
common=(--model smollm2-135m-instruct --tokenizer smollm2-135m-instruct --temperature 0 --ignore-eos
        --disable-progress --num-warmups 2 --input-len 200 --output-len 128 --num-prompts 64)

run_points() {  # NAME URL
  for c in 32 8; do
    "$ember" bench serve --base-url "$2" "${common[@]}" --max-concurrency "$c" --seed $((300 + c)) \
      --json "$out/$1-c$c.json" > "$out/$1-c$c.txt" 2>&1
  done
}

wait_for() { for _ in $(seq 1 600); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done; return 1; }

vllm() {  # NAME [vllm serve flags...]
  local name=$1; shift
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    /tmp/peers/vllm/bin/vllm serve /tmp/peers/smollm2-hf --served-model-name smollm2-135m-instruct \
    --host 127.0.0.1 --port 8100 --dtype bfloat16 "$@" > "$out/$name-serve.log" 2>&1 &
  local pid=$!
  wait_for http://127.0.0.1:8100/v1/models && run_points "$name" http://127.0.0.1:8100
  kill "$pid"; wait "$pid" 2>/dev/null; sleep 5
}

ember_serve() {  # NAME [ember serve flags...]
  local name=$1; shift
  "$ember" serve --host 127.0.0.1 --port 8000 "$@" > "$out/$name-serve.log" 2>&1 &
  local pid=$!
  wait_for http://127.0.0.1:8000/ready && run_points "$name" http://127.0.0.1:8000
  kill "$pid"; wait "$pid" 2>/dev/null; sleep 2
}

vllm vllm
ember_serve ember
vllm vllm-ngram --speculative-config "$spec"
ember_serve ember-ngram --speculative-config "$spec"
grep -H -E "Output token throughput|Median TTFT" "$out"/*-c*.txt
