// The decoder stack (decoder_stack_body.h) in bfloat16 with quantized Linear weights: quant_gemm.c's GEMM
// (each layer weight a quant_linear descriptor: format, blocks, scales, mins and the shared activation scratch)
// and the bfloat16 fused ops and attention kernels, included unchanged, so results are bit-identical to the
// op-by-op quantized path (QuantGemm.linear on the same rows).
//
// For decode-sized steps only (rows up to the scratch's, GEMV_MAX_ROWS in quant_gemm.py): past them the
// op-by-op path multiplies dequantized weights with a float GEMM instead. Built with the HEAD_DIM and
// QUERIES_PER_KV of the attention kernels, for the level of decoder_stack.c (prompt chunks on AMX tiles or
// AVX-512 vectors, like the op-by-op path).
#include "quant_gemm.c"
#include "fused_ops.c"
#include "paged_attention.c"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "paged_prefill_attention.c"
#define STACK_PREFILL_ATTENTION paged_prefill_attention_tasks
#else
#define STACK_PREFILL_ATTENTION paged_prefill_attention_avx512_tasks
#endif

#define STACK_T uint16_t
#define STACK_NAME decoder_stack_quant
#define STACK_GEMM(x, x_stride, weight, bias, out, rows, n, k) \
    quant_gemm_share((const quant_linear *)(weight), x, 1, x_stride, bias, out, rows, n, k)
#define STACK_ADD_RMS_NORM add_rms_norm_rows
#define STACK_ROTARY_AND_CACHE rotary_and_cache_rows
#define STACK_DECODE_ATTENTION paged_decode_attention_tasks
#define STACK_SILU_AND_MUL silu_and_mul_rows
#include "decoder_stack_body.h"
