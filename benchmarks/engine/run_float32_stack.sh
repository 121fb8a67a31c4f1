#!/usr/bin/env bash
# Issue 14: the float32 path of a CPU without native bfloat16, emulated on this one, before and after a change
# (two checkouts), for docs/benchmarks.md. ember's kernels are forced to LEVEL (avx512: an Ice Lake; avx2: an
# AVX2-only CPU) and PyTorch's oneDNN is kept to that CPU's instructions with ONEDNN_MAX_CPU_ISA
# (AVX512_CORE_VNNI or AVX2), so that neither uses AMX or AVX512-BF16. Under the bench lock, one level at a time:
#   flock /work/notes/bench.lock benchmarks/engine/run_float32_stack.sh BEFORE_TREE AFTER_TREE LEVEL OUT_DIR
# Each run is `ember bench offline --dtype float32 --kernels LEVEL --num-threads 2 --input-len 200
# --output-len 128` at c=1 (1 prompt, 1 sequence) and c=32 (64 prompts, 32 sequences); uptime is recorded
# before and after each.
set -euo pipefail
before=${1:?usage: run_float32_stack.sh BEFORE_TREE AFTER_TREE LEVEL OUT_DIR}
after=${2:?} level=${3:?} out=${4:?}
python=${PYTHON:-/work/main/.venv/bin/python}
case "$level" in
    avx512) export ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI ;;
    avx2) export ONEDNN_MAX_CPU_ISA=AVX2 ;;
    *) echo "LEVEL must be avx512 or avx2" >&2; exit 2 ;;
esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$out"  # the runs write nothing into either checkout
for concurrency in "1 1" "64 32"; do  # prompts, sequences
    for tree in "before $before" "after $after"; do
        set -- $concurrency $tree
        name="$level-c$2-$3"
        echo "$name ($4, ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA) before: $(uptime)" >> log.txt
        PYTHONPATH=$4 timeout 600 "$python" -m ember.cli bench offline --dtype float32 --kernels "$level" \
            --num-threads 2 --num-prompts "$1" --max-num-seqs "$2" --input-len 200 --output-len 128 \
            --json "$name.json" >> log.txt 2>&1 || echo "$name failed: $?" >> log.txt
        echo "$name after: $(uptime)" >> log.txt
    done
done
