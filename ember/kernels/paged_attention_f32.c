// Decode and prompt-chunk attention for float32, read in place from the paged float32 KV cache
// ([blocks, block_size, 2 (K, V), num_kv_heads, HEAD_DIM] per layer), on AVX-512 or AVX2 + FMA vectors
// (f32_simd.h). HEAD_DIM (a multiple of 16) and QUERIES_PER_KV are compile-time constants (build.py).
//
// One task per (query token, KV head): the token's QUERIES_PER_KV query heads stream their keys once, TILE
// keys at a time, with an online softmax (flash-decoding; the tile's exponentials by f32_simd.h's vexp, as
// the bfloat16 kernel's, not a libm call per key), then the tile's V rows into float32 accumulators.
// A prompt chunk's query at position p attends keys [0, p] (causal); a decode query all of its sequence's.
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "f32_simd.h"

#define CHUNKS (HEAD_DIM / LANES)
#define TILE 16

// out[QUERIES_PER_KV][HEAD_DIM] = softmax(q k^T * scale) v over the first `keys` keys of one sequence's
// `kv_head`; q: the group's QUERIES_PER_KV rows of HEAD_DIM, contiguous.
static void attend_group(const float *q, float *out, const float *cache, const int64_t *table, int block_size,
                         int num_kv_heads, int kv_head, int64_t keys, float scale) {
    const int64_t token_stride = 2 * (int64_t)num_kv_heads * HEAD_DIM;
    const int64_t key_offset = (int64_t)kv_head * HEAD_DIM, value_offset = (int64_t)(num_kv_heads + kv_head) * HEAD_DIM;
    vfloat query[QUERIES_PER_KV][CHUNKS], acc[QUERIES_PER_KV][CHUNKS];
    float running_max[QUERIES_PER_KV], running_sum[QUERIES_PER_KV];
    for (int g = 0; g < QUERIES_PER_KV; g++) {
        for (int c = 0; c < CHUNKS; c++) {
            query[g][c] = vmul(vload(q + g * HEAD_DIM + c * LANES), vset1(scale));
            acc[g][c] = vzero();
        }
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    for (int64_t start = 0; start < keys; start += TILE) {
        const int valid = keys - start < TILE ? (int)(keys - start) : TILE;
        const float *rows[TILE];
        float scores[QUERIES_PER_KV][TILE];
        for (int i = 0; i < valid; i++) {
            const int64_t position = start + i;
            rows[i] = cache + (table[position / block_size] * block_size + position % block_size) * token_stride;
            for (int g = 0; g < QUERIES_PER_KV; g++) {
                vfloat dot = vmul(query[g][0], vload(rows[i] + key_offset));
                for (int c = 1; c < CHUNKS; c++) dot = vfmadd(query[g][c], vload(rows[i] + key_offset + c * LANES), dot);
                scores[g][i] = vsum(dot);
            }
        }
        for (int g = 0; g < QUERIES_PER_KV; g++) {
            float new_max = running_max[g];
            for (int i = 0; i < valid; i++) new_max = scores[g][i] > new_max ? scores[g][i] : new_max;
            const float correction = expf(running_max[g] - new_max);
            running_sum[g] *= correction;
            for (int i = valid; i < TILE; i++) scores[g][i] = -INFINITY;  // a short tile's unused lanes
            for (int i = 0; i < TILE; i += LANES)
                vstore(scores[g] + i, vexp(vadd(vload(scores[g] + i), vset1(-new_max))));
            for (int i = 0; i < valid; i++) running_sum[g] += scores[g][i];
            running_max[g] = new_max;
            for (int c = 0; c < CHUNKS; c++) acc[g][c] = vmul(acc[g][c], vset1(correction));
        }
        for (int i = 0; i < valid; i++)
            for (int c = 0; c < CHUNKS; c++) {
                const vfloat v = vload(rows[i] + value_offset + c * LANES);
                for (int g = 0; g < QUERIES_PER_KV; g++) acc[g][c] = vfmadd(vset1(scores[g][i]), v, acc[g][c]);
            }
    }
    for (int g = 0; g < QUERIES_PER_KV; g++)
        for (int c = 0; c < CHUNKS; c++)
            vstore(out + g * HEAD_DIM + c * LANES, vmul(acc[g][c], vset1(1.0f / running_sum[g])));
}

// q [num_seqs, heads, HEAD_DIM] (row stride q_row_stride); block_tables [num_seqs, max_blocks]; context_lens
// [num_seqs] (keys each query attends, its own included) -> out [num_seqs, heads * HEAD_DIM]. Shares the tasks
// among the threads of the enclosing parallel region (an orphaned `omp for`, ending with its barrier;
// decoder_stack_f32.c calls it inside its own); paged_decode_attention_f32 opens one.
static void paged_decode_attention_f32_tasks(const float *q, int64_t q_row_stride, const float *cache,
                                             const int64_t *block_tables, int64_t max_blocks,
                                             const int64_t *context_lens, float *out, int num_seqs,
                                             int num_kv_heads, int block_size, float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)num_seqs * num_kv_heads; task++) {
        const int64_t seq = task / num_kv_heads;
        const int kv_head = (int)(task % num_kv_heads);
        attend_group(q + seq * q_row_stride + kv_head * group_width,
                     out + seq * num_kv_heads * group_width + kv_head * group_width, cache,
                     block_tables + seq * max_blocks, block_size, num_kv_heads, kv_head, context_lens[seq], scale);
    }
}

void paged_decode_attention_f32(const float *q, int64_t q_row_stride, const float *cache,
                                const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                                float *out, int num_seqs, int num_kv_heads, int block_size, float scale,
                                int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_decode_attention_f32_tasks(q, q_row_stride, cache, block_tables, max_blocks, context_lens, out, num_seqs,
                                     num_kv_heads, block_size, scale);
}

// Prompt chunks: sequence s's queries are rows [query_starts[s], query_starts[s + 1]) of q [T, heads, HEAD_DIM],
// its last new tokens, already in the cache; context_lens[s] counts its keys, new ones included
// -> out [T, heads * HEAD_DIM]. Shares the tasks among the threads of the enclosing parallel region (an orphaned
// `omp for` without its barrier: callers inside a region add one).
static void paged_prefill_attention_f32_tasks(const float *q, int64_t q_row_stride, const float *cache,
                                              const int64_t *block_tables, int64_t max_blocks,
                                              const int64_t *query_starts, const int64_t *context_lens, float *out,
                                              int num_seqs, int num_kv_heads, int block_size, float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM;
    const int64_t num_rows = query_starts[num_seqs];
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < num_rows * num_kv_heads; task++) {
        const int64_t row = task / num_kv_heads;
        const int kv_head = (int)(task % num_kv_heads);
        int seq = 0;
        while (query_starts[seq + 1] <= row) seq++;
        const int64_t keys = context_lens[seq] - (query_starts[seq + 1] - 1 - row);  // causal: up to its own
        attend_group(q + row * q_row_stride + kv_head * group_width,
                     out + row * num_kv_heads * group_width + kv_head * group_width, cache,
                     block_tables + seq * max_blocks, block_size, num_kv_heads, kv_head, keys, scale);
    }
}

void paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const float *cache,
                                 const int64_t *block_tables, int64_t max_blocks, const int64_t *query_starts,
                                 const int64_t *context_lens, float *out, int num_seqs, int num_kv_heads,
                                 int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_prefill_attention_f32_tasks(q, q_row_stride, cache, block_tables, max_blocks, query_starts, context_lens,
                                      out, num_seqs, num_kv_heads, block_size, scale);
}
