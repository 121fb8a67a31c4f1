// y = x W^T (+ bias), bfloat16, AMX tiles: every Linear where the CPU has AMX (decode and prefill).
//
// A decode step's Linear layers are a pass over their weights: memory-bound. oneDNN's AMX GEMM, even on
// pre-packed weights, streams them well below the memory bandwidth for batches of 8-32 rows;
// at prefill sizes both are compute-bound, and in the engine this kernel is still the faster one.
// This kernel reads the weights once per block of rows (x's rows up to 768 KB), in the order they are
// stored (the same VNNI re-layout as bf16_gemm.c: [N / 16][K / 2][16][2], so one 16 x 64-byte B tile is 1 KB
// of contiguous memory), with x in groups of 32 rows (two A tiles of 16). Products of bfloat16 are exact in
// float32; the sums' order differs from oneDNN's, so outputs can differ from F.linear's by one bfloat16 ulp.
#define _GNU_SOURCE  // syscall()
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"
#include "bf16_simd.h"

// How far ahead of the B tiles being multiplied their stream is requested into L2 (bytes). Spread over the
// loop (one 1 KB tile's lines per tile used), so the requests overlap the tile arithmetic.
#define PREFETCH_BYTES 4096
#define GROUP_ROWS 32  // rows of x per pass: two A tiles
#define TILE_ROWS 16
#define TILE_K 32  // bfloat16 values in a 64-byte tile row
#define TILE_FLOATS (TILE_ROWS * 16)  // an output tile
// Prefill sizes (more than one group of rows), where a pair of weight blocks is reused by every group:
#define SPAN_STEPS 20  // most k-steps of a pair kept in L1 for the groups (20 x 2 KB = 40 KB of its 48 KB)
#define BLOCK_X_BYTES (768 * 1024)  // x's rows in one block, kept in L2 (2 MB) beside the weights' stream
#define MAX_BLOCK_GROUPS 16  // caps the split k's partial sums (4 KB per group) on the stack at 64 KB

// Linux hands out AMX state only to processes that ask for it (arch_prctl, Linux 5.16+).
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_gemm_supported(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Tiles: 0, 1 = x rows [0, 16) and [16, rows); 2, 3 = two blocks of 16 weight rows (outputs);
// 4, 5 = outputs of x's first row tile for the two blocks; 6, 7 = of its second.
static void configure_tiles(int rows) {
    tile_config config = empty_tile_config();
    const int first = rows < TILE_ROWS ? rows : TILE_ROWS, second = rows - first;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64;
    config.rows[0] = config.rows[4] = config.rows[5] = first;
    config.rows[2] = config.rows[3] = TILE_ROWS;  // 16 k-pairs
    if (second > 0) config.rows[1] = config.rows[6] = config.rows[7] = second;
    else config.colsb[1] = config.colsb[6] = config.colsb[7] = 0;  // unused tiles stay unconfigured
    _tile_loadconfig(&config);
}

// Add the bias and store `count` rows of two 16 x 16 float32 tiles spilled to `tiles` (outputs [col, col + 16)
// then [col + 16, col + 32)) as 32 bfloat16 each: one rounding instruction (to nearest even) per row.
static void store_rows(const float *tiles, int count, const uint16_t *bias, int64_t col, uint16_t *out, int64_t n) {
    const __m512 b0 = bias ? load_bf16(bias + col) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_bf16(bias + col + 16) : _mm512_setzero_ps();
    for (int m = 0; m < count; m++) {
        const __m512 low = _mm512_add_ps(_mm512_load_ps(tiles + 16 * m), b0);
        const __m512 high = _mm512_add_ps(_mm512_load_ps(tiles + TILE_ROWS * 16 + 16 * m), b1);
        const __m512bh row = _mm512_cvtne2ps_pbh(high, low);
        _mm512_storeu_si512(out + m * n + col, (__m512i)row);
    }
}

// One group of up to GROUP_ROWS rows of x times a pair of 16-output weight blocks (w0, then w1 = w0 + k * 16)
// over k in [k_begin, k_end), with the tiles configured for `rows` rows. The sums start at zero when k_begin is
// 0, else from `partial` (4 tiles of 16 x 16 float32: exact, so a split k gives the same outputs), and go to
// `partial` unless k_end is k: then to out. `prefetch`: the weights' first group requests them ahead (later
// groups find them in L1/L2: their requests would only take load slots).
static void gemm_group(const uint16_t *x, int64_t x_stride, const uint16_t *w0, const uint16_t *bias, uint16_t *out,
                       int rows, int64_t n, int64_t k, int64_t col, int64_t k_begin, int64_t k_end, float *partial,
                       int prefetch) {
    const int first = rows < TILE_ROWS ? rows : TILE_ROWS, second = rows - first;
    const uint16_t *w1 = w0 + k * 16, *x_second = x + TILE_ROWS * x_stride;
    const int64_t x_bytes = x_stride * 2;
    float tiles[2 * TILE_ROWS * 16] __attribute__((aligned(64)));
    if (k_begin == 0) {
        _tile_zero(4);
        _tile_zero(5);
        if (second > 0) {
            _tile_zero(6);
            _tile_zero(7);
        }
    } else {
        _tile_loadd(4, partial, 64);
        _tile_loadd(5, partial + TILE_FLOATS, 64);
        if (second > 0) {
            _tile_loadd(6, partial + 2 * TILE_FLOATS, 64);
            _tile_loadd(7, partial + 3 * TILE_FLOATS, 64);
        }
    }
    for (int64_t kk = k_begin; kk < k_end; kk += TILE_K) {
        if (prefetch)
            for (int line = 0; line < 1024; line += 64) {
                _mm_prefetch((const char *)(w0 + kk * 16) + PREFETCH_BYTES + line, _MM_HINT_T1);
                _mm_prefetch((const char *)(w1 + kk * 16) + PREFETCH_BYTES + line, _MM_HINT_T1);
            }
        // x's tiles as a stream (TILELOADDT1): they would otherwise evict the pair's weights from L1, which
        // every group of rows reuses (a gain at prefill sizes).
        _tile_stream_loadd(0, x + kk, x_bytes);
        _tile_loadd(2, w0 + kk * 16, 64);
        _tile_loadd(3, w1 + kk * 16, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (second > 0) {
            _tile_stream_loadd(1, x_second + kk, x_bytes);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    if (k_end < k) {
        _tile_stored(4, partial, 64);
        _tile_stored(5, partial + TILE_FLOATS, 64);
        if (second > 0) {
            _tile_stored(6, partial + 2 * TILE_FLOATS, 64);
            _tile_stored(7, partial + 3 * TILE_FLOATS, 64);
        }
        return;
    }
    _tile_stored(4, tiles, 64);
    _tile_stored(5, tiles + TILE_ROWS * 16, 64);
    store_rows(tiles, first, bias, col, out, n);
    if (second > 0) {
        _tile_stored(6, tiles, 64);
        _tile_stored(7, tiles + TILE_ROWS * 16, 64);
        store_rows(tiles, second, bias, col, out + TILE_ROWS * n, n);
    }
}
#endif

// x: [rows, k] with row stride x_stride (elements), rows > 0, k a multiple of TILE_K; packed: the weights
// [n, k] re-laid out as above, n a multiple of 32; bias: [n] or NULL; out: [rows, n].
// Each thread of the enclosing parallel region takes a range of output-block pairs and runs every group of
// GROUP_ROWS rows over a pair while its weights sit in L1/L2: with up to 32 rows (decode) the weights leave
// memory once, requested PREFETCH_BYTES ahead. With more, the rows go in blocks whose x stays in L2 (a block
// of rows per pass over the weights: x would otherwise come from memory once per pair), and a long k in spans
// of a pair's weights that stay in L1 while every group of the block uses them. A last partial group needs
// another tile configuration. No barrier at the end: callers inside a region add one (decoder_stack.c).
static void amx_gemm_share(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                           uint16_t *out, int rows, int64_t n, int64_t k) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int groups = (rows + GROUP_ROWS - 1) / GROUP_ROWS;
    const int64_t pairs = n / 32, thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = pairs * thread / threads, end = pairs * (thread + 1) / threads;
    const int64_t steps = k / TILE_K, spans = groups > 1 ? (steps + SPAN_STEPS - 1) / SPAN_STEPS : 1;
    const int64_t span = (steps + spans - 1) / spans * TILE_K;
    const int64_t fit = BLOCK_X_BYTES / (GROUP_ROWS * 2 * k);
    const int block_groups = fit < 1 ? 1 : fit > MAX_BLOCK_GROUPS ? MAX_BLOCK_GROUPS : (int)fit;
    float partial[MAX_BLOCK_GROUPS][4 * TILE_FLOATS] __attribute__((aligned(64)));  // a split k's sums, per group
    int configured = 0;  // the rows the tiles are configured for (the configuration is per thread)
    for (int block = 0; block < groups; block += block_groups)
        for (int64_t pair = begin; pair < end; pair++)
            for (int64_t k_begin = 0; k_begin < k; k_begin += span)
                for (int g = block; g < groups && g < block + block_groups; g++) {
                    const int group_rows = rows - g * GROUP_ROWS < GROUP_ROWS ? rows - g * GROUP_ROWS : GROUP_ROWS;
                    if (group_rows != configured) configure_tiles(configured = group_rows);
                    gemm_group(x + g * GROUP_ROWS * x_stride, x_stride, packed + pair * 32 * k, bias,
                               out + g * GROUP_ROWS * n, group_rows, n, k, pair * 32, k_begin,
                               k_begin + span < k ? k_begin + span : k, partial[g - block], g == block);
                }
    _tile_release();
#endif
}

void amx_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
              int rows, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    amx_gemm_share(x, x_stride, packed, bias, out, rows, n, k);
}
