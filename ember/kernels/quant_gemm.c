// Quantized weights used as they are stored: y = x @ W^T for W in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1: 32 weights per block with an fp16 scale, plus an fp16 min for Q4_1 and Q5_1; Q4_K, Q5_K: super-blocks of 8
// such blocks whose scales and mins are 6-bit multiples of the super-block's fp16 d and dmin; Q6_K: 6-bit values, an
// 8-bit scale per 16 weights, times the super-block's d) or int8 with one float scale per output row ("int8"),
// dequantized in registers, never in memory.
//
// The activation rows are quantized first, as llama.cpp's Q8_0/Q8_1 activations: per block of 32, a float
// scale d = max|x| / 127, int8 values round(x / d) and their sum s = d * sum(q). A weight block then meets
// an activation block in one 32-wide integer dot product of unsigned 8-bit by signed 8-bit values
// (vpdpbusd with AVX512-VNNI or AVX-VNNI; vpmaddubsw + vpmaddwd on AVX2), and the block's scales multiply
// that integer in float:
//   Q8_0: dw * dx * dot(w, x)             (w signed: |w| times x carrying w's sign)
//   Q4_0: dw * (dx * dot(q, x) - 8 s)      (w = dw (q - 8), q the unsigned nibble)
//   Q4_1: dw * dx * dot(q, x) + mw * s     (w = dw q + mw; Q4_K alike with dw = d sc, mw = -dmin m)
//   Q5_0: dw * (dx * dot(q, x) - 16 s)     (w = dw (q - 16), q the nibble with its fifth bit; Q5_1, Q8_0_MIN
//                                           as Q4_1, Q5_K as Q4_K)
//   Q6_K: d * dx * (sc0 * dot0(v, x) + sc1 * dot1(v, x)) - dmin * m * s   (the block's halves of 16, each with its sc)
//   int8: row_scale * sum over blocks of dx * dot(w, x)
// Decode batches are a few rows, so the GEMV is made to run at the speed of reading the weight once per step:
// a weight row is read as groups of 8 blocks, each unpacked once into registers and dotted with up to
// ROW_TILE activation rows; the blocks' int32 partial sums stay in vector lanes and are reduced together once
// per group (block b in lane b), so that the group's 8 fp16 scales are converted by one vcvtph2ps and applied
// by one multiply-add per activation row; the float sum is reduced once per output. The activations are stored
// in the order the packed nibbles unpack in (quantize_activation_rows). Larger batches (prompt chunks) run on
// bfloat16 tiles over dequantized panels of the weight (quant_panel_gemm.c, bfloat16 with AMX or AVX512-BF16),
// or else dequantize the whole weight (dequantize_weight) for a float GEMM.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define ROW_TILE 4
#define GROUP 8  // blocks the GEMV unpacks at once (and Q4_K's super-block)

// INT8_PANELS: INT8's values stored as w + 128 in w8a8_panel_gemm.c's panel layout, for its batches only.
// Q4_K: GGUF's, its nibbles re-laid out in Q4_1's order per block at load (ember/kernels/quantized_weight.py):
// per super-block of 8 blocks, scales holds 8 block scales sc then 8 block mins m (bytes), mins d and dmin (fp16).
// Q6_K: GGUF's, its values unpacked at load to int8 v = q - 32 in order (as Q8_0's), w = d sc v - dmin m with an
// int8 sc per 16 weights and a uint8 m per 32 (0 in Q6_K's own rows; Q4_K rows fused with Q6_K ones take this
// form): per super-block, scales holds its 16 sc then 8 m (24 bytes), mins its d and dmin (fp16).
// Q5_0, Q5_1: GGUF's, each row its low 4 bits as Q4_0's nibbles, then their fifth bits as two 32-bit masks per pair
// of blocks (the low nibbles' weights of both blocks, then the high nibbles'; ember/kernels/quantized_weight.py).
// Q5_K: GGUF's, as Q4_K (its nibbles and scales) with Q5_0's masks. Q8_0_MIN: Q8_0 with an fp16 min per block
// (w = d q + m), the form Q5_1 rows fused with Q8_0 ones take.
enum weight_format {
    Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, INT8 = 3, INT8_PANELS = 4, Q4_K = 5, Q6_K = 6, Q5_0 = 7, Q5_1 = 8, Q5_K = 9,
    Q8_0_MIN = 10
};

// The formats of 4-bit values two per byte, in Q4_0's order within a block of 32.
static inline int nibble_format(int format) { return format == Q4_0 || format == Q4_1 || format == Q4_K; }

// The formats of 5-bit values: Q4_0's nibbles, then the fifth bits.
static inline int five_bit_format(int format) { return format == Q5_0 || format == Q5_1 || format == Q5_K; }

// The formats of Q4_K's super-block scales: 6-bit sc and m per block times fp16 d and dmin.
static inline int k_quant_scales(int format) { return format == Q4_K || format == Q5_K; }

// Either: the GEMV unpacks both alike (and pairs their activations' blocks).
static inline int packed_nibbles(int format) { return nibble_format(format) || five_bit_format(format); }

// The formats with an fp16 min per block of 32.
static inline int block_min_format(int format) { return format == Q4_1 || format == Q5_1 || format == Q8_0_MIN; }

// Bytes of one weight row of k values (blocks of 32) as stored.
static inline int64_t weight_row_bytes(int format, int64_t k) {
    const int64_t blocks = k / BLOCK;
    if (five_bit_format(format)) return blocks * BLOCK / 2 + (blocks + 1) / 2 * 8;
    return nibble_format(format) ? k / 2 : k;
}

// A 32-bit mask of fifth bits as 32 bytes: byte i is 16 where bit i is set, else 0.
static inline __m256i fifth_bits(uint32_t mask) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8(_cvtu32_mask32(mask), _mm256_set1_epi8(16));
#else
    // Byte i takes mask byte i / 8, then its bit i % 8.
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)mask),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
}

// Block b's 32 fifth bits (bit i: weight i's) from a five-bit row of `blocks` blocks: its halves of its pair's masks.
static inline uint32_t block_fifth_bits(const uint8_t *row, int64_t blocks, int64_t b) {
    uint32_t masks[2];  // the pair's: the low nibbles' weights (0-15 of each block), then the high ones' (16-31)
    memcpy(masks, row + blocks * (BLOCK / 2) + b / 2 * 8, sizeof masks);
    const int shift = (int)(b % 2) * 16;
    return ((masks[0] >> shift) & 0xFFFF) | ((masks[1] >> shift) & 0xFFFF) << 16;
}

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Q4_K's 8 block scales (d sc) and mins (-dmin m) of one super-block, as float32 (as ggml's dequantizer).
static inline void q4_k_scales(const uint8_t *block_values, const uint16_t *d_dmin, __m256 *scales, __m256 *mins) {
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)block_values)));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block_values + 8))));
    *scales = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d_dmin[0])), sc);
    *mins = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d_dmin[1])), m), _mm256_set1_ps(-0.0f));
}

// Block b of weight row n (of `blocks`) as w = scale q + min, in float32: Q8_0/Q4_0/Q5_0 (min 0; the offset of
// Q4_0's and Q5_0's q apart), Q4_1, Q5_1, Q8_0_MIN, Q4_K and Q5_K (d sc and -(dmin m), as q4_k_scales).
static inline void block_scale_min(int format, const void *scales, const void *mins, int64_t n, int64_t blocks,
                                   int64_t b, float *scale, float *min) {
    if (k_quant_scales(format)) {
        const int64_t super = n * (blocks / GROUP) + b / GROUP;
        const uint8_t *values = (const uint8_t *)scales + super * 16;
        const uint16_t *d_dmin = (const uint16_t *)mins + super * 2;
        *scale = half_to_float(d_dmin[0]) * (float)values[b % GROUP];
        *min = -(half_to_float(d_dmin[1]) * (float)values[GROUP + b % GROUP]);
        return;
    }
    *scale = half_to_float(((const uint16_t *)scales)[n * blocks + b]);
    *min = block_min_format(format) ? half_to_float(((const uint16_t *)mins)[n * blocks + b]) : 0.0f;
}

// Q6_K: the scale d sc of weight row n's 16 weights `half` (of k / 16), in float32 (as ggml's dequantizer).
static inline float q6_k_half_scale(const void *scales, const void *mins, int64_t n, int64_t k, int64_t half) {
    const int64_t super = n * (k / (GROUP * BLOCK)) + half / (GROUP * 2);
    return half_to_float(((const uint16_t *)mins)[2 * super]) * (float)((const int8_t *)scales)[super * 24 + half % 16];
}

// Q6_K: the min -(dmin m) of weight row n's block b, in float32 (as ggml's Q4_K dequantizer; 0 in Q6_K's rows).
static inline float q6_k_block_min(const void *scales, const void *mins, int64_t n, int64_t k, int64_t b) {
    const int64_t super = n * (k / (GROUP * BLOCK)) + b / GROUP;
    return -(half_to_float(((const uint16_t *)mins)[2 * super + 1]) *
             (float)((const uint8_t *)scales)[super * 24 + 16 + b % GROUP]);
}

// (Named apart from fused_ops.c's bf16_to_float: decoder_stack_quant.c includes both files.)
static inline float bfloat16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t float_to_bfloat16(float value) {  // round to nearest even, as torch's conversion
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Quantized activations of `rows` rows, laid out for the GEMV below: per row, q holds
// activation_blocks(k) * BLOCK int8 values, d and s activation_blocks(k) block scales and sums; the blocks
// past k / BLOCK are zeros, so that the GEMV reads whole groups of GROUP blocks. With `paired` (packed_nibbles),
// each pair of blocks (2j, 2j + 1) is stored as the low halves of both, then the high halves of both: the order
// in which one 32-byte load of the pair's packed nibbles yields them (low nibbles, then high nibbles).

static inline int64_t activation_blocks(int64_t k) { return (k / BLOCK + GROUP - 1) / GROUP * GROUP; }

typedef struct {
    int8_t *q;
    float *d, *s;
} quantized_activations;

// 8 activations from x (float32, or bfloat16 when x_bf16) at index `at`, as float32.
static inline __m256 load_activations(const void *x, int x_bf16, int64_t at) {
    if (!x_bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
}

static inline float horizontal_max(__m256 v) {
    __m128 max4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
    return _mm_cvtss_f32(_mm_max_ss(max4, _mm_movehdup_ps(max4)));
}

// Activation rows [rows, k] (row stride x_stride; float32, or bfloat16 when x_bf16) -> a's rows
// [first, last), a block of 32 in four vectors of 8: d = max|x| / 127, q = x * (1 / d) rounded half to even
// (the rounding mode's default, as the tests' reference's nearbyintf), s = d * sum(q).
static void quantize_activation_rows(const void *x, int x_bf16, int64_t x_stride, int64_t first, int64_t last,
                                     int64_t k, int paired, quantized_activations a) {
    const int64_t blocks = k / BLOCK, stride = activation_blocks(k);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t r = first; r < last; r++) {
        int8_t *row_q = a.q + r * stride * BLOCK;
        memset(row_q + blocks * BLOCK, 0, (size_t)((stride - blocks) * BLOCK));
        for (int64_t b = blocks; b < stride; b++) a.d[r * stride + b] = a.s[r * stride + b] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            __m256 src[4];
            __m256 amax = _mm256_setzero_ps();
            for (int v = 0; v < 4; v++) {
                src[v] = load_activations(x, x_bf16, r * x_stride + b * BLOCK + v * 8);
                amax = _mm256_max_ps(amax, _mm256_and_ps(src[v], magnitude));
            }
            const float d = horizontal_max(amax) / 127.0f;
            const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4], sum = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                q[v] = _mm256_cvtps_epi32(_mm256_mul_ps(src[v], inverse));
                sum = _mm256_add_epi32(sum, q[v]);
            }
            // int32 -> int8 (no saturation happens: |q| <= 127); the packs interleave 128-bit lanes, the
            // permute puts values 0-31 back in order.
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // Paired: pair b / 2 takes 2 * BLOCK bytes, values 0-15 of block b at offset 16 (b % 2), 16-31 after
            // both blocks' first halves.
            int8_t *low = row_q + (paired ? (b / 2) * 2 * BLOCK + (b % 2) * 16 : b * BLOCK);
            _mm_storeu_si128((__m128i *)low, _mm256_castsi256_si128(bytes));
            _mm_storeu_si128((__m128i *)(low + (paired ? BLOCK : 16)), _mm256_extracti128_si256(bytes, 1));
            __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(1, 0, 3, 2)));
            sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(2, 3, 0, 1)));
            a.d[r * stride + b] = d;
            a.s[r * stride + b] = d * (float)_mm_cvtsi128_si32(sum4);
        }
    }
}

// u (unsigned bytes) times s (signed bytes) added to the 8 int32 lanes of acc, 4 products per lane.
static inline __m256i dot_u8_s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    // No overflow: |products| <= 128 * 127, two per 16-bit lane.
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// u0 . s0 + u1 . s1 in the 8 int32 lanes, 8 products per lane, for unsigned values of at most 5 bits (packed
// nibbles, with a fifth bit): without VNNI the two vpmaddubsw's int16 sums add before one vpmaddwd
// (|4 x 31 x 127| < 2^15).
static inline __m256i dot_two_u5_s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return dot_u8_s8(dot_u8_s8(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
#endif
}

static inline float horizontal_sum(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

// A group of GROUP blocks of one weight row, unpacked once and dotted with every activation row of a tile:
// Q4_0/Q4_1 as four pairs (u[2j]: both blocks' low nibbles, u[2j + 1]: their high nibbles), Q8_0/int8 as
// eight blocks (u: |w|, w: the signed values, whose signs move onto the activations). Blocks past `count`
// are zeros, and so are the first `dead` (even; counted already by the group before); scales and mins are
// float32 (1 for int8, whose scale is the row's).
typedef struct {
    __m256i u[GROUP], w[GROUP];
    __m256 scales, mins;
    __m256i half_scales[2];  // Q6_K: the sc of blocks 0-3's first halves then of their second halves; 4-7's
} weight_group;

static inline __attribute__((always_inline)) void load_group(int format, const void *values, const uint8_t *masks,
                                                             const void *row_scales, const void *row_mins, int64_t b,
                                                             int count, int dead, weight_group *g) {
    if (packed_nibbles(format)) {
        const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
        for (int j = 0; j < GROUP / 2; j++) {
            if (2 * j < dead) {
                g->u[2 * j] = g->u[2 * j + 1] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *pair = (const uint8_t *)values + j * BLOCK;
            // A lone last block (odd count) loads its own 16 bytes only: the pair's second half stays zero.
            const __m256i packed = 2 * j + 1 < count ? _mm256_loadu_si256((const __m256i *)pair)
                                   : 2 * j < count ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)pair))
                                                   : _mm256_setzero_si256();
            g->u[2 * j] = _mm256_and_si256(packed, low_nibbles);
            g->u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
            if (five_bit_format(format) && 2 * j < count) {  // masks: the group's pairs' (zeros past a lone block)
                uint32_t pair_masks[2];
                memcpy(pair_masks, masks + 8 * j, sizeof pair_masks);
                g->u[2 * j] = _mm256_or_si256(g->u[2 * j], fifth_bits(pair_masks[0]));
                g->u[2 * j + 1] = _mm256_or_si256(g->u[2 * j + 1], fifth_bits(pair_masks[1]));
            }
        }
    } else {
        for (int b = 0; b < GROUP; b++) {
            g->w[b] = dead <= b && b < count ? _mm256_loadu_si256((const __m256i *)((const int8_t *)values + b * BLOCK))
                                             : _mm256_setzero_si256();
            g->u[b] = _mm256_sign_epi8(g->w[b], g->w[b]);
        }
    }
    if (format == INT8) {
        g->scales = _mm256_set1_ps(1.0f);
        return;
    }
    if (k_quant_scales(format)) {  // a group is one super-block (k is a multiple of 256)
        q4_k_scales((const uint8_t *)row_scales + b / GROUP * 16, (const uint16_t *)row_mins + b / GROUP * 2,
                    &g->scales, &g->mins);
        return;
    }
    if (format == Q6_K) {  // one super-block too: 16 sc (block b's halves at 2b and 2b + 1), 8 m, d and dmin
        const int8_t *sc_m = (const int8_t *)row_scales + b / GROUP * 24;
        const uint16_t *d_dmin = (const uint16_t *)row_mins + b / GROUP * 2;
        const __m128i sc = _mm_loadu_si128((const __m128i *)sc_m);
        const __m256i halves_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        g->half_scales[0] = _mm256_permutevar8x32_epi32(_mm256_cvtepi8_epi32(sc), halves_first);
        g->half_scales[1] = _mm256_permutevar8x32_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)), halves_first);
        g->scales = _mm256_set1_ps(half_to_float(d_dmin[0]));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc_m + 16))));
        g->mins = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(d_dmin[1])), m), _mm256_set1_ps(-0.0f));
        return;
    }
    const uint16_t *scales = (const uint16_t *)row_scales + b, *mins = row_mins ? (const uint16_t *)row_mins + b : 0;
    uint16_t tail[2][GROUP] = {{0}};  // a partial group's scales and mins, zero past `count`
    if (count < GROUP) {
        memcpy(tail[0], scales, sizeof(uint16_t) * (size_t)count);
        if (block_min_format(format)) memcpy(tail[1], mins, sizeof(uint16_t) * (size_t)count);
        scales = tail[0];
        mins = tail[1];
    }
    g->scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));  // one vcvtph2ps per 8 blocks
    if (block_min_format(format)) g->mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mins));
}

// The group's 8 integer block dot products with one activation row's group (xq: its GROUP * BLOCK bytes),
// block b in lane b (0 in the first `dead`). The per-block int32 partial sums are reduced together, once per group.
static inline __attribute__((always_inline)) __m256i group_dots(int format, const weight_group *g, int dead,
                                                                 const int8_t *xq) {
    if (packed_nibbles(format)) {
        __m256i pair[GROUP / 2];  // lanes 0-3: block 2j's partial sums, lanes 4-7: block 2j + 1's
        for (int j = 0; j < GROUP / 2; j++) {
            if (2 * j < dead) {
                pair[j] = _mm256_setzero_si256();
                continue;
            }
            const __m256i low = _mm256_loadu_si256((const __m256i *)(xq + 2 * j * BLOCK));
            const __m256i high = _mm256_loadu_si256((const __m256i *)(xq + 2 * j * BLOCK + BLOCK));
            pair[j] = dot_two_u5_s8(g->u[2 * j], low, g->u[2 * j + 1], high);
        }
        // Lanes: [b0 b0 b2 b2 | b1 b1 b3 b3], [b4 b4 b6 b6 | b5 b5 b7 b7], then [b0 b2 b4 b6 | b1 b3 b5 b7].
        const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(pair[0], pair[1]), _mm256_hadd_epi32(pair[2], pair[3]));
        return _mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    }
    __m256i block[GROUP];
    for (int b = 0; b < GROUP; b++) {
        if (b < dead) {
            block[b] = _mm256_setzero_si256();
            continue;
        }
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
        block[b] = dot_u8_s8(_mm256_setzero_si256(), g->u[b], _mm256_sign_epi8(x, g->w[b]));
    }
    // Lanes: [b0 b1 b2 b3 | b0 b1 b2 b3] (each half of each block's lanes), likewise for b4-b7, then added.
    __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(block[0], block[1]), _mm256_hadd_epi32(block[2], block[3]));
    __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(block[4], block[5]), _mm256_hadd_epi32(block[6], block[7]));
    if (format == Q6_K) {  // each half times its integer scale: |16 * 127 * 32 * 128| < 2^31, exact
        low = _mm256_mullo_epi32(low, g->half_scales[0]);
        high = _mm256_mullo_epi32(high, g->half_scales[1]);
    }
    return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

// acc += the group's float terms for one activation row (xd, xs: its GROUP block scales and sums):
//   Q8_0: dw dx dot, Q4_0: dw (dx dot - 8 s), Q5_0: dw (dx dot - 16 s), Q4_1/Q5_1: dw dx dot + mw s, int8: dx dot
// (its dw: 1, or 0 in a lane masked off).
static inline __attribute__((always_inline)) __m256 group_terms(int format, const weight_group *g, __m256i dots,
                                                                const float *xd, const float *xs, __m256 acc) {
    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_loadu_ps(xd));
    if (format == Q4_0 || format == Q5_0) {
        const __m256 offset = _mm256_set1_ps(format == Q4_0 ? 8.0f : 16.0f);
        return _mm256_fmadd_ps(g->scales, _mm256_fnmadd_ps(offset, _mm256_loadu_ps(xs), scaled), acc);
    }
    acc = _mm256_fmadd_ps(g->scales, scaled, acc);
    if (block_min_format(format) || k_quant_scales(format) || format == Q6_K)
        acc = _mm256_fmadd_ps(g->mins, _mm256_loadu_ps(xs), acc);
    return acc;
}

// acc[r] += the terms of the `count` blocks from block b of one weight row (row_bytes bytes from `values`; a five-bit
// row's masks from `masks`) for activation rows r < tile, less its first `dead` blocks, counted already (their
// lanes zeroed); prefetches the same bytes PREFETCH_ROWS weight rows ahead.
#define PREFETCH_ROWS 4

static inline __attribute__((always_inline)) void group_step(
        int format, int tile, const char *values, const uint8_t *masks, const void *row_scales, const void *row_mins,
        int64_t b, int count, int dead, int64_t row_bytes, quantized_activations a, int64_t stride, __m256 *acc) {
    const int64_t block_bytes = packed_nibbles(format) ? BLOCK / 2 : BLOCK;
    const char *group_values = values + b * block_bytes;
    const uint8_t *group_masks = five_bit_format(format) ? masks + b / 2 * 8 : NULL;
    for (int64_t line = 0; line < GROUP * block_bytes; line += 64)
        _mm_prefetch(group_values + PREFETCH_ROWS * row_bytes + line, _MM_HINT_T0);
    if (group_masks) _mm_prefetch((const char *)group_masks + PREFETCH_ROWS * row_bytes, _MM_HINT_T0);
    weight_group g;
    load_group(format, group_values, group_masks, row_scales, row_mins, b, count, dead, &g);
    if (dead) {
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(dead - 1)));
        g.scales = _mm256_and_ps(keep, g.scales);
        if (block_min_format(format) || k_quant_scales(format) || format == Q6_K) g.mins = _mm256_and_ps(keep, g.mins);
    }
    for (int r = 0; r < tile; r++)
        acc[r] = group_terms(format, &g, group_dots(format, &g, dead, a.q + (r * stride + b) * BLOCK),
                             a.d + r * stride + b, a.s + r * stride + b, acc[r]);
}

// Weight rows [n_first, n_last) against activation rows [0, tile) of `a`: out[r * n_out + n] = x_r . w_n + bias[n],
// stored as float32 or bfloat16 (out_bf16). Each weight group is read once and dotted with the tile's rows while
// its unpacked values sit in registers. What depends on k only is worked out once for all the rows.
static inline __attribute__((always_inline)) void weight_rows_dot(
        int format, int tile, const void *qs, const void *scales, const void *mins, int64_t n_first, int64_t n_last,
        int64_t k, quantized_activations a, const void *bias, int out_bf16, void *out, int64_t n_out) {
    const int64_t blocks = k / BLOCK, stride = activation_blocks(k), row_bytes = weight_row_bytes(format, k);
    // Whole groups (a constant count: no per-block tests). Where the row ends in a partial group, one more whole
    // group ends at the row's last block instead, skipping the blocks counted already, if it starts at a block
    // pair (the activations' layout pairs blocks 2j and 2j + 1); else the rest runs as a partial group, whose
    // scales are padded through memory: with k = 576 (18 blocks) that one took as long as the two others.
    const int64_t whole = blocks / GROUP * GROUP, rest = blocks - whole;
    const int overlap = whole > 0 && rest > 0 && (blocks - GROUP) % 2 == 0;
    const int dead = overlap ? (int)(GROUP - rest) : 0;
    for (int64_t n = n_first; n < n_last; n++) {
        const char *values = (const char *)qs + n * row_bytes;
        const uint8_t *masks = (const uint8_t *)values + blocks * BLOCK / 2;  // five-bit rows' (past the nibbles)
        // This row's scales and mins: per block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0_MIN) or per super-block (Q4_K
        // and Q5_K: 16 bytes of sc and m, Q6_K: 24; all three: fp16 d and dmin).
        const void *row_scales = 0, *row_mins = 0;
        if (k_quant_scales(format) || format == Q6_K) {
            row_scales = (const uint8_t *)scales + n * blocks / GROUP * (format == Q6_K ? 24 : 16);
            row_mins = (const uint16_t *)mins + n * blocks / GROUP * 2;
        } else if (format != INT8) {
            row_scales = (const uint16_t *)scales + n * blocks;
            if (block_min_format(format)) row_mins = (const uint16_t *)mins + n * blocks;
        }
        __m256 acc[ROW_TILE];
        for (int r = 0; r < tile; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < whole; b += GROUP)
            group_step(format, tile, values, masks, row_scales, row_mins, b, GROUP, 0, row_bytes, a, stride, acc);
        if (overlap)
            group_step(format, tile, values, masks, row_scales, row_mins, blocks - GROUP, GROUP, dead, row_bytes, a,
                       stride, acc);
        else if (rest > 0)
            group_step(format, tile, values, masks, row_scales, row_mins, whole, (int)rest, 0, row_bytes, a, stride,
                       acc);
        const float row_scale = format == INT8 ? ((const float *)scales)[n] : 1.0f;
        const float bias_n = bias == 0 ? 0.0f : out_bf16 ? bfloat16_to_float(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
        for (int r = 0; r < tile; r++) {
            const float result = row_scale * horizontal_sum(acc[r]) + bias_n;
            if (out_bf16)
                ((uint16_t *)out)[r * n_out + n] = float_to_bfloat16(result);
            else
                ((float *)out)[r * n_out + n] = result;
        }
    }
}

// Specialized per format and tile height so that the compiler keeps the accumulators in registers.
#define TILE_CASES(FORMAT)                                                                                        \
    switch (tile) {                                                                                               \
    case 1: weight_rows_dot(FORMAT, 1, qs, scales, mins, n0, n1, k, a_t, bias, out_bf16, out_t, n_out); break;    \
    case 2: weight_rows_dot(FORMAT, 2, qs, scales, mins, n0, n1, k, a_t, bias, out_bf16, out_t, n_out); break;    \
    case 3: weight_rows_dot(FORMAT, 3, qs, scales, mins, n0, n1, k, a_t, bias, out_bf16, out_t, n_out); break;    \
    default: weight_rows_dot(FORMAT, 4, qs, scales, mins, n0, n1, k, a_t, bias, out_bf16, out_t, n_out); break;   \
    }

// Weight rows taken through all the activation tiles at a time: they stay in L1 from one tile to the next.
#define ROW_CHUNK 16

// Weight rows [n_first, n_last) of out [rows, n_out] = x @ W^T + bias, from x quantized into `a`
// (quantize_activation_rows with paired = packed_nibbles(format)): what one thread of a parallel region
// does. A weight row is read from memory once, then from cache for the next ROW_TILE activation rows.
static void quant_gemm_rows(int format, quantized_activations a, int64_t rows, const void *qs, const void *scales,
                            const void *mins, const void *bias, int out_bf16, void *out, int64_t n_out, int64_t k,
                            int64_t n_first, int64_t n_last) {
    const int64_t stride = activation_blocks(k);
    const size_t out_size = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    // One tile (decode's few rows): all the thread's weight rows in one call.
    const int64_t chunk = rows <= ROW_TILE ? n_last - n_first : ROW_CHUNK;
    for (int64_t n0 = n_first; n0 < n_last; n0 += chunk) {
        const int64_t n1 = n0 + chunk < n_last ? n0 + chunk : n_last;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int tile = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            const quantized_activations a_t = {a.q + r0 * stride * BLOCK, a.d + r0 * stride, a.s + r0 * stride};
            void *out_t = (char *)out + (size_t)(r0 * n_out) * out_size;
            switch (format) {
            case Q8_0: TILE_CASES(Q8_0) break;
            case Q4_0: TILE_CASES(Q4_0) break;
            case Q4_1: TILE_CASES(Q4_1) break;
            case Q4_K: TILE_CASES(Q4_K) break;
            case Q6_K: TILE_CASES(Q6_K) break;
            case Q5_0: TILE_CASES(Q5_0) break;
            case Q5_1: TILE_CASES(Q5_1) break;
            case Q5_K: TILE_CASES(Q5_K) break;
            case Q8_0_MIN: TILE_CASES(Q8_0_MIN) break;
            default: TILE_CASES(INT8) break;
            }
        }
    }
}

#include "w8a8_f32_gemm.c"

// A Linear's quantized weight as quant_gemm_share takes it (quant_gemm's arguments of the same names), with
// the scratch its activations are quantized into: room for `scratch_rows` rows of activation_blocks(k) blocks.
// All fields 8 bytes wide, so that Python lays a table of them out as int64 (decoder_stack_quant.c's layers).
typedef struct {
    int64_t format;
    const void *qs, *scales, *mins;
    int8_t *xq;
    float *xd, *xs;
    int64_t scratch_rows;
} quant_linear;

// out [rows, n_out] = x [rows, k] @ W^T + bias (as quant_gemm) from inside a parallel region: every thread
// quantizes its share of the activation rows into w's scratch, then, after a barrier, computes a contiguous run
// of weight rows (one sequential read of its part of the weight). No barrier at the end: callers inside a
// region add one (decoder_stack_quant.c).
static void quant_gemm_share(const quant_linear *w, const void *x, int x_bf16, int64_t x_stride, const void *bias,
                             void *out, int64_t rows, int64_t n_out, int64_t k) {
    const int format = (int)w->format;
    if (format == INT8_PANELS && !x_bf16) {  // float32 batches on int8 copies (no barrier: see w8a8_f32_gemm.c)
        w8a8_f32_gemm_share(w->qs, w->scales, x, x_stride, bias, out, (int)rows, n_out, k);
        return;
    }
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const quantized_activations a = {w->xq, w->xd, w->xs};
    quantize_activation_rows(x, x_bf16, x_stride, rows * thread / threads, rows * (thread + 1) / threads, k,
                             packed_nibbles(format), a);
#pragma omp barrier
    quant_gemm_rows(format, a, rows, w->qs, w->scales, w->mins, bias, x_bf16, out, n_out, k,
                    n_out * thread / threads, n_out * (thread + 1) / threads);
}

// Bytes of scratch a quant_linear needs for up to `rows` rows of width up to k.
int64_t quant_linear_scratch_bytes(int64_t rows, int64_t k) {
    return rows * activation_blocks(k) * (BLOCK + 2 * (int64_t)sizeof(float));
}

// Fills *w for a weight (quant_gemm's arguments) and a scratch of quant_linear_scratch_bytes(rows, k) bytes,
// which Linears run one after another may share.
void quant_linear_init(quant_linear *w, int format, const void *qs, const void *scales, const void *mins,
                       void *scratch, int64_t rows, int64_t k) {
    const int64_t values = rows * activation_blocks(k);
    *w = (quant_linear){format, qs, scales, mins, scratch, 0, 0, rows};
    w->xd = (float *)((int8_t *)scratch + values * BLOCK);
    w->xs = w->xd + values;
}

// out [rows, n_out] = x [rows, k] @ W^T + bias, for W [n_out, k] in `format`: qs (rows of weight_row_bytes), scales
// and mins (or NULL) as the formats above hold them (fp16 [n_out, k / 32] per block; float32 [n_out] scales for
// int8). x (row stride x_stride), bias (or NULL) and out are float32, or bfloat16 when x_bf16.
void quant_gemm(int format, const void *x, int x_bf16, int64_t x_stride, int64_t rows, const void *qs,
                const void *scales, const void *mins, const void *bias, void *out, int64_t n_out, int64_t k,
                int num_threads) {
    void *scratch = malloc((size_t)quant_linear_scratch_bytes(rows, k));
    quant_linear w;
    quant_linear_init(&w, format, qs, scales, mins, scratch, rows, k);
#pragma omp parallel num_threads(num_threads)
    quant_gemm_share(&w, x, x_bf16, x_stride, bias, out, rows, n_out, k);
    free(scratch);
}

// One dequantized weight value stored as float32, or bfloat16 when out_bf16.
static inline void store_value(void *out, int out_bf16, int64_t index, float value) {
    if (out_bf16)
        ((uint16_t *)out)[index] = float_to_bfloat16(value);
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
        if (format == Q6_K) {
            const int8_t *q = (const int8_t *)qs + n * k;
            for (int64_t i = 0; i < k; i++) {  // multiply, then add: the panels' arithmetic
                const float scale = q6_k_half_scale(scales, mins, n, k, i / 16);
                store_value(out, out_bf16, n * k + i, scale * (float)q[i] + q6_k_block_min(scales, mins, n, k, i / 32));
            }
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            float d, m;
            block_scale_min(format, scales, mins, n, blocks, b, &d, &m);
            const int64_t first = n * k + b * BLOCK;
            if (format == Q8_0 || format == Q8_0_MIN) {  // multiply, then add: the panels' arithmetic
                const int8_t *q = (const int8_t *)qs + first;
                for (int i = 0; i < BLOCK; i++)
                    store_value(out, out_bf16, first + i, format == Q8_0 ? d * (float)q[i] : d * (float)q[i] + m);
                continue;
            }
            const uint8_t *row = (const uint8_t *)qs + n * weight_row_bytes(format, k);
            const uint8_t *q = row + b * (BLOCK / 2);
            if (five_bit_format(format)) {
                const uint32_t fifth = block_fifth_bits(row, blocks, b);
                for (int i = 0; i < BLOCK / 2; i++) {
                    const int low = (q[i] & 0x0F) | (int)((fifth >> i) & 1) << 4;
                    const int high = (q[i] >> 4) | (int)((fifth >> (BLOCK / 2 + i)) & 1) << 4;
                    // multiply, then add: the panels' arithmetic
                    store_value(out, out_bf16, first + i, format == Q5_0 ? d * (float)(low - 16) : d * (float)low + m);
                    store_value(out, out_bf16, first + i + BLOCK / 2,
                                format == Q5_0 ? d * (float)(high - 16) : d * (float)high + m);
                }
                continue;
            }
            if (format == Q4_0) {
                for (int i = 0; i < BLOCK / 2; i++) {
                    store_value(out, out_bf16, first + i, d * (float)((q[i] & 0x0F) - 8));
                    store_value(out, out_bf16, first + i + BLOCK / 2, d * (float)((q[i] >> 4) - 8));
                }
                continue;
            }
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
