// Quantized weights used as they are stored: y = x @ W^T for W in a GGUF block format (Q8_0, Q4_0, Q4_1:
// 32 weights per block with an fp16 scale, plus an fp16 min for Q4_1) or int8 with one float scale per
// output row ("int8"), dequantized in registers, never in memory.
//
// The activation rows are quantized first, as llama.cpp's Q8_0/Q8_1 activations: per block of 32, a float
// scale d = max|x| / 127, int8 values round(x / d) and their sum s = d * sum(q). A weight block then meets
// an activation block in one 32-wide integer dot product of unsigned 8-bit by signed 8-bit values
// (vpdpbusd with AVX512-VNNI or AVX-VNNI; vpmaddubsw + vpmaddwd on AVX2), and the block's scales multiply
// that integer in float:
//   Q8_0: dw * dx * dot(w, x)             (w signed: |w| times x carrying w's sign)
//   Q4_0: dw * (dx * dot(q, x) - 8 s)      (w = dw (q - 8), q the unsigned nibble)
//   Q4_1: dw * dx * dot(q, x) + mw * s     (w = dw q + mw)
//   int8: row_scale * sum over blocks of dx * dot(w, x)
// Decode batches are a few rows, so the weights are read once from memory per step: each weight block is
// loaded once and dotted with up to ROW_TILE activation rows while it sits in a register. Larger batches
// (prompt chunks) dequantize the weight to float32 (dequantize_weight) for a float GEMM instead.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define ROW_TILE 4

enum weight_format { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, INT8 = 3 };

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch's conversion
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Activation rows [rows, k] (row stride x_stride; float32, or bfloat16 when x_bf16) -> int8 xq [rows, k], per
// block scales xd and sums xs [rows, k / BLOCK]. Scalar on purpose: a step's activations are a few KiB, and
// nearbyintf rounds half to even as the tests' reference does.
void quantize_activations(const void *x, int x_bf16, int64_t x_stride, int64_t rows, int64_t k, int8_t *xq,
                          float *xd, float *xs) {
    const int64_t blocks = k / BLOCK;
    float src[BLOCK];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t first = r * x_stride + b * BLOCK;
            for (int i = 0; i < BLOCK; i++)
                src[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[first + i]) : ((const float *)x)[first + i];
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(src[i]));
            const float d = amax / 127.0f;
            const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            int8_t *dst = xq + r * k + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) {
                const int q = (int)nearbyintf(src[i] * inverse);
                dst[i] = (int8_t)q;
                sum += q;
            }
            xd[r * blocks + b] = d;
            xs[r * blocks + b] = d * (float)sum;
        }
    }
}

// 8 int32 partial sums of u (unsigned bytes) times s (signed bytes), 4 products each.
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    // No overflow: |products| <= 128 * 127, two per 16-bit lane.
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float horizontal_sum(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

// One weight row (its blocks: signed bytes qs8 or nibbles qs4, fp16 scales and mins, or a row scale for
// int8) against `tile` activation rows; writes each row's dot product into result[r].
static inline __attribute__((always_inline)) void row_dot(
        int format, int tile, const int8_t *qs8, const uint8_t *qs4, const uint16_t *scales, const uint16_t *mins,
        float row_scale, const int8_t *xq, const float *xd, const float *xs, int64_t k, float *result) {
    const int64_t blocks = k / BLOCK;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    __m256 acc[ROW_TILE];
    float offset[ROW_TILE];
    for (int r = 0; r < tile; r++) {
        acc[r] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        __m256i weights_u8, signs = _mm256_setzero_si256();
        if (format == Q4_0 || format == Q4_1) {
            // Nibble i of a block's 16 bytes is weight i (low) and weight 16 + i (high): 32 unsigned values.
            const __m128i packed = _mm_loadu_si128((const __m128i *)(qs4 + b * (BLOCK / 2)));
            weights_u8 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_nibbles);
        } else {
            signs = _mm256_loadu_si256((const __m256i *)(qs8 + b * BLOCK));
            weights_u8 = _mm256_sign_epi8(signs, signs);
        }
        const float dw = format == INT8 ? 1.0f : half_to_float(scales[b]);
        const float mw = format == Q4_1 ? half_to_float(mins[b]) : 0.0f;
        for (int r = 0; r < tile; r++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * BLOCK));
            if (format == Q8_0 || format == INT8) x = _mm256_sign_epi8(x, signs);
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(weights_u8, x));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xd[r * blocks + b]), acc[r]);
            if (format == Q4_0) offset[r] -= 8.0f * dw * xs[r * blocks + b];
            if (format == Q4_1) offset[r] += mw * xs[r * blocks + b];
        }
    }
    for (int r = 0; r < tile; r++) result[r] = row_scale * horizontal_sum(acc[r]) + offset[r];
}

// Output n of `tile` rows, plus the bias, stored as float32 or bfloat16 (out_bf16) at out[r * n_out + n].
static inline __attribute__((always_inline)) void tile_dot(
        int format, int tile, const void *qs, const void *scales, const void *mins, int64_t n, int64_t k,
        const int8_t *xq, const float *xd, const float *xs, const void *bias, int out_bf16, void *out,
        int64_t n_out) {
    const int64_t blocks = k / BLOCK;
    const int8_t *qs8 = (const int8_t *)qs + n * k;
    const uint8_t *qs4 = (const uint8_t *)qs + n * (k / 2);
    const uint16_t *row_scales = format == INT8 ? 0 : (const uint16_t *)scales + n * blocks;
    const uint16_t *row_mins = format == Q4_1 ? (const uint16_t *)mins + n * blocks : 0;
    const float row_scale = format == INT8 ? ((const float *)scales)[n] : 1.0f;
    float result[ROW_TILE];
    row_dot(format, tile, qs8, qs4, row_scales, row_mins, row_scale, xq, xd, xs, k, result);
    const float b = bias == 0 ? 0.0f : out_bf16 ? bf16_to_float(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
    for (int r = 0; r < tile; r++) {
        if (out_bf16)
            ((uint16_t *)out)[r * n_out + n] = float_to_bf16(result[r] + b);
        else
            ((float *)out)[r * n_out + n] = result[r] + b;
    }
}

// Specialized per format and tile height so that the compiler keeps the accumulators in registers.
#define TILE_CASES(FORMAT)                                                                                   \
    switch (tile) {                                                                                          \
    case 1: tile_dot(FORMAT, 1, qs, scales, mins, n, k, xq_t, xd_t, xs_t, bias, x_bf16, out_t, n_out); break; \
    case 2: tile_dot(FORMAT, 2, qs, scales, mins, n, k, xq_t, xd_t, xs_t, bias, x_bf16, out_t, n_out); break; \
    case 3: tile_dot(FORMAT, 3, qs, scales, mins, n, k, xq_t, xd_t, xs_t, bias, x_bf16, out_t, n_out); break; \
    default: tile_dot(FORMAT, 4, qs, scales, mins, n, k, xq_t, xd_t, xs_t, bias, x_bf16, out_t, n_out); break; \
    }

// out [rows, n_out] = x [rows, k] @ W^T + bias, for W [n_out, k] in `format`: qs (int8 [n_out, k] or
// nibbles [n_out, k / 2]), scales (fp16 [n_out, k / 32], or float32 [n_out] for int8), mins (fp16
// [n_out, k / 32], Q4_1 only). x (row stride x_stride), bias (or NULL) and out are float32, or bfloat16 when
// x_bf16. The activations are quantized first (quantize_activations), once, before the parallel region.
void quant_gemm(int format, const void *x, int x_bf16, int64_t x_stride, int64_t rows, const void *qs,
                const void *scales, const void *mins, const void *bias, void *out, int64_t n_out, int64_t k,
                int num_threads) {
    const int64_t blocks = k / BLOCK;
    int8_t *xq = malloc((size_t)(rows * k));
    float *xd = malloc(sizeof(float) * (size_t)(2 * rows * blocks));
    float *xs = xd + rows * blocks;
    quantize_activations(x, x_bf16, x_stride, rows, k, xq, xd, xs);
    const size_t out_size = x_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int tile = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            const int8_t *xq_t = xq + r0 * k;
            const float *xd_t = xd + r0 * blocks, *xs_t = xs + r0 * blocks;
            void *out_t = (char *)out + (size_t)(r0 * n_out) * out_size;
            switch (format) {
            case Q8_0: TILE_CASES(Q8_0) break;
            case Q4_0: TILE_CASES(Q4_0) break;
            case Q4_1: TILE_CASES(Q4_1) break;
            default: TILE_CASES(INT8) break;
            }
        }
    }
    free(xq);
    free(xd);
}

// One dequantized weight value stored as float32, or bfloat16 when out_bf16.
static inline void store_value(void *out, int out_bf16, int64_t index, float value) {
    if (out_bf16)
        ((uint16_t *)out)[index] = float_to_bf16(value);
    else
        ((float *)out)[index] = value;
}

// The weight as float32 (or bfloat16 when out_bf16) [n_out, k], for batches too large for quant_gemm
// (prompt chunks).
void dequantize_weight(int format, const void *qs, const void *scales, const void *mins, void *out, int out_bf16,
                       int64_t n_out, int64_t k, int num_threads) {
    const int64_t blocks = k / BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        if (format == INT8) {
            const float scale = ((const float *)scales)[n];
            const int8_t *q = (const int8_t *)qs + n * k;
            for (int64_t i = 0; i < k; i++) store_value(out, out_bf16, n * k + i, scale * (float)q[i]);
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            const float d = half_to_float(((const uint16_t *)scales)[n * blocks + b]);
            const int64_t first = n * k + b * BLOCK;
            if (format == Q8_0) {
                const int8_t *q = (const int8_t *)qs + first;
                for (int i = 0; i < BLOCK; i++) store_value(out, out_bf16, first + i, d * (float)q[i]);
                continue;
            }
            const uint8_t *q = (const uint8_t *)qs + n * (k / 2) + b * (BLOCK / 2);
            if (format == Q4_0) {
                for (int i = 0; i < BLOCK / 2; i++) {
                    store_value(out, out_bf16, first + i, d * (float)((q[i] & 0x0F) - 8));
                    store_value(out, out_bf16, first + i + BLOCK / 2, d * (float)((q[i] >> 4) - 8));
                }
                continue;
            }
            const float m = half_to_float(((const uint16_t *)mins)[n * blocks + b]);
            for (int i = 0; i < BLOCK / 2; i++) {
                store_value(out, out_bf16, first + i, d * (float)(q[i] & 0x0F) + m);
                store_value(out, out_bf16, first + i + BLOCK / 2, d * (float)(q[i] >> 4) + m);
            }
        }
    }
}

// Which dot product this build uses, for the kernel-path report: 1 = VNNI vpdpbusd, 0 = AVX2 vpmaddubsw.
int quant_gemm_uses_vnni(void) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return 1;
#else
    return 0;
#endif
}
