// y = x W^T (+ bias), bfloat16, AVX512-BF16 vectors: the native GEMM of CPUs without AMX (AMD Zen 4/5, Cooper
// Lake), any number of rows (amx_gemm.c takes its place where the CPU has AMX).
//
// The weights are re-laid out once at load ("VNNI" pairs, the layout of amx_gemm.c) as [N / 16][K / 2][16][2]:
// one 64-byte load holds two consecutive k of 16 outputs, and one vdpbf16ps multiplies them by a broadcast
// (x[k], x[k + 1]) pair into 16 float32 accumulators, no horizontal sums. A register tile of up to
// MAX_TILE_ROWS rows of x times a pair of 16-output blocks keeps its 2 x rows accumulators in registers. Decode
// rows fit in one tile: the weights leave memory once, in the order they are stored. Prompt rows are taken in
// blocks of up to ROW_BLOCK, and every tile of a block runs over K_STEP values of k of the block pair while they
// sit in L1, so the weights leave memory once per block of rows rather than once per tile.
//
// Products of bfloat16 are exact in float32, summed in float32 (partial sums over K_STEP pieces wait in a
// float32 scratch, never rounded), then the bias is added and the sum rounded once to bfloat16 (to nearest
// even). The sums' order differs from oneDNN's, so outputs can differ from F.linear's by one bfloat16 ulp.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "bf16_simd.h"

// Accumulators: 8 x 2 of the 32 zmm registers (the rest hold the two weight vectors and broadcasts). 12 rows
// would fit the zmm registers too, but their 12 row pointers spill general registers: 6% slower on Zen 4.
#define MAX_TILE_ROWS 8
#define ROW_BLOCK (12 * MAX_TILE_ROWS)
#define K_STEP 256            // k values of a block pair per pass over a block's tiles: 16 KB of weights, in L1
#define PREFETCH_BYTES 2048   // how far ahead of the vdpbf16ps the weight streams are requested
// Tiles of fewer rows are memory-bound, and the hardware prefetcher keeps up with their two sequential streams:
// on Zen 4, software prefetches cost them 3-10% where they gain tiles of more rows 2-7% (cold weights).
#define PREFETCH_MIN_ROWS 5

int bf16_gemm_supported(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
// A pair (x[k], x[k + 1]) of one row, in every 32-bit lane (an unaligned, aliasing-safe load).
static inline __m512bh bf16_gemm_pair(const uint16_t *x) {
    return (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x));
}

// x[rows][depth] (row stride x_stride) times `depth` k of a block pair (w0, w1: [depth / 2][16][2] each) into
// outputs [rows][32]: started from the float32 partial sums in `partial` (row stride 32) when `resume`, else
// from 0; left in `partial` when not `last`, else plus bias[32] (when not NULL), rounded to bfloat16 and stored
// to out (row stride n). Inlined with `rows` a constant, so the accumulators are registers.
static inline __attribute__((always_inline)) void bf16_pair_tile(const uint16_t *x, int64_t x_stride,
                                                                const uint32_t *w0, const uint32_t *w1,
                                                                int64_t depth, float *partial, int resume,
                                                                int last, const uint16_t *bias, uint16_t *out,
                                                                int64_t n, const int rows) {
    __m512 acc0[MAX_TILE_ROWS], acc1[MAX_TILE_ROWS];
    for (int m = 0; m < rows; m++) {
        acc0[m] = resume ? _mm512_load_ps(partial + 32 * m) : _mm512_setzero_ps();
        acc1[m] = resume ? _mm512_load_ps(partial + 32 * m + 16) : _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < depth / 2; p++) {
        if (rows >= PREFETCH_MIN_ROWS) {
            _mm_prefetch((const char *)(w0 + p * 16) + PREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + p * 16) + PREFETCH_BYTES, _MM_HINT_T0);
        }
        const __m512bh wa = (__m512bh)_mm512_loadu_si512(w0 + p * 16);
        const __m512bh wb = (__m512bh)_mm512_loadu_si512(w1 + p * 16);
        for (int m = 0; m < rows; m++) {
            const __m512bh pair = bf16_gemm_pair(x + m * x_stride + 2 * p);
            acc0[m] = _mm512_dpbf16_ps(acc0[m], wa, pair);
            acc1[m] = _mm512_dpbf16_ps(acc1[m], wb, pair);
        }
    }
    if (!last) {
        for (int m = 0; m < rows; m++) {
            _mm512_store_ps(partial + 32 * m, acc0[m]);
            _mm512_store_ps(partial + 32 * m + 16, acc1[m]);
        }
        return;
    }
    const __m512 b0 = bias ? load_bf16(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_bf16(bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        store_bf16(out + m * n, round_bf16(_mm512_add_ps(acc0[m], b0)));
        store_bf16(out + m * n + 16, round_bf16(_mm512_add_ps(acc1[m], b1)));
    }
}

// One tile of `rows` (1 to MAX_TILE_ROWS) rows: a constant row count per call site.
static void bf16_pair_rows(const uint16_t *x, int64_t x_stride, const uint32_t *w0, const uint32_t *w1,
                           int64_t depth, float *partial, int resume, int last, const uint16_t *bias, uint16_t *out,
                           int64_t n, int rows) {
#define BF16_PAIR_TILE(ROWS) bf16_pair_tile(x, x_stride, w0, w1, depth, partial, resume, last, bias, out, n, ROWS)
    switch (rows) {
        case 8: BF16_PAIR_TILE(8); break;
        case 7: BF16_PAIR_TILE(7); break;
        case 6: BF16_PAIR_TILE(6); break;
        case 5: BF16_PAIR_TILE(5); break;
        case 4: BF16_PAIR_TILE(4); break;
        case 3: BF16_PAIR_TILE(3); break;
        case 2: BF16_PAIR_TILE(2); break;
        default: BF16_PAIR_TILE(1); break;
    }
#undef BF16_PAIR_TILE
}
#endif

#ifdef __AVX512BF16__
// Rows [first, stop) of x (at most ROW_BLOCK) times one block pair (w0, w1: [k / 2][16][2] each) into out's
// columns from `out` (row stride n; bias: the pair's 32 values or NULL). A block of rows runs over the pair
// K_STEP values of k at a time, which stay in L1 for every tile; a block of one tile (decode rows) takes all of k
// in one pass.
static void bf16_gemm_unit(const uint16_t *x, int64_t x_stride, const uint32_t *w0, const uint32_t *w1,
                           int64_t first, int64_t stop, const uint16_t *bias, uint16_t *out, int64_t n, int64_t k) {
    float partial[ROW_BLOCK * 32] __attribute__((aligned(64)));
    const int64_t step = stop - first <= MAX_TILE_ROWS ? k : K_STEP;
    for (int64_t k0 = 0; k0 < k; k0 += step) {
        const int64_t depth = k - k0 < step ? k - k0 : step;
        for (int64_t row = first; row < stop; row += MAX_TILE_ROWS) {
            const int count = stop - row < MAX_TILE_ROWS ? (int)(stop - row) : MAX_TILE_ROWS;
            bf16_pair_rows(x + row * x_stride + k0, x_stride, w0 + k0 / 2 * 16, w1 + k0 / 2 * 16, depth,
                           partial + (row - first) * 32, k0 > 0, k0 + depth == k, bias, out + row * n, n, count);
        }
    }
}
#endif

// x: [rows, k] with row stride x_stride (elements), k even; packed: the weights [n, k] re-laid out as above, n a
// multiple of 32; bias: [n] or NULL; out: [rows, n], contiguous. The (block of rows, block pair) units, block by
// block, are split into one contiguous range per thread of the enclosing parallel region; no barrier at the end:
// callers inside a region add one (decoder_stack_body.h's STACK_GEMM).
static void bf16_gemm_share(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                            uint16_t *out, int rows, int64_t n, int64_t k) {
#ifdef __AVX512BF16__
    // Blocks of equal whole tiles, at most ROW_BLOCK rows: a short last block would leave the threads that take
    // the other blocks' units the longer share (10% of a 256-row GEMM on 2 threads).
    const int64_t tiles = (rows + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
    const int64_t fewest_blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t block_rows = (tiles + fewest_blocks - 1) / fewest_blocks * MAX_TILE_ROWS;
    const int64_t pairs = n / 32, blocks = (rows + block_rows - 1) / block_rows, units = blocks * pairs;
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = units * thread / threads, end = units * (thread + 1) / threads;
    const int64_t block_words = k / 2 * 16;  // one block of 16 outputs, in uint32 pairs
    for (int64_t unit = begin; unit < end; unit++) {
        const int64_t block = unit / pairs, pair = unit % pairs;
        const int64_t first = block * block_rows, stop = first + block_rows < rows ? first + block_rows : rows;
        const uint32_t *w0 = (const uint32_t *)packed + 2 * pair * block_words;
        bf16_gemm_unit(x, x_stride, w0, w0 + block_words, first, stop, bias ? bias + pair * 32 : NULL,
                       out + pair * 32, n, k);
    }
#endif
}

void bf16_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
               int rows, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    bf16_gemm_share(x, x_stride, packed, bias, out, rows, n, k);
}
