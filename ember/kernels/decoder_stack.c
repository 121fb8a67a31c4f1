// The decoder stack (decoder_stack_body.h) in bfloat16: the GEMM and prompt-chunk attention of the ISA level it
// is built for (AMX tiles: amx_gemm.c and paged_prefill_attention.c; AVX512-BF16 without AMX: bf16_gemm.c and
// paged_attention.c's row-by-row prompt attention) and the bfloat16 fused ops and decode attention, included
// unchanged, so results are bit-identical to the op-by-op path.
//
// Built for the level of the GEMM that runs op by op (amx or avx512_bf16; NativeKernels picks it) with the
// HEAD_DIM and QUERIES_PER_KV of the attention kernels.
#include "fused_ops.c"
#include "paged_attention.c"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_gemm.c"
#define STACK_GEMM amx_gemm_share
#else
#include "bf16_gemm.c"
#define STACK_GEMM bf16_gemm_share
#endif
// The AMX prompt-chunk attention reads bfloat16 K/V only: an int8 cache's go through the vectors' kernel.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(KV_INT8)
#include "paged_prefill_attention.c"
#define STACK_PREFILL_ATTENTION paged_prefill_attention_tasks
#else
#define STACK_PREFILL_ATTENTION paged_prefill_attention_avx512_tasks
#endif

#define STACK_T uint16_t
#define STACK_NAME decoder_stack
#define STACK_ADD_RMS_NORM add_rms_norm_rows
#define STACK_ROTARY_AND_CACHE rotary_and_cache_rows
#define STACK_DECODE_ATTENTION paged_decode_attention_tasks
#define STACK_SILU_AND_MUL silu_and_mul_rows
#include "decoder_stack_body.h"
