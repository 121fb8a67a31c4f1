#!/bin/bash
# Issue 3's c=32 and c=8 runs (200 in / 128 out, 64 requests) against vLLM and then ember, both driven by
# vLLM's own client, `vllm bench serve` from /tmp/peers/vllm (docs/benchmarks.md, "Serving"). Flags after
# OUTDIR go to both servers, e.g. --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}':
#   benchmarks/serving/run_with_vllm_client.sh OUTDIR [SERVER FLAGS...]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_with_vllm_client.sh OUTDIR [SERVER FLAGS...]}; shift; mkdir -p "$out"
wait_for() { for _ in $(seq 1 600); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done; return 1; }
bench() {  # NAME PORT
  for c in 32 8; do
    /tmp/peers/vllm/bin/vllm bench serve --backend vllm --base-url http://127.0.0.1:$2 --model smollm2-135m-instruct \
      --tokenizer /tmp/peers/smollm2-hf --dataset-name random --random-input-len 200 --random-output-len 128 \
      --num-prompts 64 --max-concurrency $c --ignore-eos --temperature 0 --seed $((500 + c)) --num-warmups 2 \
      --save-result --result-dir $out --result-filename $1-200-c$c.json > $out/$1-200-c$c.txt 2>&1
  done
}
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 \
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
  /tmp/peers/vllm/bin/vllm serve /tmp/peers/smollm2-hf --served-model-name smollm2-135m-instruct \
  --host 127.0.0.1 --port 8100 --dtype bfloat16 "$@" > $out/vllm_serve.log 2>&1 &
pid=$!
wait_for http://127.0.0.1:8100/v1/models && bench vllm 8100
kill $pid; wait $pid 2>/dev/null; sleep 5
.venv/bin/ember serve --host 127.0.0.1 --port 8000 "$@" > $out/ember_serve.log 2>&1 &
pid=$!
wait_for http://127.0.0.1:8000/ready && bench ember 8000
kill $pid; wait $pid 2>/dev/null
