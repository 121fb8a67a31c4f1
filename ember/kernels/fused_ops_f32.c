// fused_ops.c's residual add + RMSNorm, SiLU-and-mul and RoPE + KV-cache write for float32, on AVX-512 or
// AVX2 + FMA vectors (f32_simd.h; widths are multiples of 16). No intermediate rounding: the results differ
// from PyTorch's float32 ops only in the order of sums and in exp's last bits.
//
// Each op's *_rows function shares its rows among the threads of the enclosing OpenMP parallel region (an
// orphaned `omp for`, ending with its barrier; decoder_stack_f32.c calls them inside its own region); the
// exported function opens one.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "f32_simd.h"
#include "kv_cache.h"

// Split rows across threads only when there is enough work to pay for waking them.
#define PARALLEL_MIN_ELEMENTS 32768

// residual = x + residual (in place; skipped when residual is x itself), out = rms_norm(residual) * weight.
static void add_rms_norm_f32_rows(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                                  int64_t width, float eps) {
    const int add = x != residual;
#pragma omp for
    for (int64_t row = 0; row < rows; row++) {
        float *res = residual + row * width;
        const float *in = x + row * width;
        vfloat squares = vzero();
        for (int64_t i = 0; i < width; i += LANES) {
            vfloat h = vload(res + i);
            if (add) {
                h = vadd(vload(in + i), h);
                vstore(res + i, h);
            }
            squares = vfmadd(h, h, squares);
        }
        const vfloat scale = vset1(1.0f / sqrtf(vsum(squares) / width + eps));
        for (int64_t i = 0; i < width; i += LANES)
            vstore(out + row * width + i, vmul(vmul(vload(res + i), scale), vload(weight + i)));
    }
}

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t width, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    add_rms_norm_f32_rows(x, residual, weight, out, rows, width, eps);
}

// out = silu(gate) * up for gate_up rows [gate (width), up (width)].
static void silu_and_mul_f32_rows(const float *gate_up, float *out, int64_t rows, int64_t width) {
#pragma omp for
    for (int64_t row = 0; row < rows; row++) {
        const float *gate = gate_up + row * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i += LANES) {
            vfloat g = vload(gate + i);
            vfloat silu = vdiv(g, vadd(vset1(1.0f), vexp(vmul(g, vset1(-1.0f)))));
            vstore(out + row * width + i, vmul(silu, vload(up + i)));
        }
    }
}

void silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    silu_and_mul_f32_rows(gate_up, out, rows, width);
}

// Rotates the q and k heads of each qkv row in place (x * cos + roll(x, half) * sin_signed, as apply_rotary)
// and writes the row's k and v into its KV-cache slot ([slot, 2 (K, V), num_kv_heads, head_dim]; quantized in
// int8 builds: kv_cache.h).
static void rotary_and_cache_f32_rows(float *qkv, const float *cos, const float *sin_signed, const int64_t *slots,
                                      KV_ELEMENT(float) *cache, int64_t rows, int num_heads, int num_kv_heads,
                                      int head_dim) {
    const int64_t row_width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    const int half = head_dim / 2;
#pragma omp for
    for (int64_t row = 0; row < rows; row++) {
        float *x = qkv + row * row_width;
        const float *c = cos + row * head_dim, *s = sin_signed + row * head_dim;
        float rotated[head_dim];
        for (int head = 0; head < num_heads + num_kv_heads; head++) {
            float *h = x + head * head_dim;
            for (int i = 0; i < head_dim; i += LANES)
                vstore(rotated + i, vfmadd(vload(h + (i + half) % head_dim), vload(s + i),
                                           vmul(vload(h + i), vload(c + i))));
            memcpy(h, rotated, sizeof(float) * head_dim);
        }
        // k then v: one contiguous run in qkv and in the slot.
#ifdef KV_INT8
        kv_int8_store(x + (int64_t)num_heads * head_dim,
                      cache + slots[row] * kv_int8_row_bytes(num_kv_heads, head_dim), num_kv_heads, head_dim);
#else
        const int64_t kv_width = (int64_t)num_kv_heads * head_dim;
        memcpy(cache + slots[row] * 2 * kv_width, x + (int64_t)num_heads * head_dim, sizeof(float) * 2 * kv_width);
#endif
    }
}

void rotary_and_cache_f32(float *qkv, const float *cos, const float *sin_signed, const int64_t *slots,
                          KV_ELEMENT(float) *cache, int64_t rows, int num_heads, int num_kv_heads, int head_dim,
                          int num_threads) {
    const int64_t row_width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel num_threads(num_threads) if (rows * row_width >= PARALLEL_MIN_ELEMENTS)
    rotary_and_cache_f32_rows(qkv, cos, sin_signed, slots, cache, rows, num_heads, num_kv_heads, head_dim);
}

// out[row] = the index of the row's largest value, the first one on ties (torch.max(dim=-1).indices; -0 ties
// +0). One pass finds the maximum, a second its first index: the row is still in cache. torch's own reduction
// over float32 logits is several times slower, most of a greedy step's sampler (docs/benchmarks.md).
void argmax_f32_rows(const float *x, int64_t *out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t row = 0; row < rows; row++) {
        const float *values = x + row * width;
        const int64_t whole = width - width % LANES;
        vfloat best = vset1(-INFINITY);
        for (int64_t i = 0; i < whole; i += LANES) best = vmax(best, vload(values + i));
        float maximum = vmax_lane(best);
        for (int64_t i = whole; i < width; i++)
            if (values[i] > maximum) maximum = values[i];
        const vfloat target = vset1(maximum);
        int64_t index = whole;
        for (int64_t i = 0; i < whole; i += LANES) {
            const uint32_t hit = vequal_lanes(vload(values + i), target);
            if (hit) {
                index = i + __builtin_ctz(hit);
                break;
            }
        }
        while (index < width - 1 && values[index] != maximum) index++;
        out[row] = index;
    }
}
