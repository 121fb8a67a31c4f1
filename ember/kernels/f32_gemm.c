// y = x W^T (+ bias), float32, on AVX-512 or AVX2 + FMA vectors (f32_simd.h): the native GEMM of float32, for
// CPUs without native bfloat16 (Skylake-SP to Ice Lake, AVX2-only Intel and AMD Zen 2/3), any number of rows.
//
// The weights are re-laid out once at load into column panels, [n / PANEL][k][PANEL]: a panel's PANEL outputs
// for one k are one contiguous run, read as VECS vectors, so a panel is a single sequential stream. A register
// tile of up to MAX_TILE_ROWS rows of x times one panel keeps its rows x VECS accumulators in registers (one
// broadcast of x and VECS FMAs per row and k; no horizontal sums). Decode rows fit in one tile: the weights
// leave memory once, in the order they are stored, prefetched ahead. Prompt rows are taken ROW_BLOCK at a time,
// and every tile of a block runs over K_STEP rows of a panel while they sit in L1, so the weights leave memory
// once per block of rows rather than once per tile.
//
// Products and sums in float32 with one rounding per FMA, summed over k in order: results differ from
// oneDNN's only in the order of the sums.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "f32_simd.h"

#define PANEL 32                    // outputs per column panel (n must be a multiple)
#define VECS (PANEL / LANES)        // vectors per panel row: 2 on AVX-512, 4 on AVX2
// Accumulators: 8 x 2 of the 32 zmm registers, 3 x 4 of the 16 ymm ones (the rest hold weights and broadcasts).
#define MAX_TILE_ROWS (VECS == 2 ? 8 : 3)
#define ROW_BLOCK (12 * MAX_TILE_ROWS)
#define K_STEP 256                  // panel rows per pass over a block's tiles: 32 KB, within L1
#define PREFETCH_BYTES 2048

// out[rows][PANEL] (row stride n) = x[rows][k] (row stride x_stride) times one panel's k rows, plus the partial
// sums already in out when `accumulate`, plus bias[PANEL] when not NULL. Inlined with `rows` a constant, so the
// accumulators are registers. The panel stream is prefetched PREFETCH_BYTES ahead: with one row (a decode), a
// single sequential stream per thread, left to the hardware prefetcher, stays well below the memory bandwidth.
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride, const float *panel,
                                                            const float *bias, float *out, int64_t n, int64_t k,
                                                            int accumulate, const int rows) {
    vfloat acc[MAX_TILE_ROWS][VECS];
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < VECS; v++) acc[m][v] = accumulate ? vload(out + m * n + v * LANES) : vzero();
    for (int64_t kk = 0; kk < k; kk++) {
        _mm_prefetch((const char *)(panel + kk * PANEL) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(panel + kk * PANEL) + PREFETCH_BYTES + 64, _MM_HINT_T0);
        vfloat w[VECS];
        for (int v = 0; v < VECS; v++) w[v] = vload(panel + kk * PANEL + v * LANES);
        for (int m = 0; m < rows; m++) {
            const vfloat a = vset1(x[m * x_stride + kk]);
            for (int v = 0; v < VECS; v++) acc[m][v] = vfmadd(a, w[v], acc[m][v]);
        }
    }
    for (int v = 0; v < VECS; v++) {
        const vfloat b = bias ? vload(bias + v * LANES) : vzero();
        for (int m = 0; m < rows; m++) vstore(out + m * n + v * LANES, bias ? vadd(acc[m][v], b) : acc[m][v]);
    }
}

// One tile of `rows` (1 to MAX_TILE_ROWS) rows: a constant row count per call site.
static void panel_rows(const float *x, int64_t x_stride, const float *panel, const float *bias, float *out, int64_t n,
                       int64_t k, int accumulate, int rows) {
    switch (rows) {
#if LANES == 16
        case 8: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 8); break;
        case 7: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 7); break;
        case 6: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 6); break;
        case 5: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 5); break;
        case 4: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 4); break;
#endif
        case 3: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 3); break;
        case 2: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 2); break;
        default: panel_tile(x, x_stride, panel, bias, out, n, k, accumulate, 1); break;
    }
}

// x: [rows, k] with row stride x_stride (elements); packed: the weights [n, k] as [n / PANEL][k][PANEL], n a
// multiple of PANEL; bias: [n] or NULL; out: [rows, n], contiguous. The (block of rows, panel) pairs, block by
// block, are split into one contiguous range per thread of the enclosing parallel region; no barrier at the end:
// callers inside a region add one (decoder_stack_f32.c).
static void f32_gemm_share(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                           int rows, int64_t n, int64_t k) {
    const int64_t panels = n / PANEL, blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK, units = blocks * panels;
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = units * thread / threads, end = units * (thread + 1) / threads;
    for (int64_t unit = begin; unit < end; unit++) {
        const int64_t block = unit / panels, panel = unit % panels;
        const int64_t first = block * ROW_BLOCK, last = first + ROW_BLOCK < rows ? first + ROW_BLOCK : rows;
        const float *weights = packed + panel * k * PANEL;
        // A block of rows runs over the panel K_STEP rows of it at a time, which stay in L1 for every tile; each
        // output's sum still runs over k in order (the partial sums wait in out, exactly).
        for (int64_t k0 = 0; k0 < k; k0 += K_STEP) {
            const int64_t depth = k - k0 < K_STEP ? k - k0 : K_STEP;
            const float *tile_bias = bias && k0 + depth == k ? bias + panel * PANEL : NULL;
            for (int64_t row = first; row < last; row += MAX_TILE_ROWS) {
                const int count = last - row < MAX_TILE_ROWS ? (int)(last - row) : MAX_TILE_ROWS;
                panel_rows(x + row * x_stride + k0, x_stride, weights + k0 * PANEL, tile_bias,
                           out + row * n + panel * PANEL, n, depth, k0 > 0, count);
            }
        }
    }
}

void f32_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out, int rows,
              int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    f32_gemm_share(x, x_stride, packed, bias, out, rows, n, k);
}
