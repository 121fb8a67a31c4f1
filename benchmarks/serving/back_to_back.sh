# Shared by the scripts that measure ember against a peer server back to back with the same client,
# `ember bench serve` (docs/benchmarks.md, "Serving"). Sourced, not run: the caller has cd'ed to the
# repository root and set $out, the folder the servers' logs and the clients' reports go to.
# One server runs at a time: start_* sets $server_pid, stop_server ends it before the next starts.

ember=.venv/bin/ember
bench_common=(--model smollm2-135m-instruct --tokenizer smollm2-135m-instruct --temperature 0 --ignore-eos
              --disable-progress --num-warmups 2)

wait_for() { for _ in $(seq 1 600); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done; return 1; }

bench_200() {  # NAME URL CONCURRENCY NUM_PROMPTS SEED_BASE: one point of issue 3's shape (200 in, 128 out)
  "$ember" bench serve --base-url "$2" "${bench_common[@]}" --input-len 200 --output-len 128 --num-prompts "$4" \
    --max-concurrency "$3" --seed $(($5 + $3)) --json "$out/$1-200-c$3.json" > "$out/$1-200-c$3.txt" 2>&1
}

start_vllm() {  # NAME DTYPE [vllm serve flags...]: vLLM's CPU build from /tmp/peers/vllm on port 8100
  local name=$1 dtype=$2; shift 2
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    /tmp/peers/vllm/bin/vllm serve /tmp/peers/smollm2-hf --served-model-name smollm2-135m-instruct \
    --host 127.0.0.1 --port 8100 --dtype "$dtype" "$@" > "$out/$name-serve.log" 2>&1 &
  server_pid=$!
  wait_for http://127.0.0.1:8100/v1/models
}

start_ember() {  # NAME [ember serve flags...]: on port 8000
  local name=$1; shift
  "$ember" serve --host 127.0.0.1 --port 8000 "$@" > "$out/$name-serve.log" 2>&1 &
  server_pid=$!
  wait_for http://127.0.0.1:8000/ready
}

stop_server() {  # and give the cores a moment to go quiet before the next server
  kill "$server_pid"; wait "$server_pid" 2>/dev/null; sleep 5
}

summarize() {  # the figures the comparisons are read from, one block per report
  grep -H -E "Total generated tokens|Output token throughput|Median TTFT|Median TPOT" "$out"/*-200-c*.txt
}
