// Causal attention for prompt chunks (several new tokens per sequence) read in place from the paged bfloat16
// KV cache, on AMX tiles: flash attention, with no gather, no padding and no mask tensor.
//
// Built at run time for one model shape (see ember/kernels/build.py): HEAD_DIM (a multiple of 32) and
// QUERIES_PER_KV (query heads sharing one KV head). Needs AMX-BF16 and AVX512-BF16 (amx_gemm.c asks Linux
// for the AMX state; NativeKernels only offers this kernel where that GEMM runs).
//
// Sequence s owns query rows [query_starts[s], query_starts[s + 1]): its last n new tokens, whose K and V
// are already in the cache; query j sits at position context_lens[s] - n + j and sees keys 0 to its own.
// One OpenMP task per (sequence, block of 16 queries, KV head or all of them), the blocks with the most keys
// first. A task walks its keys 32 at a time; per key block it re-lays K and V out as AMX B tiles (K transposed
// so that S = Q K^T comes out one query per row; V with consecutive keys interleaved), then for each query
// head of the KV head (several at once for short chunks): S on tiles, an online-softmax update per query row
// in AVX-512 (float32, masked beyond the row's own position), P rounded to bfloat16 (as PyTorch's CPU flash
// attention does) and P V on tiles, added into float32 accumulators rescaled by the softmax correction.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16_simd.h"
#include "paged_cache.h"

#define QUERY_BLOCK 16   // query rows of a task: one A tile's rows
#define KEY_BLOCK 32     // keys per step: one A tile's columns of P
#define HALVES (HEAD_DIM / 32)  // 32-dimension slices of a head: K-dimension tiles of Q K^T
#define CHUNKS (HEAD_DIM / 16)  // 16-dimension slices: output tiles of P V

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Tiles: 0 = Q's dimensions of one half; 2 = a K^T tile; 3, 4 = S for keys [0, 16) and [16, 32) of the
// block; 5 = P; 6 = a V tile; 7 = P V for one 16-dimension chunk (1 unused). All 16 rows x 64 bytes.
static void configure_prefill_tiles(void) {
    tile_config config = empty_tile_config();
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

// dst[r][c] = src[c][r] for a 16 x 16 matrix of 32-bit elements held in 16 vectors.
static inline void transpose16(__m512i *rows) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // rows[4a + b] now holds, per 128-bit lane L, the elements (row 4a..4a+3, column 4L + b).
    for (int i = 0; i < 8; i++) {
        const int a = i / 4 * 8 + i % 4;  // pairs (0,4) (1,5) (2,6) (3,7) (8,12) ... (11,15)
        t[a] = _mm512_shuffle_i32x4(rows[a], rows[a + 4], _MM_SHUFFLE(2, 0, 2, 0));
        t[a + 4] = _mm512_shuffle_i32x4(rows[a], rows[a + 4], _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < 8; i++) {
        const int a = i;  // pairs (i, i + 8)
        rows[i] = _mm512_shuffle_i32x4(t[a], t[a + 8], _MM_SHUFFLE(2, 0, 2, 0));
        rows[i + 8] = _mm512_shuffle_i32x4(t[a], t[a + 8], _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

// q: [rows, num_kv_heads * QUERIES_PER_KV, HEAD_DIM] with row stride q_row_stride (elements), rows the
// group's query rows; query_starts: [num_seqs + 1] (query_starts[0] = 0); context_lens: [num_seqs] (keys per
// sequence, its new tokens included); block_tables: [num_seqs, max_blocks]; out: [rows, heads * HEAD_DIM],
// contiguous. Shares the tasks among the threads of the enclosing parallel region (an orphaned `omp for`).
static void paged_prefill_attention_tasks(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                                          const int64_t *block_tables, int64_t max_blocks,
                                          const int64_t *query_starts, const int64_t *context_lens, uint16_t *out,
                                          int num_seqs, int num_kv_heads, int block_size, float scale) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    const int64_t token_stride = 2 * (int64_t)num_kv_heads * HEAD_DIM;
    const int64_t out_row = (int64_t)num_kv_heads * QUERIES_PER_KV * HEAD_DIM;
    // A task takes every KV head of its query block, reading whole cache rows (the hardware prefetchers
    // follow them better than a third of each), unless that leaves too few tasks to share among the threads.
    int64_t num_query_blocks = 0;
    for (int s = 0; s < num_seqs; s++)
        num_query_blocks += (query_starts[s + 1] - query_starts[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    const int heads_per_task = num_query_blocks >= 2 * omp_get_num_threads() ? num_kv_heads : 1;
    const int tasks_per_block = num_kv_heads / heads_per_task;
    int64_t *first_task = malloc(sizeof(int64_t) * (num_seqs + 1));  // per sequence, in task units
    first_task[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t blocks = (query_starts[s + 1] - query_starts[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
        first_task[s + 1] = first_task[s] + blocks * tasks_per_block;
    }
    const int64_t num_tasks = first_task[num_seqs];
    configure_prefill_tiles();
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t order = 0; order < num_tasks; order++) {
        // Sequences in order, each one's last query block (the most keys) first.
        int seq = 0;
        while (first_task[seq + 1] <= order) seq++;
        const int64_t local = order - first_task[seq];
        const int first_kv = (int)(local % tasks_per_block) * heads_per_task;
        const int64_t num_queries = query_starts[seq + 1] - query_starts[seq];
        const int64_t num_blocks = (num_queries + QUERY_BLOCK - 1) / QUERY_BLOCK;
        const int64_t block = num_blocks - 1 - local / tasks_per_block;
        const int64_t first_row = query_starts[seq] + block * QUERY_BLOCK;
        const int64_t rows_left = num_queries - block * QUERY_BLOCK;
        const int valid_rows = rows_left < QUERY_BLOCK ? (int)rows_left : QUERY_BLOCK;
        const int64_t context = context_lens[seq];
        const int64_t first_position = context - num_queries + block * QUERY_BLOCK;  // of the task's row 0
        const int64_t num_keys = first_position + valid_rows;  // the last row sees keys [0, num_keys)
        const int64_t *table = block_tables + seq * max_blocks;
        for (int kv = first_kv; kv < first_kv + heads_per_task; kv++) {

            // A pass fills one A tile with query rows: 16 positions of one query head, or, for short chunks (a
            // decode verifying draft tokens), the positions of several query heads at once, so that a key block's
            // tiles serve them all. Tile row t of a pass holds head pass * heads_per_pass + t / valid_rows at
            // position t % valid_rows.
            const int fit = QUERY_BLOCK / valid_rows;
            const int heads_per_pass = fit < QUERIES_PER_KV ? fit : QUERIES_PER_KV;
            const int num_passes = (QUERIES_PER_KV + heads_per_pass - 1) / heads_per_pass;
            int row_position[QUERY_BLOCK], row_head[QUERIES_PER_KV][QUERY_BLOCK];
            for (int t = 0; t < QUERY_BLOCK; t++) {
                row_position[t] = t % valid_rows;
                for (int pass = 0; pass < num_passes; pass++) {
                    const int head = pass * heads_per_pass + t / valid_rows;
                    row_head[pass][t] = t < heads_per_pass * valid_rows && head < QUERIES_PER_KV ? head : -1;
                }
            }

            uint16_t queries[QUERIES_PER_KV][QUERY_BLOCK][HEAD_DIM] __attribute__((aligned(64)));
            float acc[QUERIES_PER_KV][QUERY_BLOCK][HEAD_DIM] __attribute__((aligned(64)));
            float running_max[QUERIES_PER_KV][QUERY_BLOCK], running_sum[QUERIES_PER_KV][QUERY_BLOCK];
            uint16_t keys_t[2][HALVES][16][32] __attribute__((aligned(64)));  // B tiles: [key half][dims][keys x 2]
            uint16_t values[CHUNKS][16][32] __attribute__((aligned(64)));     // B tiles: [dims][key pairs][dims x 2]
            float scores[QUERY_BLOCK][KEY_BLOCK] __attribute__((aligned(64)));
            uint16_t probs[QUERY_BLOCK][KEY_BLOCK] __attribute__((aligned(64)));
            float chunk_out[QUERY_BLOCK][16] __attribute__((aligned(64)));
            float correction[QUERY_BLOCK];

            memset(queries, 0, sizeof(queries[0]) * num_passes);
            memset(acc, 0, sizeof(acc[0]) * num_passes);
            for (int pass = 0; pass < num_passes; pass++)
                for (int t = 0; t < QUERY_BLOCK; t++) {
                    running_max[pass][t] = -INFINITY;
                    running_sum[pass][t] = 0.0f;
                    const int head = row_head[pass][t];
                    if (head >= 0)
                        memcpy(queries[pass][t],
                               q + (first_row + row_position[t]) * q_row_stride +
                                   (kv * QUERIES_PER_KV + head) * HEAD_DIM,
                               sizeof(uint16_t) * HEAD_DIM);
                }

            for (int64_t key_start = 0; key_start < num_keys; key_start += KEY_BLOCK) {
                const int key_count = num_keys - key_start < KEY_BLOCK ? (int)(num_keys - key_start) : KEY_BLOCK;
                const uint16_t *rows[KEY_BLOCK], *next[KEY_BLOCK];
                cache_rows(cache, table, block_size, token_stride, key_start, key_count, rows);
                // The next key block's K and V lines are requested while this one is re-laid out, one key's worth
                // per key handled here, rather than all at once (which would stall on the line-fill buffers).
                const int64_t next_start = key_start + KEY_BLOCK;
                const int next_count = next_start >= num_keys               ? 0
                                       : num_keys - next_start < KEY_BLOCK ? (int)(num_keys - next_start)
                                                                           : KEY_BLOCK;
                cache_rows(cache, table, block_size, token_stride, next_start, next_count, next);
                // K^T tiles: row d of a tile = the d-th pair of dimensions of 16 keys (32-bit pairs, transposed).
                for (int sub = 0; sub < 2; sub++)
                    for (int h = 0; h < HALVES; h++) {
                        __m512i lines[16];
                        for (int i = 0; i < 16; i++) {
                            const int key = sub * 16 + i;
                            if (h == 0 && key < next_count) {
                                const char *line = (const char *)(next[key] + kv * HEAD_DIM);
                                for (int c = 0; c < HEAD_DIM * 2; c += 64) {
                                    _mm_prefetch(line + c, _MM_HINT_T0);
                                    _mm_prefetch(line + c + num_kv_heads * HEAD_DIM * 2, _MM_HINT_T0);
                                }
                            }
                            lines[i] = key < key_count ? _mm512_loadu_si512(rows[key] + kv * HEAD_DIM + h * 32)
                                                       : _mm512_setzero_si512();
                        }
                        transpose16(lines);
                        for (int d = 0; d < 16; d++) _mm512_store_si512(keys_t[sub][h][d], lines[d]);
                    }
                // V tiles: row p of chunk c = dims [16c, 16c + 16) of keys 2p and 2p + 1, interleaved.
                const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                                            8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
                for (int p = 0; p < KEY_BLOCK / 2; p++)
                    for (int c = 0; c < CHUNKS; c++) {
                        const int even = 2 * p, odd = 2 * p + 1;
                        const int64_t offset = (int64_t)(num_kv_heads + kv) * HEAD_DIM + c * 16;
                        const __m512i a = even < key_count ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                                                 (const __m256i *)(rows[even] + offset)))
                                                           : _mm512_setzero_si512();
                        const __m512i b = odd < key_count ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                                                (const __m256i *)(rows[odd] + offset)))
                                                          : _mm512_setzero_si512();
                        _mm512_store_si512(values[c][p], _mm512_permutex2var_epi16(a, interleave, b));
                    }

                for (int pass = 0; pass < num_passes; pass++) {
                    _tile_zero(3);
                    _tile_zero(4);
                    for (int h = 0; h < HALVES; h++) {
                        _tile_loadd(0, &queries[pass][0][h * 32], HEAD_DIM * 2);
                        _tile_loadd(2, keys_t[0][h], 64);
                        _tile_dpbf16ps(3, 0, 2);
                        _tile_loadd(2, keys_t[1][h], 64);
                        _tile_dpbf16ps(4, 0, 2);
                    }
                    _tile_stored(3, &scores[0][0], KEY_BLOCK * 4);
                    _tile_stored(4, &scores[0][16], KEY_BLOCK * 4);
                    for (int r = 0; r < QUERY_BLOCK; r++) {
                        // Row r sees keys up to its own position: lanes beyond it (and beyond the block) are masked.
                        const int64_t visible = first_position + row_position[r] + 1 - key_start;
                        if (row_head[pass][r] < 0 || visible <= 0) {
                            _mm512_store_si512(probs[r], _mm512_setzero_si512());
                            correction[r] = 1.0f;
                            continue;
                        }
                        const __mmask16 low = visible >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << visible) - 1);
                        const __mmask16 high = visible >= 32   ? (__mmask16)0xFFFF
                                               : visible <= 16 ? (__mmask16)0
                                                               : (__mmask16)((1u << (visible - 16)) - 1);
                        const __m512 s0 = _mm512_mul_ps(_mm512_load_ps(&scores[r][0]), _mm512_set1_ps(scale));
                        const __m512 s1 = _mm512_mul_ps(_mm512_load_ps(&scores[r][16]), _mm512_set1_ps(scale));
                        const __m512 lowest = _mm512_set1_ps(-INFINITY);
                        const float block_max = _mm512_reduce_max_ps(
                            _mm512_max_ps(_mm512_mask_mov_ps(lowest, low, s0), _mm512_mask_mov_ps(lowest, high, s1)));
                        const float new_max = block_max > running_max[pass][r] ? block_max : running_max[pass][r];
                        const __m512 p0 = _mm512_maskz_mov_ps(low, exp512(_mm512_sub_ps(s0, _mm512_set1_ps(new_max))));
                        const __m512 p1 = _mm512_maskz_mov_ps(high, exp512(_mm512_sub_ps(s1, _mm512_set1_ps(new_max))));
                        // The sum counts P as rounded to bfloat16, the values P V multiplies.
                        const __m512bh rounded = _mm512_cvtne2ps_pbh(p1, p0);
                        _mm512_store_si512(probs[r], (__m512i)rounded);
                        correction[r] = expf(running_max[pass][r] - new_max);
                        running_sum[pass][r] = running_sum[pass][r] * correction[r] +
                                            _mm512_reduce_add_ps(_mm512_add_ps(
                                                load_bf16(&probs[r][0]), load_bf16(&probs[r][16])));
                        running_max[pass][r] = new_max;
                    }
                    _tile_loadd(5, &probs[0][0], KEY_BLOCK * 2);
                    for (int c = 0; c < CHUNKS; c++) {
                        _tile_zero(7);
                        _tile_loadd(6, values[c], 64);
                        _tile_dpbf16ps(7, 5, 6);
                        _tile_stored(7, &chunk_out[0][0], 64);
                        for (int r = 0; r < QUERY_BLOCK; r++) {
                            if (row_head[pass][r] < 0) continue;
                            float *row = &acc[pass][r][c * 16];
                            _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(row), _mm512_set1_ps(correction[r]),
                                                                 _mm512_load_ps(chunk_out[r])));
                        }
                    }
                }
            }
            for (int pass = 0; pass < num_passes; pass++)
                for (int r = 0; r < QUERY_BLOCK; r++) {
                    const int head = row_head[pass][r];
                    if (head < 0) continue;
                    uint16_t *dst = out + (first_row + row_position[r]) * out_row +
                                    (int64_t)(kv * QUERIES_PER_KV + head) * HEAD_DIM;
                    const __m512 inverse = _mm512_set1_ps(1.0f / running_sum[pass][r]);
                    for (int c = 0; c < CHUNKS; c++)
                        store_bf16(dst + c * 16,
                                   round_bf16(_mm512_mul_ps(_mm512_load_ps(&acc[pass][r][c * 16]), inverse)));
                }
        }
    }
    _tile_release();
    free(first_task);
#endif
}

int paged_prefill_attention_supported(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
    return 1;
#else
    return 0;
#endif
}

void paged_prefill_attention(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                             const int64_t *block_tables, int64_t max_blocks, const int64_t *query_starts,
                             const int64_t *context_lens, uint16_t *out, int num_seqs, int num_kv_heads,
                             int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_prefill_attention_tasks(q, q_row_stride, cache, block_tables, max_blocks, query_starts, context_lens,
                                  out, num_seqs, num_kv_heads, block_size, scale);
}
