#!/usr/bin/env bash
# The issue's Ice Lake table (../shared/peers/README.md: vLLM float32 at c=8 and c=32) emulated on this
# CPU: ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI makes PyTorch's oneDNN use neither AMX nor AVX512-BF16, as on
# an Ice Lake, and ember's native kernels are held to the avx512 level. Both servers run float32, one
# after the other, driven by the same client: issue 3's shape, 64 requests at c=8 and at c=32.
#   benchmarks/serving/run_icelake_proxy.sh OUTDIR
# Needs vLLM in /tmp/peers/vllm and its HF folder in /tmp/peers/smollm2-hf (see run_vs_vllm.sh).
# An emulation, not an Ice Lake: memory bandwidth, caches and core clocks stay this machine's.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_icelake_proxy.sh OUTDIR}
mkdir -p "$out"
source benchmarks/serving/back_to_back.sh
export ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI

run_points() {  # NAME URL
  bench_200 "$1" "$2" 8 64 700
  bench_200 "$1" "$2" 32 64 700
}

start_vllm vllm-f32 float32 && run_points vllm-f32 http://127.0.0.1:8100
stop_server
start_ember ember-f32-avx512 --dtype float32 --kernels avx512 && run_points ember-f32-avx512 http://127.0.0.1:8000
stop_server
summarize
