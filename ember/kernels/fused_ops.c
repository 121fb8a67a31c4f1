// The decoder layer's elementwise steps fused into one pass each, bfloat16, AVX-512F (widths are multiples
// of 16). In PyTorch each is 3-5 separate ops, each a full pass over memory plus a dispatch; at decode batch
// sizes the dispatches dominate, in prefill the passes do.
//
// Every intermediate is rounded to bfloat16 where PyTorch's op sequence rounds it, so results match the
// PyTorch path bit for bit except where a transcendental (exp in SiLU) or a sum's order differs in the last
// float32 bit before rounding.
//
// Each op's *_rows function shares its rows among the threads of the enclosing OpenMP parallel region (an
// orphaned `omp for`; decoder_stack.c calls them inside its own region); the exported function opens one.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_simd.h"
#include "kv_cache.h"

// Split rows across threads only when there is enough work to pay for waking them.
#define PARALLEL_MIN_ELEMENTS 32768

// residual = x + residual (in place; skipped when residual is x itself), out = rms_norm(residual) * weight,
// as RMSNorm.forward: the norm in float32 rounded once, then the bfloat16 weight multiply rounded again.
static void add_rms_norm_rows(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                              int64_t rows, int64_t width, float eps) {
    const int add = x != residual;
#pragma omp for
    for (int64_t row = 0; row < rows; row++) {
        uint16_t *res = residual + row * width;
        const uint16_t *in = x + row * width;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < width; i += 16) {
            __m512 h = load_bf16(res + i);
            if (add) {
                h = round_bf16(_mm512_add_ps(load_bf16(in + i), h));
                store_bf16(res + i, h);
            }
            squares = _mm512_fmadd_ps(h, h, squares);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / width + eps));
        for (int64_t i = 0; i < width; i += 16) {
            __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(res + i), scale));
            store_bf16(out + row * width + i, round_bf16(_mm512_mul_ps(normed, load_bf16(weight + i))));
        }
    }
}

void add_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                  int64_t width, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    add_rms_norm_rows(x, residual, weight, out, rows, width, eps);
}

// out = silu(gate) * up for gate_up rows [gate (width), up (width)], each product rounded as PyTorch's
// F.silu(gate) * up rounds it.
static void silu_and_mul_rows(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width) {
#pragma omp for
    for (int64_t row = 0; row < rows; row++) {
        const uint16_t *gate = gate_up + row * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i += 16) {
            __m512 g = load_bf16(gate + i);
            __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                    exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16(out + row * width + i, round_bf16(_mm512_mul_ps(silu, load_bf16(up + i))));
        }
    }
}

void silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    silu_and_mul_rows(gate_up, out, rows, width);
}

// Rotates the q and k heads of each qkv row in place (x * cos + roll(x, half) * sin_signed, each product and
// the sum rounded, as apply_rotary) and writes the row's k and v into its KV-cache slot
// ([slot, 2 (K, V), num_kv_heads, head_dim]; quantized in int8 builds: kv_cache.h).
static void rotary_and_cache_rows(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin_signed,
                                  const int64_t *slots, KV_ELEMENT(uint16_t) *cache, int64_t rows, int num_heads,
                                  int num_kv_heads, int head_dim) {
    const int64_t row_width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t kv_width = (int64_t)num_kv_heads * head_dim;
    const int half = head_dim / 2;
#pragma omp for
    for (int64_t row = 0; row < rows; row++) {
        uint16_t *x = qkv + row * row_width;
        const uint16_t *c = cos + row * head_dim, *s = sin_signed + row * head_dim;
        for (int head = 0; head < num_heads + num_kv_heads; head++) {
            uint16_t *h = x + head * head_dim;
            __m512 rotated[head_dim / 16];
            for (int i = 0; i < head_dim; i += 16) {
                __m512 straight = round_bf16(_mm512_mul_ps(load_bf16(h + i), load_bf16(c + i)));
                __m512 rolled = round_bf16(_mm512_mul_ps(load_bf16(h + (i + half) % head_dim), load_bf16(s + i)));
                rotated[i / 16] = round_bf16(_mm512_add_ps(straight, rolled));
            }
            for (int i = 0; i < head_dim; i += 16) store_bf16(h + i, rotated[i / 16]);
        }
        const uint16_t *k = x + (int64_t)num_heads * head_dim;  // k then v: one contiguous run in qkv
#ifdef KV_INT8
        float kv[2 * kv_width];
        for (int64_t i = 0; i < 2 * kv_width; i += 16) _mm512_storeu_ps(kv + i, load_bf16(k + i));
        kv_int8_store(kv, cache + slots[row] * kv_int8_row_bytes(num_kv_heads, head_dim), num_kv_heads, head_dim);
#else
        uint16_t *slot = cache + slots[row] * 2 * kv_width;
        for (int64_t i = 0; i < 2 * kv_width; i += 16)  // and in the slot
            _mm256_storeu_si256((__m256i *)(slot + i), _mm256_loadu_si256((const __m256i *)(k + i)));
#endif
    }
}

void rotary_and_cache(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin_signed, const int64_t *slots,
                      KV_ELEMENT(uint16_t) *cache, int64_t rows, int num_heads, int num_kv_heads, int head_dim,
                      int num_threads) {
    const int64_t row_width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel num_threads(num_threads) if (rows * row_width >= PARALLEL_MIN_ELEMENTS)
    rotary_and_cache_rows(qkv, cos, sin_signed, slots, cache, rows, num_heads, num_kv_heads, head_dim);
}

// out[row] = the index of the row's largest bfloat16 value, the first one on ties (torch.max(dim=-1).indices
// on the float32 upcast; -0 ties +0). One pass finds the maximum, a second its first index: the row is still
// in cache. torch's own reduction over bfloat16 is far slower (docs/benchmarks.md).
static inline float bf16_to_float(uint16_t value) {
    const uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof(result));
    return result;
}

void argmax_bf16_rows(const uint16_t *x, int64_t *out, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t row = 0; row < rows; row++) {
        const uint16_t *values = x + row * width;
        const int64_t whole = width - width % 16;
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < whole; i += 16) best = _mm512_max_ps(best, load_bf16(values + i));
        float maximum = _mm512_reduce_max_ps(best);
        for (int64_t i = whole; i < width; i++)
            if (bf16_to_float(values[i]) > maximum) maximum = bf16_to_float(values[i]);
        const __m512 target = _mm512_set1_ps(maximum);
        int64_t index = whole;
        for (int64_t i = 0; i < whole; i += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(load_bf16(values + i), target, _CMP_EQ_OQ);
            if (hit) {
                index = i + __builtin_ctz(hit);
                break;
            }
        }
        while (index < width - 1 && bf16_to_float(values[index]) != maximum) index++;
        out[row] = index;
    }
}

// Grammar masks: each listed row of bfloat16 logits [*, width] gets -inf (0xFF80) wherever its row of the
// int32 bitmask [*, words] has a 0 bit (token t is bit t % 32 of word t / 32, xgrammar's layout). One word
// masks exactly one vector of 32 bfloat16 values, so a row is one masked store per word, no load: memory
// speed, where xgrammar's own CPU kernel goes token by token.
void apply_token_bitmask_bf16_rows(uint16_t *logits, const int32_t *bitmask, const int64_t *rows,
                                   int64_t num_rows, int64_t width, int64_t words, int num_threads) {
    const __m512i neg_inf = _mm512_set1_epi16((short)0xFF80);
#pragma omp parallel for num_threads(num_threads) if (num_rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t k = 0; k < num_rows; k++) {
        uint16_t *values = logits + rows[k] * width;
        const uint32_t *allowed = (const uint32_t *)bitmask + rows[k] * words;
        const int64_t whole = width / 32 < words ? width / 32 : words;
        for (int64_t word = 0; word < whole; word++)
            _mm512_mask_storeu_epi16(values + word * 32, (__mmask32)~allowed[word], neg_inf);
        for (int64_t i = whole * 32; i < width && i / 32 < words; i++)
            if (!((allowed[i / 32] >> (i % 32)) & 1)) values[i] = 0xFF80;
    }
}
