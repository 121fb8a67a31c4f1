// The decoder stack (decoder_stack_body.h) in float32 with quantized Linear weights: quant_gemm.c's GEMM on
// float32 activations and the float32 fused ops and attention kernels, included unchanged, so results are
// bit-identical to the op-by-op quantized float32 path (QuantGemm.linear on the same rows). For CPUs without
// native bfloat16 (where `--dtype auto` picks float32) running `--quantization gguf|int8`.
//
// For decode-sized steps only (rows up to GEMV_MAX_ROWS in quant_gemm.py: no float32 panels). Built
// with the HEAD_DIM and QUERIES_PER_KV of the attention kernels.
#include "quant_gemm.c"
#include "fused_ops_f32.c"
#include "paged_attention_f32.c"

#define STACK_T float
#define STACK_NAME decoder_stack_quant_f32
#define STACK_GEMM(x, x_stride, weight, bias, out, rows, n, k) \
    quant_gemm_share((const quant_linear *)(weight), x, 0, x_stride, bias, out, rows, n, k)
#define STACK_ADD_RMS_NORM add_rms_norm_f32_rows
#define STACK_ROTARY_AND_CACHE rotary_and_cache_f32_rows
#define STACK_DECODE_ATTENTION paged_decode_attention_f32_tasks
#define STACK_PREFILL_ATTENTION paged_prefill_attention_f32_tasks
#define STACK_SILU_AND_MUL silu_and_mul_f32_rows
#include "decoder_stack_body.h"
