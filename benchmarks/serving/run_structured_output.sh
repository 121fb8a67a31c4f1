#!/usr/bin/env bash
# Structured-output throughput (issue 15; docs/benchmarks.md, "Structured output"): c=32, every request under
# a JSON schema vs unconstrained, back to back on one server, with the same client.
#   benchmarks/serving/run_structured_output.sh ember|vllm OUTDIR
# Starts the server (ember from this checkout; vLLM from /tmp/peers/vllm on /tmp/peers/smollm2-hf, see
# ../shared/peers/README.md), checks that one constrained answer parses, runs an unconstrained warm-up, then
# unconstrained, JSON, unconstrained, JSON (fresh prompts each run: no prefix-cache hits), and stops it.
# PYTHON: the interpreter with ember installed or on PYTHONPATH (default .venv/bin/python).
set -uo pipefail
cd "$(dirname "$0")/../.."
server=${1:?usage: run_structured_output.sh ember|vllm OUTDIR}
out=${2:?usage: run_structured_output.sh ember|vllm OUTDIR}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
# At least 40 strings of at most 12 characters: no request's grammar can end before its 64 tokens.
schema='{"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
 "minItems": 40}}, "required": ["items"]}'
json_body="{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"list\", \"schema\": $schema}}}"
common=(--model smollm2-135m-instruct --tokenizer smollm2-135m-instruct --temperature 0 --ignore-eos
        --disable-progress --num-warmups 2 --num-prompts 64 --max-concurrency 32 --input-len 64 --output-len 64)

wait_for() { for _ in $(seq 1 600); do curl -sf -o /dev/null "$1" && return 0; sleep 1; done; return 1; }

if [ "$server" = vllm ]; then
  port=8100
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    /tmp/peers/vllm/bin/vllm serve /tmp/peers/smollm2-hf --served-model-name smollm2-135m-instruct \
    --host 127.0.0.1 --port $port --dtype bfloat16 > "$out/server.log" 2>&1 &
  ready=/v1/models
else
  port=8000
  "$python" -m ember.cli serve --host 127.0.0.1 --port $port > "$out/server.log" 2>&1 &
  ready=/ready
fi
server_pid=$!
trap 'kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null' EXIT
wait_for "http://127.0.0.1:$port$ready" || { echo "$server did not start (see $out/server.log)"; exit 1; }

# The schema is enforced: a greedy answer of 64 tokens to a prompt that asks for no JSON opens the object.
curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"smollm2-135m-instruct\", \"prompt\": \"Tell me about the sea.\", \"max_tokens\": 64,
       \"temperature\": 0, ${json_body:1:-1}}" > "$out/check.json"
"$python" -c 'import json, re, sys; text = json.load(open(sys.argv[1]))["choices"][0]["text"]; print(repr(text));
assert re.sub(r"\s", "", text).startswith("{\"items\":[\""), "the answer does not follow the schema"' \
  "$out/check.json" || exit 1

run() {  # NAME SEED [EXTRA_BODY]
  uptime > "$out/$1.txt"
  "$python" -m ember.cli bench serve --base-url "http://127.0.0.1:$port" "${common[@]}" --seed "$2" \
    ${3:+--extra-body "$3"} --json "$out/$1.json" >> "$out/$1.txt" 2>&1
  uptime >> "$out/$1.txt"
}
run 0-warmup-unconstrained 10
run 1-unconstrained 11
run 2-json 12 "$json_body"
run 3-unconstrained 13
run 4-json 14 "$json_body"
for f in "$out"/[0-9]-*.txt; do
  echo "$(basename "$f" .txt): $(grep -h -E "Output token throughput" "$f" | tr -s ' ') |" \
    "$(grep -h -E "Mean TPOT" "$f" | tr -s ' ') | load $(grep -o 'load average.*' "$f" | tr '\n' ' ')"
done
