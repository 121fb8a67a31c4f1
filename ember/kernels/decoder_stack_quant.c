// The decoder stack (decoder_stack_body.h) in bfloat16 with quantized Linear weights: quant_gemm.c's GEMV for
// decode-sized steps (as many rows as each quant_linear descriptor's activation scratch holds) and
// quant_panel_gemm.c's dequantized panels on the bfloat16 GEMM's tiles past them, with the bfloat16 fused ops
// and attention kernels, included unchanged, so results are bit-identical to the op-by-op quantized path
// (QuantGemm.linear on the same rows). Built with the HEAD_DIM and QUERIES_PER_KV of the attention kernels, for
// the level of decoder_stack.c (prompt chunks on AMX tiles or AVX-512 vectors, like the op-by-op path).
#include "quant_panel_gemm.c"
#include "fused_ops.c"
#include "paged_attention.c"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(KV_INT8)  // AMX's reads bfloat16 K/V only
#include "paged_prefill_attention.c"
#define STACK_PREFILL_ATTENTION paged_prefill_attention_tasks
#else
#define STACK_PREFILL_ATTENTION paged_prefill_attention_avx512_tasks
#endif

#define STACK_T uint16_t
#define STACK_NAME decoder_stack_quant
#define STACK_GEMM(x, x_stride, weight, bias, out, rows, n, k) \
    quant_linear_share((const quant_linear *)(weight), x, x_stride, bias, out, rows, n, k)
#define STACK_ADD_RMS_NORM add_rms_norm_rows
#define STACK_ROTARY_AND_CACHE rotary_and_cache_rows
#define STACK_DECODE_ATTENTION paged_decode_attention_tasks
#define STACK_SILU_AND_MUL silu_and_mul_rows
#include "decoder_stack_body.h"
