// y = x W^T (+ bias) for a few rows of x (decode batches), bfloat16, AVX512-BF16: the native GEMM of CPUs
// without AMX (amx_gemm.c takes its place where the CPU has AMX, and is faster there from 1 row).
//
// With a handful of rows a Linear is a pass over its weights: memory-bound, and oneDNN's blocked GEMM
// streams them well below the memory bandwidth. This kernel reads the weights once, in the order they are stored, with the
// rows of x held in registers: the weights are re-laid out at load time ("VNNI" pairs) as
// [N / 16][K / 2][16][2], so one 64-byte load holds two consecutive k of 16 outputs and one vdpbf16ps
// multiplies them by a broadcast (x[k], x[k + 1]) pair into 16 float32 accumulators. No horizontal sums.
// Products of bfloat16 are exact in float32; the sums' order differs from oneDNN's, so outputs can differ
// from F.linear's by one bfloat16 ulp.
#include <immintrin.h>
#include <stdint.h>

#include "bf16_simd.h"

// Past 4 rows the vdpbf16ps work outgrows the weight stream and oneDNN wins (docs/benchmarks.md).
#define MAX_ROWS 4

int small_gemm_supported(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
// Two blocks of 16 outputs at a time for ROWS rows of x: 2 * ROWS accumulators stay in registers.
#define DEFINE_BLOCK_PAIR(ROWS)                                                                              \
    static void block_pair_##ROWS(const uint16_t *x, int64_t x_stride, const uint32_t *w0, const uint32_t *w1, \
                                  int64_t k_pairs, __m512 acc[MAX_ROWS][2]) {                                  \
        __m512 a0[ROWS], a1[ROWS];                                                                           \
        for (int m = 0; m < ROWS; m++) a0[m] = a1[m] = _mm512_setzero_ps();                                  \
        for (int64_t p = 0; p < k_pairs; p++) {                                                              \
            const __m512bh wa = (__m512bh)_mm512_loadu_si512(w0 + p * 16);                                   \
            const __m512bh wb = (__m512bh)_mm512_loadu_si512(w1 + p * 16);                                   \
            for (int m = 0; m < ROWS; m++) {                                                                 \
                const __m512bh pair = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + m * x_stride + 2 * p)); \
                a0[m] = _mm512_dpbf16_ps(a0[m], pair, wa);                                                   \
                a1[m] = _mm512_dpbf16_ps(a1[m], pair, wb);                                                   \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < ROWS; m++) {                                                                     \
            acc[m][0] = a0[m];                                                                               \
            acc[m][1] = a1[m];                                                                               \
        }                                                                                                    \
    }
DEFINE_BLOCK_PAIR(1)
DEFINE_BLOCK_PAIR(2)
DEFINE_BLOCK_PAIR(3)
DEFINE_BLOCK_PAIR(4)

typedef void (*block_pair_fn)(const uint16_t *, int64_t, const uint32_t *, const uint32_t *, int64_t,
                              __m512[MAX_ROWS][2]);
static const block_pair_fn BLOCK_PAIRS[MAX_ROWS + 1] = {
    0, block_pair_1, block_pair_2, block_pair_3, block_pair_4,
};
#endif

// x: [rows, k] with row stride x_stride (elements), rows <= MAX_ROWS, k even; packed: the weights
// [n, k] re-laid out as above, n a multiple of 32; bias: [n] or NULL; out: [rows, n], contiguous.
void small_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                int rows, int64_t n, int64_t k, int num_threads) {
#ifdef __AVX512BF16__
    const int64_t k_pairs = k / 2, block_words = k_pairs * 16;  // one block of 16 outputs, in uint32 pairs
    const uint32_t *w = (const uint32_t *)packed;
    const block_pair_fn block_pair = BLOCK_PAIRS[rows];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t pair = 0; pair < n / 32; pair++) {
        __m512 acc[MAX_ROWS][2];
        block_pair(x, x_stride, w + 2 * pair * block_words, w + (2 * pair + 1) * block_words, k_pairs, acc);
        for (int half = 0; half < 2; half++) {
            const int64_t col = (2 * pair + half) * 16;
            const __m512 b = bias ? load_bf16(bias + col) : _mm512_setzero_ps();
            for (int m = 0; m < rows; m++) store_bf16(out + m * n + col, round_bf16(_mm512_add_ps(acc[m][half], b)));
        }
    }
#endif
}
