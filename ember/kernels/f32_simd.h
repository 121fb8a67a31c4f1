// float32 vectors for the float32 kernels: AVX-512F (16 lanes) where the build targets it, else AVX2 + FMA
// (8 lanes); the kernels are written once against these names. A vector exp shared by both widths.
#pragma once
#include <immintrin.h>
#include <stdint.h>

// The largest of 8 lanes (AVX's width, whatever the build's vectors).
static inline float max8(__m256 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

#ifdef __AVX512F__
#define LANES 16
typedef __m512 vfloat;
static inline vfloat vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
static inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
static inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
static inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline vfloat vfnmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vfloat vround(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
static inline float vmax_lane(vfloat v) { return _mm512_reduce_max_ps(v); }
// Bit i set where lane i of a equals lane i of b (ordered: NaN equals nothing; -0 equals +0).
static inline uint32_t vequal_lanes(vfloat a, vfloat b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
// 2^n for whole n in [-126, 127], through the exponent bits.
static inline vfloat vpow2(vfloat n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
#define LANES 8
typedef __m256 vfloat;
static inline vfloat vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
static inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
static inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
static inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat vfnmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vfloat vround(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float vsum(vfloat v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
static inline float vmax_lane(vfloat v) { return max8(v); }
static inline uint32_t vequal_lanes(vfloat a, vfloat b) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
}
static inline vfloat vpow2(vfloat n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

static inline vfloat vzero(void) { return vset1(0.0f); }

// out[j] = the sum of v[j]'s lanes, for 8 vectors at once, added in vsum's order (the halves' lanes, then pairs
// of those, then the last two) so that the sums are vsum's bit for bit: the float32 attention's scores, which
// greedy answers turn on, did not change with it.
static inline void vsum8(const vfloat v[8], float *out) {
    __m256 pairs[4];  // [v[2j]'s 4 sums of lanes i and i + 4 | v[2j + 1]'s]
    for (int j = 0; j < 4; j++) {
        __m256 a, b;
#ifdef __AVX512F__  // first the 512-bit halves, as _mm512_reduce_add_ps
        a = _mm256_add_ps(_mm512_castps512_ps256(v[2 * j]),
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[2 * j]), 1)));
        b = _mm256_add_ps(_mm512_castps512_ps256(v[2 * j + 1]),
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[2 * j + 1]), 1)));
#else
        a = v[2 * j];
        b = v[2 * j + 1];
#endif
        pairs[j] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    // Lanes 0 + 2 and 1 + 3 of each sum of four: [v0 v0 v2 v2 | v1 v1 v3 v3], then likewise for v4-v7.
    __m256 quads[2];
    for (int j = 0; j < 2; j++)
        quads[j] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // The last two of each: [v0 v2 v4 v6 | v1 v3 v5 v7], then in order.
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// exp(x) = 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 Taylor polynomial (relative error ~2e-7,
// float32's rounding); x clamped to [-87, 88] so that 2^n stays a normal float.
static inline vfloat vexp(vfloat x) {
    x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
    vfloat n = vround(vmul(x, vset1(1.44269504f)));
    vfloat r = vfnmadd(n, vset1(0.693145752f), x);
    r = vfnmadd(n, vset1(1.42860677e-6f), r);
    vfloat p = vset1(1.0f / 720);
    p = vfmadd(p, r, vset1(1.0f / 120));
    p = vfmadd(p, r, vset1(1.0f / 24));
    p = vfmadd(p, r, vset1(1.0f / 6));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.0f));
    p = vfmadd(p, r, vset1(1.0f));
    return vmul(p, vpow2(n));
}
