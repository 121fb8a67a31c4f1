// The KV cache's element type, and its int8 form (`--kv-cache-dtype int8`: kernels built with -DKV_INT8), shared
// by the attention kernels and the cache writes of both dtypes. One token's row of one layer's int8 cache is its K
// then V of every KV head in int8 ([2, kv_heads, head_dim]), then a float32 scale per (K or V, KV head)
// ([2, kv_heads]): a head's values are round(x / scale) with scale = max |x| / 127 (a head of zeros: scale 0,
// values 0), as quantize_kv in ember/layers/kv_cache.py computes them. Half the bytes of bfloat16 K/V (a quarter
// of float32's) plus the scales: decode attention, which reads every cached key of every sequence each step,
// reads that much less.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>

// The cache's element type for kernels of a dtype whose own element type is `model_type`.
#ifdef KV_INT8
#define KV_ELEMENT(model_type) int8_t
#else
#define KV_ELEMENT(model_type) model_type
#endif

static inline int64_t kv_int8_row_bytes(int num_kv_heads, int head_dim) {
    return 2 * (int64_t)num_kv_heads * head_dim + 2 * (int64_t)num_kv_heads * (int64_t)sizeof(float);
}

// The row's scales: K's of every KV head, then V's.
static inline const float *kv_int8_scales(const int8_t *row, int num_kv_heads, int head_dim) {
    return (const float *)(row + 2 * (int64_t)num_kv_heads * head_dim);
}

// One token's K and V (2 * num_kv_heads heads of head_dim float32 values, contiguous) into its cache row.
static inline void kv_int8_store(const float *kv, int8_t *row, int num_kv_heads, int head_dim) {
    float *scales = (float *)(row + 2 * (int64_t)num_kv_heads * head_dim);
    for (int h = 0; h < 2 * num_kv_heads; h++) {
        const float *x = kv + h * head_dim;
        float absmax = 0.0f;
        for (int i = 0; i < head_dim; i++) absmax = fmaxf(absmax, fabsf(x[i]));
        const float scale = absmax / 127.0f, divisor = scale > 0.0f ? scale : 1.0f;
        // A division, not a product by the inverse: the same values as torch's x / scale.
        for (int i = 0; i < head_dim; i++) row[h * head_dim + i] = (int8_t)nearbyintf(x[i] / divisor);
        scales[h] = scale;
    }
}

// The scales of KV heads [first_head, first_head + heads) in `count` cache rows: keys[h * stride + i] and
// values[h * stride + i] for row i, 0 for i in [count, stride). Scalar loads on purpose: vectorized over the rows,
// GCC turned this loop into gathers, which took more of the attention kernels' time than these loads.
static void __attribute__((unused, noinline, optimize("no-tree-vectorize"))) kv_int8_tile_scales(
    const int8_t *const *rows, int count, int stride, int num_kv_heads, int head_dim, int first_head, int heads,
    float *keys, float *values) {
    for (int i = 0; i < stride; i++) {
        const float *scales = i < count ? kv_int8_scales(rows[i], num_kv_heads, head_dim) : NULL;
        for (int h = 0; h < heads; h++) {
            keys[h * stride + i] = scales ? scales[first_head + h] : 0.0f;
            values[h * stride + i] = scales ? scales[num_kv_heads + first_head + h] : 0.0f;
        }
    }
}
