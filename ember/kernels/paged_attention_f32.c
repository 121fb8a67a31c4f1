// Decode and prompt-chunk attention for float32, read in place from the paged float32 KV cache
// ([blocks, block_size, 2 (K, V), num_kv_heads, HEAD_DIM] per layer), on AVX-512 or AVX2 + FMA vectors
// (f32_simd.h). HEAD_DIM (a multiple of 16) and QUERIES_PER_KV are compile-time constants (build.py).
//
// One task per query token and KV head, or per query token and all its KV heads where there are tokens enough
// for every thread (task_heads): each KV head's QUERIES_PER_KV query heads stream their keys once, TILE keys at a
// time, with an online softmax (flash-decoding; the tile's exponentials by f32_simd.h's vexp, as
// the bfloat16 kernel's, not a libm call per key), then the tile's V rows into float32 accumulators.
// A prompt chunk's query at position p attends keys [0, p] (causal); a decode query all of its sequence's.
//
// Built with -DKV_INT8, the same kernels read an int8 cache (kv_cache.h): K and V rows widened to float32 as
// they are loaded, each key's scale applied to its score and each value's to its softmax weight.
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "f32_simd.h"
#define PAGED_CACHE_VALUE float
#include "paged_cache.h"

#ifdef KV_INT8
#define TOKEN_STRIDE(num_kv_heads) kv_int8_row_bytes(num_kv_heads, HEAD_DIM)
// LANES int8 values of a cache row as float32.
static inline vfloat load_cached(const int8_t *p) {
#ifdef __AVX512F__
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}
#else
#define TOKEN_STRIDE(num_kv_heads) (2 * (int64_t)(num_kv_heads) * HEAD_DIM)
static inline vfloat load_cached(const float *p) { return vload(p); }
#endif

#define CHUNKS (HEAD_DIM / LANES)
#define TILE 16
// Keys scored together, their dot products' lanes summed by one vsum8.
#define KEYS 8
// Chunks of HEAD_DIM whose V sums a pass over the tile's keys keeps in registers: as many independent
// accumulator chains as AVX2's 16 registers hold beside the V row and the scores (AVX-512's 32 hold all).
#define V_CHUNKS (LANES == 16 ? CHUNKS : 2)

// Heads of one sequence a task attends at most, tile by tile together (their K and V share the cache's rows).
#define MAX_TASK_HEADS 8

// One KV head's online softmax: its QUERIES_PER_KV queries (scaled), V sums, running max and sum.
typedef struct {
    vfloat query[QUERIES_PER_KV][CHUNKS], acc[QUERIES_PER_KV][CHUNKS];
    float running_max[QUERIES_PER_KV], running_sum[QUERIES_PER_KV];
} head_state;

static void head_start(head_state *h, const float *q, float scale) {
    for (int g = 0; g < QUERIES_PER_KV; g++) {
        for (int c = 0; c < CHUNKS; c++) {
            h->query[g][c] = vmul(vload(q + g * HEAD_DIM + c * LANES), vset1(scale));
            h->acc[g][c] = vzero();
        }
        h->running_max[g] = -INFINITY;
        h->running_sum[g] = 0.0f;
    }
}

// One tile of keys for one KV head: rows[i] is key i's row of the cache, `valid` of them real (the rest repeat
// the last), its K at key_offset and V at value_offset elements; an int8 cache's scales of this head's keys and
// values are key_scales and value_scales (NULL otherwise). Each query head scores the tile's keys KEYS at a
// time (independent chains, one reduction); the V sums go through the tile V_CHUNKS chunks of HEAD_DIM at a
// time, so that neither loop holds more vectors than there are registers. The first pass over the V rows
// requests the next tile's rows of this head (`next`: next_valid of them, none past the last tile) into L1,
// one key's K and V per key, spread over the arithmetic (without: 2x slower in the bfloat16 kernel).
static void head_tile(head_state *h, const cache_element *const rows[TILE], int valid,
                      const cache_element *const next[TILE], int next_valid, int64_t key_offset,
                      int64_t value_offset, const float *key_scales, const float *value_scales) {
    float scores[QUERIES_PER_KV][TILE], correction[QUERIES_PER_KV + LANES - 1];
    for (int g = 0; g < QUERIES_PER_KV; g++)
        for (int i0 = 0; i0 < valid; i0 += KEYS) {
            vfloat dot[KEYS];
            for (int j = 0; j < KEYS; j++) dot[j] = vmul(h->query[g][0], load_cached(rows[i0 + j] + key_offset));
            for (int c = 1; c < CHUNKS; c++)
                for (int j = 0; j < KEYS; j++)
                    dot[j] = vfmadd(h->query[g][c], load_cached(rows[i0 + j] + key_offset + c * LANES), dot[j]);
            vsum8(dot, scores[g] + i0);
        }
#ifdef KV_INT8
    for (int g = 0; g < QUERIES_PER_KV; g++)
        for (int i = 0; i < valid; i++) scores[g][i] *= key_scales[i];
#else
    (void)key_scales;
#endif
    // Each head's new maximum, KEYS scores a vector, lanes past `valid` as -inf: max_ps(s, m) is s > m ? s : m,
    // so NaN scores are passed over, as a scalar loop's comparisons would.
    float new_max[QUERIES_PER_KV];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int g = 0; g < QUERIES_PER_KV; g++) {
        __m256 m = _mm256_set1_ps(h->running_max[g]);
        for (int i0 = 0; i0 < valid; i0 += KEYS) {
            const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - i0), lane));
            m = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(scores[g] + i0), real), m);
        }
        new_max[g] = max8(m);
    }
    // The heads' rescaling factors in vector exps, not a libm expf call each (docs/benchmarks.md). The first
    // tile's exp(-inf) comes out as exp(-87) from the clamp: it scales zeros.
    for (int g0 = 0; g0 < QUERIES_PER_KV; g0 += LANES) {
        float shift[LANES] = {0};
        for (int g = g0; g < QUERIES_PER_KV && g < g0 + LANES; g++) shift[g - g0] = h->running_max[g] - new_max[g];
        vstore(correction + g0, vexp(vload(shift)));
    }
    for (int g = 0; g < QUERIES_PER_KV; g++) {
        h->running_sum[g] *= correction[g];
        for (int i = valid; i < TILE; i++) scores[g][i] = -INFINITY;  // a short tile's unused lanes
        for (int i = 0; i < TILE; i += LANES)
            vstore(scores[g] + i, vexp(vadd(vload(scores[g] + i), vset1(-new_max[g]))));
        for (int i = 0; i < valid; i++) h->running_sum[g] += scores[g][i];
        h->running_max[g] = new_max[g];
    }
    // The softmax weights of the V rows: an int8 cache's carry each value's scale.
#ifdef KV_INT8
    float weights[QUERIES_PER_KV][TILE];
    for (int g = 0; g < QUERIES_PER_KV; g++)
        for (int i = 0; i < valid; i++) weights[g][i] = scores[g][i] * value_scales[i];
#else
    (void)value_scales;
    float (*weights)[TILE] = scores;
#endif
    for (int c0 = 0; c0 < CHUNKS; c0 += V_CHUNKS) {
        vfloat sums[QUERIES_PER_KV][V_CHUNKS];
        for (int g = 0; g < QUERIES_PER_KV; g++)
            for (int c = 0; c < V_CHUNKS; c++) sums[g][c] = vmul(h->acc[g][c0 + c], vset1(correction[g]));
        for (int i = 0; i < valid; i++) {
            if (c0 == 0 && i < next_valid) {
                for (int line = 0; line < HEAD_DIM * (int)sizeof(cache_element); line += 64) {
                    _mm_prefetch((const char *)(next[i] + key_offset) + line, _MM_HINT_T0);
                    _mm_prefetch((const char *)(next[i] + value_offset) + line, _MM_HINT_T0);
                }
            }
            for (int c = 0; c < V_CHUNKS; c++) {
                const vfloat v = load_cached(rows[i] + value_offset + (c0 + c) * LANES);
                for (int g = 0; g < QUERIES_PER_KV; g++) sums[g][c] = vfmadd(vset1(weights[g][i]), v, sums[g][c]);
            }
        }
        for (int g = 0; g < QUERIES_PER_KV; g++)
            for (int c = 0; c < V_CHUNKS; c++) h->acc[g][c0 + c] = sums[g][c];
    }
}

// out[head][QUERIES_PER_KV][HEAD_DIM] = softmax(q k^T * scale) v over the first `keys` keys of one sequence, for
// its KV heads [first_head, first_head + heads) (heads <= MAX_TASK_HEADS); q and out: those heads' query rows,
// contiguous. The heads go through each tile together, so that the cache's rows are read whole, in order.
static void attend_heads(const float *q, float *out, const cache_element *cache, const int64_t *table,
                         int block_size, int num_kv_heads, int first_head, int heads, int64_t keys, float scale) {
    const int64_t token_stride = TOKEN_STRIDE(num_kv_heads), group_width = QUERIES_PER_KV * HEAD_DIM;
    head_state state[MAX_TASK_HEADS];
    for (int h = 0; h < heads; h++) head_start(&state[h], q + h * group_width, scale);
    for (int64_t start = 0; start < keys; start += TILE) {
        const int valid = keys - start < TILE ? (int)(keys - start) : TILE;
        // A short tile's rows past `valid` repeat its last key, so that whole groups of KEYS are scored; their
        // scores are dropped.
        const cache_element *rows[TILE], *next[TILE];
        cache_rows(cache, table, block_size, token_stride, start, valid, rows);
        for (int i = valid; i < TILE; i++) rows[i] = rows[valid - 1];
        const int next_valid = keys - start - TILE < TILE ? (int)(keys - start - TILE) : TILE;  // <= 0: none
        if (next_valid > 0) cache_rows(cache, table, block_size, token_stride, start + TILE, next_valid, next);
        float key_scales[MAX_TASK_HEADS][TILE], value_scales[MAX_TASK_HEADS][TILE];  // an int8 cache's
#ifdef KV_INT8
        kv_int8_tile_scales(rows, valid, TILE, num_kv_heads, HEAD_DIM, first_head, heads, &key_scales[0][0],
                            &value_scales[0][0]);
#endif
        for (int h = 0; h < heads; h++) {
            const int kv_head = first_head + h;
            head_tile(&state[h], rows, valid, next, next_valid, (int64_t)kv_head * HEAD_DIM,
                      (int64_t)(num_kv_heads + kv_head) * HEAD_DIM, key_scales[h], value_scales[h]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int g = 0; g < QUERIES_PER_KV; g++)
            for (int c = 0; c < CHUNKS; c++)
                vstore(out + h * group_width + g * HEAD_DIM + c * LANES,
                       vmul(state[h].acc[g][c], vset1(1.0f / state[h].running_sum[g])));
}

// KV heads per task for `rows` query rows on the region's threads: a sequence's all (up to MAX_TASK_HEADS), its
// rows read whole, where there are rows enough to keep every thread busy; else one, for more tasks.
static int task_heads(int64_t rows, int num_kv_heads) {
    const int all = num_kv_heads < MAX_TASK_HEADS ? num_kv_heads : MAX_TASK_HEADS;
    return rows >= 4 * omp_get_num_threads() && num_kv_heads % all == 0 ? all : 1;
}

// q [num_seqs, heads, HEAD_DIM] (row stride q_row_stride); block_tables [num_seqs, max_blocks]; context_lens
// [num_seqs] (keys each query attends, its own included) -> out [num_seqs, heads * HEAD_DIM]. Shares the tasks
// among the threads of the enclosing parallel region (an orphaned `omp for`, ending with its barrier;
// decoder_stack_f32.c calls it inside its own); paged_decode_attention_f32 opens one.
static void paged_decode_attention_f32_tasks(const float *q, int64_t q_row_stride, const cache_element *cache,
                                             const int64_t *block_tables, int64_t max_blocks,
                                             const int64_t *context_lens, float *out, int num_seqs,
                                             int num_kv_heads, int block_size, float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM;
    const int heads = task_heads(num_seqs, num_kv_heads), tasks_per_seq = num_kv_heads / heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)num_seqs * tasks_per_seq; task++) {
        const int64_t seq = task / tasks_per_seq;
        const int first_head = (int)(task % tasks_per_seq) * heads;
        attend_heads(q + seq * q_row_stride + first_head * group_width,
                     out + seq * num_kv_heads * group_width + first_head * group_width, cache,
                     block_tables + seq * max_blocks, block_size, num_kv_heads, first_head, heads, context_lens[seq],
                     scale);
    }
}

void paged_decode_attention_f32(const float *q, int64_t q_row_stride, const cache_element *cache,
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
static void paged_prefill_attention_f32_tasks(const float *q, int64_t q_row_stride, const cache_element *cache,
                                              const int64_t *block_tables, int64_t max_blocks,
                                              const int64_t *query_starts, const int64_t *context_lens, float *out,
                                              int num_seqs, int num_kv_heads, int block_size, float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM;
    const int64_t num_rows = query_starts[num_seqs];
    const int heads = task_heads(num_rows, num_kv_heads), tasks_per_row = num_kv_heads / heads;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < num_rows * tasks_per_row; task++) {
        const int64_t row = task / tasks_per_row;
        const int first_head = (int)(task % tasks_per_row) * heads;
        int seq = 0;
        while (query_starts[seq + 1] <= row) seq++;
        const int64_t keys = context_lens[seq] - (query_starts[seq + 1] - 1 - row);  // causal: up to its own
        attend_heads(q + row * q_row_stride + first_head * group_width,
                     out + row * num_kv_heads * group_width + first_head * group_width, cache,
                     block_tables + seq * max_blocks, block_size, num_kv_heads, first_head, heads, keys, scale);
    }
}

void paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const cache_element *cache,
                                 const int64_t *block_tables, int64_t max_blocks, const int64_t *query_starts,
                                 const int64_t *context_lens, float *out, int num_seqs, int num_kv_heads,
                                 int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_prefill_attention_f32_tasks(q, q_row_stride, cache, block_tables, max_blocks, query_starts, context_lens,
                                      out, num_seqs, num_kv_heads, block_size, scale);
}
