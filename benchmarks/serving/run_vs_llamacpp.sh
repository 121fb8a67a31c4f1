#!/usr/bin/env bash
# `ember serve` vs llama.cpp's own llama-server on the same GGUF file (SmolLM2-135M-Instruct Q4_1), back to
# back with the same client (docs/benchmarks.md, "Serving"): issue 3's shape (200-token prompts, 128 output
# tokens, greedy, ignore_eos), 16 requests at c=1 and 64 at c=8. llama-server runs 2 threads and one slot
# per request in flight (-np = the concurrency, restarted per point); then ember with its defaults, then
# ember with --quantization gguf (the file's Q4_1 blocks kept, as llama.cpp keeps them). Also llama-bench's
# own figures for the file (prompt processing of 200 tokens, generation of 128, no server).
# Both run without weight repacking (--no-repack): llama.cpp's AMX path, which repacks Q4_1 into its AMX
# buffer, dies of SIGILL (tilezero) on this VM, and x86 has no other repacking for Q4_1 or Q8_0.
#   benchmarks/serving/run_vs_llamacpp.sh OUTDIR
# Needs llama-server and llama-bench in /tmp/peers/llama.cpp-build/bin (or $LLAMACPP_BIN): docs/benchmarks.md,
# "llama.cpp's server", says how to build them.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_vs_llamacpp.sh OUTDIR}
mkdir -p "$out"
source benchmarks/serving/back_to_back.sh
llamacpp=${LLAMACPP_BIN:-/tmp/peers/llama.cpp-build/bin}
gguf=$(.venv/bin/python -c "from ember.loader.resolve import resolve_model; print(resolve_model('smollm2-135m-instruct'))")

start_llamacpp() {  # SLOTS: llama-server on port 8200 with room for SLOTS requests of 200 + 128 tokens
  "$llamacpp/llama-server" -m "$gguf" --alias smollm2-135m-instruct -t 2 -np "$1" -c $(($1 * 512)) --no-repack \
    --host 127.0.0.1 --port 8200 > "$out/llamacpp-np$1-serve.log" 2>&1 &
  server_pid=$!
  wait_for http://127.0.0.1:8200/health
}

run_points() {  # NAME URL
  bench_200 "$1" "$2" 1 16 400
  bench_200 "$1" "$2" 8 64 400
}

"$llamacpp/llama-bench" -m "$gguf" -t 2 -p 200 -n 128 --repack 0 > "$out/llama-bench.txt" 2>&1
start_llamacpp 1 && bench_200 llamacpp http://127.0.0.1:8200 1 16 400
stop_server
start_llamacpp 8 && bench_200 llamacpp http://127.0.0.1:8200 8 64 400
stop_server
start_ember ember && run_points ember http://127.0.0.1:8000
stop_server
start_ember ember-gguf --quantization gguf && run_points ember-gguf http://127.0.0.1:8000
stop_server
cat "$out/llama-bench.txt"
summarize
