// The decoder stack (decoder_stack_body.h) in float32, on AVX-512 or AVX2 + FMA vectors: f32_gemm.c's GEMM and
// the float32 fused ops and attention kernels, the op-by-op path's own in-region forms, so results are
// bit-identical to it. For CPUs without native bfloat16 (where `--dtype auto` picks float32).
//
// Built with the HEAD_DIM and QUERIES_PER_KV of the attention kernels.
#include "f32_gemm.c"
#include "fused_ops_f32.c"
#include "paged_attention_f32.c"

#define STACK_T float
#define STACK_NAME decoder_stack_f32
#define STACK_GEMM f32_gemm_share
#define STACK_ADD_RMS_NORM add_rms_norm_f32_rows
#define STACK_ROTARY_AND_CACHE rotary_and_cache_f32_rows
#define STACK_DECODE_ATTENTION paged_decode_attention_f32_tasks
#define STACK_PREFILL_ATTENTION paged_prefill_attention_f32_tasks
#define STACK_SILU_AND_MUL silu_and_mul_f32_rows
#include "decoder_stack_body.h"
