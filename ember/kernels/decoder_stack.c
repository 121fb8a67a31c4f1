// The decoder stack (decoder_stack_body.h) in bfloat16 on AMX: amx_gemm.c's GEMM and the bfloat16 fused ops
// and attention kernels, included unchanged, so results are bit-identical to the op-by-op path.
//
// Built with the HEAD_DIM and QUERIES_PER_KV of the attention kernels; needs AMX (amx_gemm.c).
#include "amx_gemm.c"
#include "fused_ops.c"
#include "paged_attention.c"
#include "paged_prefill_attention.c"

#define STACK_T uint16_t
#define STACK_NAME decoder_stack
#define STACK_GEMM amx_gemm_share
#define STACK_ADD_RMS_NORM add_rms_norm_rows
#define STACK_ROTARY_AND_CACHE rotary_and_cache_rows
#define STACK_DECODE_ATTENTION paged_decode_attention_tasks
#define STACK_PREFILL_ATTENTION paged_prefill_attention_tasks
#define STACK_SILU_AND_MUL silu_and_mul_rows
#include "decoder_stack_body.h"
