// Decode and prompt-chunk attention read in place from the paged bfloat16 KV cache, AVX-512F (no AMX). Where the
// build has AVX512-BF16, q k^T is its dot product straight from the cache, and without AMX so is P V, over pairs of
// keys with P rounded to bfloat16 (as llama.cpp's CPU flash attention keeps it in fp16). Else float32 FMAs of
// widened bf16 inputs, P in float32, like SDPA's.
//
// Built at run time for one model shape (see ember/kernels/build.py): HEAD_DIM (a multiple of 16) and
// QUERIES_PER_KV (query heads sharing one KV head) are compile-time constants, so the query and accumulator
// vectors of a KV head's query group stay in registers.
//
// One routine, attend_rows, answers consecutive query tokens of one sequence for some of its KV heads, each
// over the keys up to its own position (causal). Decode calls it for one token per sequence (per (sequence, KV
// head) when there are fewer sequences than threads) with every key; prompt chunks for up to ROW_GROUP rows of a
// sequence (one (row, KV head) when there are fewer rows than threads). It streams the cache rows once, 16
// tokens at a time: each token's row holds K then V of every KV head (layout of one layer: [num_blocks, block_size,
// 2 (K, V), num_kv_heads, HEAD_DIM]), so the reads are sequential within a block. Per tile: scores of every
// query head (fp32), an online-softmax update (flash-decoding), then the tile's V rows into fp32 accumulators.
// The gather + padded SDPA this replaces copies every key twice before reading it.
//
// Built with -DKV_INT8, the same kernels read an int8 cache (kv_cache.h): K and V widened to float32 in order,
// the scores FMAs of them, each key's scale applied to its score and each value's to its softmax weight.
#include <math.h>
#include <omp.h>

#include "bf16_simd.h"
#include "paged_cache.h"

#define CHUNKS (HEAD_DIM / 16)
// P V in vdpbf16ps over pairs of keys, and the next tile requested into L1, where AVX512-BF16 comes without AMX
// (AMD Zen 4/5); with AMX (Intel's cores) P V in float32 FMAs and the next tile into L2 ran faster
// (docs/benchmarks.md, "Emerald Rapids a third time").
#if defined(__AVX512BF16__) && !defined(KV_INT8) && !defined(__AMX_TILE__)
#define PV_BF16 1
#endif
#ifdef __AMX_TILE__
#define NEXT_TILE_HINT _MM_HINT_T1
#else
#define NEXT_TILE_HINT _MM_HINT_T0
#endif
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

#ifdef KV_INT8
// An int8 cache row of HEAD_DIM values as float32 vectors, in order (the int8 kernels keep their query and output
// accumulators in order too); its scale multiplies the scores and the softmax weights instead.
static inline void load_int8(const int8_t *p, __m512 *parts) {
    for (int c = 0; c < CHUNKS; c++)
        parts[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + c * 16))));
}
#define TOKEN_STRIDE(num_kv_heads) kv_int8_row_bytes(num_kv_heads, HEAD_DIM)
#else
#define TOKEN_STRIDE(num_kv_heads) (2 * (int64_t)(num_kv_heads) * HEAD_DIM)
#endif

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

// out = softmax(q k^T * scale) v for the query heads of KV heads [first_head, first_head + num_heads) of `rows`
// consecutive query tokens of one sequence (block table `table`), row r over keys [0, keys + r) (causal: a prompt
// chunk's rows; decode has one): row r's q and out point at q + r * q_stride and out + r * out_stride, each the
// first of those query heads (num_heads * QUERIES_PER_KV rows of HEAD_DIM, contiguous). Several KV heads in one
// call read whole cache rows, which the hardware prefetchers follow better than a part of each; several query
// rows in one call score each key row loaded against all of them, and read its V again from L1.
// Scores: with AVX512-BF16, q . k in vdpbf16ps straight from the cache's bfloat16 (products exact, pairs
// summed in float32), else float32 FMAs of the split rows; the scale multiplies each tile's scores once.
// P V: with AVX512-BF16, each pair of keys' V rows interleaved (vpunpck{l,h}wd: per 128-bit lane, the pairs of
// values 0-3, then 4-7) and dotted with the pair's two softmax weights rounded to bfloat16; the running sum adds
// the rounded weights, so they still sum to 1. The accumulators hold the lanes' order and are packed back
// (vpackusdw) when the output is stored. Else P stays float32: the V rows are split as above and accumulated by
// FMAs in the split order. Each row's arithmetic is the same, in the same order, whatever `rows` is. Inlined per
// row count (a constant).
static inline __attribute__((always_inline)) void attend_rows(
    const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, const cache_element *cache,
    const int64_t *table, int block_size, int num_kv_heads, int first_head, int num_heads, int64_t keys,
    float scale, const int rows) {
    const int64_t token_stride = TOKEN_STRIDE(num_kv_heads);
    const int num_queries = num_heads * QUERIES_PER_KV;
    // Per row and query head: fp32 output accumulator (lanes' order with PV_BF16, split order without; in order
    // for an int8 cache), running max and softmax sum.
    float acc[rows * num_queries * HEAD_DIM] __attribute__((aligned(64)));
    float running_max[rows * num_queries], running_sum[rows * num_queries];
    for (int h = 0; h < rows * num_queries; h++) {
        for (int c = 0; c < CHUNKS; c++) _mm512_store_ps(acc + h * HEAD_DIM + c * 16, _mm512_setzero_ps());
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    const __m512 scale_vector = _mm512_set1_ps(scale);
    const int64_t last_keys = keys + rows - 1;  // the last row's, the most

    for (int64_t start = 0; start < last_keys; start += TILE) {
        const int64_t valid = last_keys - start < TILE ? last_keys - start : TILE;
        int64_t row_valid[rows];  // keys of this tile row r attends (none: <= 0)
        for (int r = 0; r < rows; r++) row_valid[r] = keys + r - start < TILE ? keys + r - start : TILE;
        const cache_element *cache_row[TILE];
        cache_rows(cache, table, block_size, token_stride, start, valid, cache_row);
        // The next tile's rows are scattered over blocks: the loop below requests them (NEXT_TILE_HINT) while it
        // computes this tile, one row's K and V of the head at hand per key. Spread like this, the requests
        // overlap the arithmetic; issued all at once (192 lines) they stalled the core until the line-fill
        // buffers drained, and the kernel ran slower. Without any, it waits on loads, even with the blocks in
        // order (2x slower).
        const int64_t next_valid = last_keys - start - AHEAD < TILE ? last_keys - start - AHEAD : TILE;
        const cache_element *next[TILE];
        if (next_valid > 0) cache_rows(cache, table, block_size, token_stride, start + AHEAD, next_valid, next);
#ifdef KV_INT8
        float tile_key_scales[num_heads][TILE] __attribute__((aligned(64)));
        float tile_value_scales[num_heads][TILE] __attribute__((aligned(64)));
        kv_int8_tile_scales(cache_row, (int)valid, TILE, num_kv_heads, HEAD_DIM, first_head, num_heads,
                            &tile_key_scales[0][0], &tile_value_scales[0][0]);
#endif
        for (int kv = 0; kv < num_heads; kv++) {
            const int64_t key_offset = (int64_t)(first_head + kv) * HEAD_DIM;
            const int64_t value_offset = (int64_t)(num_kv_heads + first_head + kv) * HEAD_DIM;
#ifdef KV_INT8
            const float *key_scales = tile_key_scales[kv], *value_scales = tile_value_scales[kv];
            __m512 qv[rows][QUERIES_PER_KV][CHUNKS];
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < QUERIES_PER_KV; g++)
                    for (int c = 0; c < CHUNKS; c++)
                        qv[r][g][c] = load_bf16(q + r * q_stride + (kv * QUERIES_PER_KV + g) * HEAD_DIM + c * 16);
#elif defined(__AVX512BF16__)
            __m512bh qv[rows][QUERIES_PER_KV][HEAD_DIM / 32];
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < QUERIES_PER_KV; g++)
                    for (int c = 0; c < HEAD_DIM / 32; c++)
                        qv[r][g][c] = (__m512bh)_mm512_loadu_si512(
                            q + r * q_stride + (kv * QUERIES_PER_KV + g) * HEAD_DIM + c * 32);
#else
            __m512 qv[rows][QUERIES_PER_KV][CHUNKS];
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < QUERIES_PER_KV; g++)
                    load_bf16_split(q + r * q_stride + (kv * QUERIES_PER_KV + g) * HEAD_DIM, qv[r][g]);
#endif
            __m512 dots[rows][QUERIES_PER_KV][TILE];
            for (int i = 0; i < TILE; i++) {
                if (i >= valid) {
                    for (int r = 0; r < rows; r++)
                        for (int g = 0; g < QUERIES_PER_KV; g++) dots[r][g][i] = _mm512_setzero_ps();
                    continue;
                }
                if (i < next_valid) {
                    for (int c = 0; c < HEAD_DIM * (int)sizeof(cache_element); c += 64) {
                        _mm_prefetch((const char *)(next[i] + key_offset) + c, NEXT_TILE_HINT);
                        _mm_prefetch((const char *)(next[i] + value_offset) + c, NEXT_TILE_HINT);
                    }
#ifdef KV_INT8
                    _mm_prefetch((const char *)kv_int8_scales(next[i], num_kv_heads, HEAD_DIM), NEXT_TILE_HINT);
#endif
                }
#ifdef KV_INT8
                __m512 k[CHUNKS];
                load_int8(cache_row[i] + key_offset, k);
#elif defined(__AVX512BF16__)
                __m512bh k[HEAD_DIM / 32];
                for (int c = 0; c < HEAD_DIM / 32; c++)
                    k[c] = (__m512bh)_mm512_loadu_si512(cache_row[i] + key_offset + c * 32);
#else
                __m512 k[CHUNKS];
                load_bf16_split(cache_row[i] + key_offset, k);
#endif
                for (int r = 0; r < rows; r++)
                    for (int g = 0; g < QUERIES_PER_KV; g++) {
                        if (i >= row_valid[r]) {
                            dots[r][g][i] = _mm512_setzero_ps();
                            continue;
                        }
#if defined(__AVX512BF16__) && !defined(KV_INT8)
                        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[r][g][0], k[0]);
                        for (int c = 1; c < HEAD_DIM / 32; c++) dot = _mm512_dpbf16_ps(dot, qv[r][g][c], k[c]);
#else
                        __m512 dot = _mm512_mul_ps(qv[r][g][0], k[0]);
                        for (int c = 1; c < CHUNKS; c++) dot = _mm512_fmadd_ps(qv[r][g][c], k[c], dot);
#endif
                        dots[r][g][i] = dot;
                    }
            }
            for (int r = 0; r < rows; r++) {
                if (row_valid[r] <= 0) continue;  // its keys ended in an earlier tile
                const __mmask16 mask = tile_mask(row_valid[r]);
                float *group_acc = acc + (r * num_queries + kv * QUERIES_PER_KV) * HEAD_DIM;
                // Online softmax: rescale what was accumulated when this tile raises a head's maximum.
                const int first_h = r * num_queries + kv * QUERIES_PER_KV;
                __m512 scores[QUERIES_PER_KV];
                float new_max[QUERIES_PER_KV], correction[QUERIES_PER_KV + 15];
                for (int g = 0; g < QUERIES_PER_KV; g++) {
                    scores[g] = _mm512_mul_ps(sum_lanes16(dots[r][g]), scale_vector);
#ifdef KV_INT8
                    scores[g] = _mm512_mul_ps(scores[g], _mm512_load_ps(key_scales));
#endif
                    const float tile_max = _mm512_mask_reduce_max_ps(mask, scores[g]);
                    new_max[g] = tile_max > running_max[first_h + g] ? tile_max : running_max[first_h + g];
                }
                // The heads' rescaling factors in one vector exp, not a libm expf call each (docs/benchmarks.md).
                // The first tile's exp(-inf) comes out as exp(-87) from the clamp: it scales zeros.
                for (int g0 = 0; g0 < QUERIES_PER_KV; g0 += 16) {
                    float shift[16] = {0};
                    for (int g = g0; g < QUERIES_PER_KV && g < g0 + 16; g++)
                        shift[g - g0] = running_max[first_h + g] - new_max[g];
                    _mm512_storeu_ps(correction + g0, exp512(_mm512_loadu_ps(shift)));
                }
#ifdef PV_BF16
                uint16_t probs[QUERIES_PER_KV][TILE] __attribute__((aligned(64)));
#else
                float probs[QUERIES_PER_KV][TILE] __attribute__((aligned(64)));
#endif
                __m512 group_out[QUERIES_PER_KV][CHUNKS];
                for (int g = 0; g < QUERIES_PER_KV; g++) {
                    const int h = first_h + g;
                    __m512 p =
                        _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(scores[g], _mm512_set1_ps(new_max[g]))));
#ifdef KV_INT8
                    _mm512_store_ps(probs[g], _mm512_mul_ps(p, _mm512_load_ps(value_scales)));
#elif defined(PV_BF16)
                    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(p);
                    _mm256_store_si256((__m256i *)probs[g], rounded);
                    p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
#else
                    _mm512_store_ps(probs[g], p);
#endif
                    running_sum[h] = running_sum[h] * correction[g] + _mm512_reduce_add_ps(p);
                    running_max[h] = new_max[g];
                    for (int c = 0; c < CHUNKS; c++)
                        group_out[g][c] = _mm512_mul_ps(_mm512_load_ps(group_acc + g * HEAD_DIM + c * 16),
                                                        _mm512_set1_ps(correction[g]));
                }
#ifdef PV_BF16
                for (int i = 0; i < row_valid[r]; i += 2) {
                    // A lone last key pairs with itself: its partner's weight is 0 (masked).
                    const uint16_t *v0 = cache_row[i] + value_offset;
                    const uint16_t *v1 = i + 1 < row_valid[r] ? cache_row[i + 1] + value_offset : v0;
                    __m512bh pairs[CHUNKS];
                    for (int c = 0; c < HEAD_DIM / 32; c++) {
                        const __m512i a = _mm512_loadu_si512(v0 + c * 32), b = _mm512_loadu_si512(v1 + c * 32);
                        pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                        pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
                    }
                    for (int g = 0; g < QUERIES_PER_KV; g++) {
                        int32_t weights;
                        __builtin_memcpy(&weights, &probs[g][i], sizeof weights);
                        const __m512bh p = (__m512bh)_mm512_set1_epi32(weights);
                        for (int c = 0; c < CHUNKS; c++)
                            group_out[g][c] = _mm512_dpbf16_ps(group_out[g][c], pairs[c], p);
                    }
                }
#else
                for (int i = 0; i < row_valid[r]; i++) {
                    __m512 v[CHUNKS];
#ifdef KV_INT8
                    load_int8(cache_row[i] + value_offset, v);
#else
                    load_bf16_split(cache_row[i] + value_offset, v);
#endif
                    for (int g = 0; g < QUERIES_PER_KV; g++) {
                        const __m512 p = _mm512_set1_ps(probs[g][i]);
                        for (int c = 0; c < CHUNKS; c++)
                            group_out[g][c] = _mm512_fmadd_ps(p, v[c], group_out[g][c]);
                    }
                }
#endif
                for (int g = 0; g < QUERIES_PER_KV; g++)
                    for (int c = 0; c < CHUNKS; c++)
                        _mm512_store_ps(group_acc + g * HEAD_DIM + c * 16, group_out[g][c]);
            }
        }
    }
    // Back to the values' order: with PV_BF16 vpackusdw of the high halves (per 128-bit lane, values 0-3 then
    // 4-7), else each 32-bit pair of the output is (even value, odd value).
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < num_queries; h++) {
            const float *head_acc = acc + (r * num_queries + h) * HEAD_DIM;
            const __m512 inverse_sum = _mm512_set1_ps(1.0f / running_sum[r * num_queries + h]);
#ifdef KV_INT8
            for (int c = 0; c < CHUNKS; c++)
                store_bf16(out + r * out_stride + h * HEAD_DIM + c * 16,
                           round_bf16(_mm512_mul_ps(_mm512_load_ps(head_acc + c * 16), inverse_sum)));
#else
            for (int c = 0; c < HEAD_DIM / 32; c++) {
                // These 32 values' two accumulators, rounded: with PV_BF16 each 128-bit lane's values 0-3, then
                // 4-7; else the evens, then the odds.
                const __m512i first = _mm512_castps_si512(
                    round_bf16(_mm512_mul_ps(_mm512_load_ps(head_acc + 2 * c * 16), inverse_sum)));
                const __m512i second = _mm512_castps_si512(
                    round_bf16(_mm512_mul_ps(_mm512_load_ps(head_acc + (2 * c + 1) * 16), inverse_sum)));
#ifdef PV_BF16
                const __m512i values = _mm512_packus_epi32(_mm512_srli_epi32(first, 16), _mm512_srli_epi32(second, 16));
#else
                const __m512i values = _mm512_or_si512(_mm512_srli_epi32(first, 16), second);
#endif
                _mm512_storeu_si512(out + r * out_stride + h * HEAD_DIM + c * 32, values);
            }
#endif
        }
}

// One query token: decode's call, and a prompt row's when a task is one (row, KV head).
static void attend_heads(const uint16_t *q, uint16_t *out, const cache_element *cache, const int64_t *table,
                         int block_size, int num_kv_heads, int first_head, int num_heads, int64_t keys,
                         float scale) {
    attend_rows(q, 0, out, 0, cache, table, block_size, num_kv_heads, first_head, num_heads, keys, scale, 1);
}

// q: [num_seqs, num_kv_heads * QUERIES_PER_KV, HEAD_DIM] with row stride q_row_stride (elements);
// block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs] (keys each query attends, its own included);
// out: [num_seqs, num_kv_heads * QUERIES_PER_KV * HEAD_DIM], contiguous. Shares the tasks among the threads
// of the enclosing parallel region (decoder_stack.c calls it inside its own); paged_decode_attention opens one.
static void paged_decode_attention_tasks(const uint16_t *q, int64_t q_row_stride, const cache_element *cache,
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

void paged_decode_attention(const uint16_t *q, int64_t q_row_stride, const cache_element *cache,
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
// contiguous. Causal: the query at position p attends keys [0, p]. A task is up to ROW_GROUP consecutive rows of
// one sequence with every KV head (a key row read once for all of them), or, when there are fewer rows than
// threads, one (row, KV head). Shares the tasks among the threads of the enclosing parallel region (an orphaned
// `omp for` without its barrier: callers inside a region add one).
#define ROW_GROUP 4

static void paged_prefill_attention_avx512_tasks(const uint16_t *q, int64_t q_row_stride, const cache_element *cache,
                                                 const int64_t *block_tables, int64_t max_blocks,
                                                 const int64_t *query_starts, const int64_t *context_lens,
                                                 uint16_t *out, int num_seqs, int num_kv_heads, int block_size,
                                                 float scale) {
    const int64_t group_width = (int64_t)QUERIES_PER_KV * HEAD_DIM, out_stride = num_kv_heads * group_width;
    const int64_t num_rows = query_starts[num_seqs];
    if (num_rows < omp_get_num_threads()) {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t task = 0; task < num_rows * num_kv_heads; task++) {
            const int64_t row = num_rows - 1 - task / num_kv_heads;
            const int head = (int)(task % num_kv_heads);
            int seq = 0;
            while (query_starts[seq + 1] <= row) seq++;
            const int64_t keys = context_lens[seq] - (query_starts[seq + 1] - 1 - row);  // up to its own
            attend_heads(q + row * q_row_stride + head * group_width, out + row * out_stride + head * group_width,
                         cache, block_tables + seq * max_blocks, block_size, num_kv_heads, head, 1, keys, scale);
        }
        return;
    }
    int64_t num_groups = 0;
    for (int s = 0; s < num_seqs; s++)
        num_groups += (query_starts[s + 1] - query_starts[s] + ROW_GROUP - 1) / ROW_GROUP;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < num_groups; task++) {
        // Last rows first: they see the most keys, and the shorter tasks left at the end even out the threads.
        int64_t group = num_groups - 1 - task;
        int seq = 0;
        for (;; seq++) {
            const int64_t groups = (query_starts[seq + 1] - query_starts[seq] + ROW_GROUP - 1) / ROW_GROUP;
            if (group < groups) break;
            group -= groups;
        }
        const int64_t first = query_starts[seq] + group * ROW_GROUP;
        const int64_t rows = query_starts[seq + 1] - first < ROW_GROUP ? query_starts[seq + 1] - first : ROW_GROUP;
        const int64_t keys = context_lens[seq] - (query_starts[seq + 1] - 1 - first);  // the first row's
#define ATTEND_ROWS(ROWS)                                                                                     \
    attend_rows(q + first * q_row_stride, q_row_stride, out + first * out_stride, out_stride, cache,         \
                block_tables + seq * max_blocks, block_size, num_kv_heads, 0, num_kv_heads, keys, scale, ROWS)
        switch (rows) {
            case 4: ATTEND_ROWS(4); break;
            case 3: ATTEND_ROWS(3); break;
            case 2: ATTEND_ROWS(2); break;
            default: ATTEND_ROWS(1); break;
        }
#undef ATTEND_ROWS
    }
}

void paged_prefill_attention_avx512(const uint16_t *q, int64_t q_row_stride, const cache_element *cache,
                                    const int64_t *block_tables, int64_t max_blocks, const int64_t *query_starts,
                                    const int64_t *context_lens, uint16_t *out, int num_seqs, int num_kv_heads,
                                    int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_prefill_attention_avx512_tasks(q, q_row_stride, cache, block_tables, max_blocks, query_starts,
                                         context_lens, out, num_seqs, num_kv_heads, block_size, scale);
}
