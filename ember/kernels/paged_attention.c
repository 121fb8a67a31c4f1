// Decode and prompt-chunk attention read in place from the paged bfloat16 KV cache, AVX-512F (no AMX; the
// scores use AVX512-BF16 dot products where the build has them, else float32 FMAs of widened bf16 inputs;
// P V is float32 FMAs, like SDPA's).
//
// Built at run time for one model shape (see ember/kernels/build.py): HEAD_DIM (a multiple of 16) and
// QUERIES_PER_KV (query heads sharing one KV head) are compile-time constants, so the query and accumulator
// vectors of a KV head's query group stay in registers.
//
// One routine, attend_heads, answers one query token of one sequence for some of its KV heads over its first
// `keys` keys. Decode calls it once per sequence (per (sequence, KV head) when there are fewer sequences than
// threads) with every key; prompt chunks once per query row (per (row, KV head) when there are fewer rows than
// threads) with the keys up to the row's own position (causal). It streams the cache rows once, 16 tokens at a
// time: each token's row holds K then V of every KV head (layout of one layer: [num_blocks, block_size,
// 2 (K, V), num_kv_heads, HEAD_DIM]), so the reads are sequential within a block. Per tile: scores of every
// query head (fp32), an online-softmax update (flash-decoding), then the tile's V rows into fp32 accumulators;
// P stays float32. The gather + padded SDPA this replaces copies every key twice before reading it.
#include <math.h>
#include <omp.h>

#include "bf16_simd.h"
#include "paged_cache.h"

#define CHUNKS (HEAD_DIM / 16)
#define TILE 16
#ifndef AHEAD
#define AHEAD 16
#endif

// Lane i of the result = the sum of v[i]'s 16 lanes (a transpose-and-add tree: ~3 instructions per sum
// instead of ~8 for a horizontal reduction of each vector).
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit chunk: the chunk's partial sums of 4 consecutive vectors
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        halves[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __mmask16 tile_mask(int64_t valid) {
    return valid >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
}

// A row of HEAD_DIM bfloat16 values as float32 vectors without a widening shuffle: per 32 values (one 64-byte
// load), its even-indexed values (shifted into the high halves) and its odd-indexed ones (masked). The vectors
// hold the row in the order [evens 0..31, odds 0..31, evens 32..63, ...]; the kernel keeps its query and
// output accumulators in that order too and interleaves them back when it stores the output.
static inline void load_bf16_split(const uint16_t *p, __m512 *parts) {
    for (int c = 0; c < HEAD_DIM / 32; c++) {
        const __m512i raw = _mm512_loadu_si512(p + c * 32);
        parts[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        parts[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000)));
    }
}

// out = softmax(q k^T * scale) v for the query heads of KV heads [first_head, first_head + num_heads) of one
// query token, over keys [0, keys) of its sequence (block table `table`): q and out point at the first of those
// query heads (num_heads * QUERIES_PER_KV rows of HEAD_DIM, contiguous). Several KV heads in one call read
// whole cache rows, which the hardware prefetchers follow better than a part of each.
// Scores: with AVX512-BF16, q . k in vdpbf16ps straight from the cache's bfloat16 (products exact, pairs
// summed in float32), else float32 FMAs of the split rows; the scale multiplies each tile's scores once.
// P stays float32: the V rows are split as above and accumulated by FMAs in the split order.
static void attend_heads(const uint16_t *q, uint16_t *out, const uint16_t *cache, const int64_t *table,
                         int block_size, int num_kv_heads, int first_head, int num_heads, int64_t keys,
                         float scale) {
    const int64_t token_stride = 2 * (int64_t)num_kv_heads * HEAD_DIM;
    const int num_queries = num_heads * QUERIES_PER_KV;
    // Per query head: fp32 output accumulator (split order), running max and softmax sum.
    float acc[num_queries * HEAD_DIM] __attribute__((aligned(64)));
    float running_max[num_queries], running_sum[num_queries];
    for (int h = 0; h < num_queries; h++) {
        for (int c = 0; c < CHUNKS; c++) _mm512_store_ps(acc + h * HEAD_DIM + c * 16, _mm512_setzero_ps());
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    const __m512 scale_vector = _mm512_set1_ps(scale);

    for (int64_t start = 0; start < keys; start += TILE) {
        const int64_t valid = keys - start < TILE ? keys - start : TILE;
        const __mmask16 mask = tile_mask(valid);
        const uint16_t *rows[TILE];
        cache_rows(cache, table, block_size, token_stride, start, valid, rows);
        // The next tile's rows are scattered over blocks: the loop below requests them into L2 while it
        // computes this tile, one row's K and V of the head at hand per key. Spread like this, the
        // requests overlap the arithmetic; issued all at once (192 lines) they stalled the core until
        // the line-fill buffers drained, and the kernel ran slower. Without any, it waits on loads.
        const int64_t next_valid = keys - start - AHEAD < TILE ? keys - start - AHEAD : TILE;
        const uint16_t *next[TILE];
        if (next_valid > 0) cache_rows(cache, table, block_size, token_stride, start + AHEAD, next_valid, next);
        for (int kv = 0; kv < num_heads; kv++) {
            const int64_t key_offset = (int64_t)(first_head + kv) * HEAD_DIM;
            const int64_t value_offset = (int64_t)(num_kv_heads + first_head + kv) * HEAD_DIM;
            const uint16_t *group_q = q + kv * QUERIES_PER_KV * HEAD_DIM;
            float *group_acc = acc + kv * QUERIES_PER_KV * HEAD_DIM;
#ifdef __AVX512BF16__
            __m512bh qv[QUERIES_PER_KV][HEAD_DIM / 32];
            for (int g = 0; g < QUERIES_PER_KV; g++)
                for (int c = 0; c < HEAD_DIM / 32; c++)
                    qv[g][c] = (__m512bh)_mm512_loadu_si512(group_q + g * HEAD_DIM + c * 32);
#else
            __m512 qv[QUERIES_PER_KV][CHUNKS];
            for (int g = 0; g < QUERIES_PER_KV; g++) load_bf16_split(group_q + g * HEAD_DIM, qv[g]);
#endif
            __m512 dots[QUERIES_PER_KV][TILE];
            for (int i = 0; i < TILE; i++) {
                if (i >= valid) {
                    for (int g = 0; g < QUERIES_PER_KV; g++) dots[g][i] = _mm512_setzero_ps();
                    continue;
                }
                if (i < next_valid)
                    for (int c = 0; c < HEAD_DIM * 2; c += 64) {
                        _mm_prefetch((const char *)(next[i] + key_offset) + c, _MM_HINT_T1);
                        _mm_prefetch((const char *)(next[i] + value_offset) + c, _MM_HINT_T1);
                    }
#ifdef __AVX512BF16__
                __m512bh k[HEAD_DIM / 32];
                for (int c = 0; c < HEAD_DIM / 32; c++)
                    k[c] = (__m512bh)_mm512_loadu_si512(rows[i] + key_offset + c * 32);
                for (int g = 0; g < QUERIES_PER_KV; g++) {
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k[0]);
                    for (int c = 1; c < HEAD_DIM / 32; c++) dot = _mm512_dpbf16_ps(dot, qv[g][c], k[c]);
                    dots[g][i] = dot;
                }
#else
                __m512 k[CHUNKS];
                load_bf16_split(rows[i] + key_offset, k);
                for (int g = 0; g < QUERIES_PER_KV; g++) {
                    __m512 dot = _mm512_mul_ps(qv[g][0], k[0]);
                    for (int c = 1; c < CHUNKS; c++) dot = _mm512_fmadd_ps(qv[g][c], k[c], dot);
                    dots[g][i] = dot;
                }
#endif
            }
            // Online softmax: rescale what was accumulated when this tile raises a head's maximum.
            float probs[QUERIES_PER_KV][TILE] __attribute__((aligned(64)));
            __m512 group_out[QUERIES_PER_KV][CHUNKS];
            for (int g = 0; g < QUERIES_PER_KV; g++) {
                const int h = kv * QUERIES_PER_KV + g;
                const __m512 scores = _mm512_mul_ps(sum_lanes16(dots[g]), scale_vector);
                const float tile_max = _mm512_mask_reduce_max_ps(mask, scores);
                const float new_max = tile_max > running_max[h] ? tile_max : running_max[h];
                const float correction = expf(running_max[h] - new_max);
                const __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
                _mm512_store_ps(probs[g], p);
                running_sum[h] = running_sum[h] * correction + _mm512_reduce_add_ps(p);
                running_max[h] = new_max;
                for (int c = 0; c < CHUNKS; c++)
                    group_out[g][c] = _mm512_mul_ps(_mm512_load_ps(group_acc + g * HEAD_DIM + c * 16),
                                                    _mm512_set1_ps(correction));
            }
            for (int i = 0; i < valid; i++) {
                __m512 v[CHUNKS];
                load_bf16_split(rows[i] + value_offset, v);
                for (int g = 0; g < QUERIES_PER_KV; g++) {
                    const __m512 p = _mm512_set1_ps(probs[g][i]);
                    for (int c = 0; c < CHUNKS; c++) group_out[g][c] = _mm512_fmadd_ps(p, v[c], group_out[g][c]);
                }
            }
            for (int g = 0; g < QUERIES_PER_KV; g++)
                for (int c = 0; c < CHUNKS; c++) _mm512_store_ps(group_acc + g * HEAD_DIM + c * 16, group_out[g][c]);
        }
    }
    // Back from the split order: each 32-bit pair of the output is (even value, odd value), both rounded.
    for (int h = 0; h < num_queries; h++) {
        const __m512 inverse_sum = _mm512_set1_ps(1.0f / running_sum[h]);
        for (int c = 0; c < HEAD_DIM / 32; c++) {
            const __m512i even = _mm512_castps_si512(
                round_bf16(_mm512_mul_ps(_mm512_load_ps(acc + h * HEAD_DIM + 2 * c * 16), inverse_sum)));
            const __m512i odd = _mm512_castps_si512(
                round_bf16(_mm512_mul_ps(_mm512_load_ps(acc + h * HEAD_DIM + (2 * c + 1) * 16), inverse_sum)));
            _mm512_storeu_si512(out + h * HEAD_DIM + c * 32, _mm512_or_si512(_mm512_srli_epi32(even, 16), odd));
        }
    }
}

// q: [num_seqs, num_kv_heads * QUERIES_PER_KV, HEAD_DIM] with row stride q_row_stride (elements);
// block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] (keys each query attends, its own included);
// out: [num_seqs, num_kv_heads * QUERIES_PER_KV * HEAD_DIM], contiguous. Shares the tasks among the threads
// of the enclosing parallel region (decoder_stack.c calls it inside its own); paged_decode_attention opens one.
static void paged_decode_attention_tasks(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                                         const int64_t *block_tables, int64_t max_blocks,
                                         const int64_t *context_lens, uint16_t *out, int num_seqs,
                                         int num_kv_heads, int block_size, float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM;
    const int heads_per_task = num_seqs >= omp_get_num_threads() ? num_kv_heads : 1;
    const int tasks_per_seq = num_kv_heads / heads_per_task;
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < num_seqs * tasks_per_seq; task++) {
        const int seq = task / tasks_per_seq, first_head = (task % tasks_per_seq) * heads_per_task;
        attend_heads(q + seq * q_row_stride + first_head * group_width,
                     out + (seq * num_kv_heads + first_head) * group_width, cache, block_tables + seq * max_blocks,
                     block_size, num_kv_heads, first_head, heads_per_task, context_lens[seq], scale);
    }
}

void paged_decode_attention(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                            const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                            uint16_t *out, int num_seqs, int num_kv_heads, int block_size, float scale,
                            int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_decode_attention_tasks(q, q_row_stride, cache, block_tables, max_blocks, context_lens, out, num_seqs,
                                 num_kv_heads, block_size, scale);
}

// Prompt chunks without AMX (paged_prefill_attention.c's contract): sequence s's queries are rows
// [query_starts[s], query_starts[s + 1]) of q [T, heads, HEAD_DIM] (row stride q_row_stride), its last new
// tokens, already in the cache; context_lens[s] counts its keys, new ones included -> out [T, heads * HEAD_DIM],
// contiguous. Row by row: the query at position p attends keys [0, p]. Shares the tasks among the threads of the
// enclosing parallel region (an orphaned `omp for` without its barrier: callers inside a region add one).
static void paged_prefill_attention_avx512_tasks(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                                                 const int64_t *block_tables, int64_t max_blocks,
                                                 const int64_t *query_starts, const int64_t *context_lens,
                                                 uint16_t *out, int num_seqs, int num_kv_heads, int block_size,
                                                 float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM;
    const int64_t num_rows = query_starts[num_seqs];
    const int heads_per_task = num_rows >= omp_get_num_threads() ? num_kv_heads : 1;
    const int tasks_per_row = num_kv_heads / heads_per_task;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < num_rows * tasks_per_row; task++) {
        // Last rows first: they see the most keys, and the shorter tasks left at the end even out the threads.
        const int64_t row = num_rows - 1 - task / tasks_per_row;
        const int first_head = (int)(task % tasks_per_row) * heads_per_task;
        int seq = 0;
        while (query_starts[seq + 1] <= row) seq++;
        const int64_t keys = context_lens[seq] - (query_starts[seq + 1] - 1 - row);  // causal: up to its own
        attend_heads(q + row * q_row_stride + first_head * group_width,
                     out + (row * num_kv_heads + first_head) * group_width, cache, block_tables + seq * max_blocks,
                     block_size, num_kv_heads, first_head, heads_per_task, keys, scale);
    }
}

void paged_prefill_attention_avx512(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                                    const int64_t *block_tables, int64_t max_blocks, const int64_t *query_starts,
                                    const int64_t *context_lens, uint16_t *out, int num_seqs, int num_kv_heads,
                                    int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_prefill_attention_avx512_tasks(q, q_row_stride, cache, block_tables, max_blocks, query_starts,
                                         context_lens, out, num_seqs, num_kv_heads, block_size, scale);
}
