#!/usr/bin/env bash
# Issue 14: single-stream decode (c=1) of SmolLM2 Q4_1 with --quantization none, gguf and int8, and the
# machine's read bandwidth, for docs/benchmarks.md. Run from the repository root, under the bench lock:
#   flock /work/notes/bench.lock benchmarks/engine/run_quantized_decode.sh OUT_DIR
# Each run is `ember bench offline --num-prompts 1 --max-num-seqs 1 --input-len 200 --output-len 128`;
# uptime is recorded before and after each.
set -euo pipefail
out=${1:?usage: run_quantized_decode.sh OUT_DIR}
python=${PYTHON:-/work/main/.venv/bin/python}
mkdir -p "$out"
export PYTHONPATH=$PWD
cc -O3 -march=native -fopenmp benchmarks/engine/read_bandwidth.c -o "$out/read_bandwidth"
{ echo "read_bandwidth before: $(uptime)"; OMP_NUM_THREADS=2 "$out/read_bandwidth"; } >> "$out/log.txt" 2>&1
for run in "none auto" "gguf auto" "int8 auto" "none float32" "gguf float32"; do
    set -- $run
    name="$1-$2"
    echo "$name before: $(uptime)" >> "$out/log.txt"
    timeout 600 "$python" -m ember.cli bench offline --num-prompts 1 --max-num-seqs 1 --input-len 200 \
        --output-len 128 --quantization "$1" --dtype "$2" --json "$out/$name.json" >> "$out/log.txt" 2>&1 \
        || echo "$name failed: $?" >> "$out/log.txt"
    echo "$name after: $(uptime)" >> "$out/log.txt"
done
{ echo "read_bandwidth after: $(uptime)"; OMP_NUM_THREADS=2 "$out/read_bandwidth"; } >> "$out/log.txt" 2>&1
