// Quantized weights (quant_gemm.c's formats) times batches of bfloat16 rows: prompt chunks and large decode
// steps, where quant_gemm.c's integer GEMV does the arithmetic of every row on vectors and the tiles of the
// bfloat16 GEMMs would be several times faster, were the weight bfloat16.
//
// So each thread takes a run of 32-output panels of the weight and, one panel at a time, dequantizes it into
// its cache in the bfloat16 GEMMs' VNNI layout ([2][K / 2][16][2], see amx_gemm.c), then multiplies every row of
// x by it with amx_gemm.c's tiles (AMX) or bf16_gemm.c's (AVX512-BF16). The weight leaves memory once per call,
// as stored (4.5 to 8.8 bits a weight where bfloat16 takes 16): at 32 rows the dequantization costs less than
// the bytes it saves, and at prompt sizes the tiles' arithmetic dwarfs it. Values are dequantized as
// dequantize_weight does (w = d q (+ m) in float32, rounded to nearest even bfloat16), so the results are those of
// the bfloat16 GEMM on the dequantized weight: the activations stay bfloat16, unlike quant_gemm.c's int8 ones.
#include "quant_gemm.c"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_gemm.c"
#define PANEL_GEMM_AMX 1
#elif defined(__AVX512BF16__)
#include "bf16_gemm.c"
#define PANEL_GEMM_BF16 1
#endif

int quant_panel_gemm_supported(void) {
#if defined(PANEL_GEMM_AMX)
    return amx_gemm_supported();
#elif defined(PANEL_GEMM_BF16)
    return 1;
#else
    return 0;
#endif
}

#if defined(PANEL_GEMM_AMX) || defined(PANEL_GEMM_BF16)
#define PANEL 32  // outputs per panel: the GEMMs' pair of 16-output blocks

// Block b (32 values along k) of 8-bit weight row `row` (Q8_0, Q8_0_MIN, Q6_K, int8; the five-bit formats' unpacked
// values) as 32 bfloat16 in k order, as dequantize_weight computes them; d0, d1: the scales of its first and second
// 16 values (Q6_K's own; the block's, or the row's for int8, twice otherwise); min: added after the multiply, or
// NULL.
static inline __m512i dequantize_int8_block(const int8_t *q, float d0, float d1, const float *min) {
    // Multiply, then round once: dequantize_weight's arithmetic.
    __m512 first =
        _mm512_mul_ps(_mm512_set1_ps(d0), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
    __m512 second = _mm512_mul_ps(
        _mm512_set1_ps(d1), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    if (min) {
        first = _mm512_add_ps(first, _mm512_set1_ps(*min));
        second = _mm512_add_ps(second, _mm512_set1_ps(*min));
    }
    return (__m512i)_mm512_cvtne2ps_pbh(second, first);
}

// v[i] holds row i of a 16 x 16 matrix of 32-bit elements; afterwards, column i.
static inline void transpose_16x16_epi32(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    }
}

#if (defined(PANEL_GEMM_AMX) && defined(__AMX_INT8__)) || (defined(PANEL_GEMM_BF16) && defined(__AVX512VNNI__))
#define PANEL_W8A8 1
#include "w8a8_panel_gemm.c"
#endif

// 16 lines of the VNNI layout (line L: k-pair L of block b for 16 weight rows, 32 bfloat16) from the block's
// 8-bit values of those rows (row i at q + i * row_bytes): each row's block dequantized in k order is one vector
// of 16 k-pairs, and a 16 x 16 transpose of the pairs makes the lines. scales, second_scales: the 16 rows' scales
// of their block's first and second 16 values; mins: their blocks' mins (Q6_K) or NULL.
static inline void int8_lines(const int8_t *q, int64_t row_bytes, const float *scales, const float *second_scales,
                              const float *mins, uint16_t *lines) {
    __m512i v[16];
    for (int i = 0; i < 16; i++)
        v[i] = dequantize_int8_block(q + i * row_bytes, scales[i], second_scales[i], mins ? mins + i : NULL);
    transpose_16x16_epi32(v);
    for (int i = 0; i < 16; i++) _mm512_store_si512(lines + i * 32, v[i]);
}

// The same for Q4_0/Q4_1/Q4_K (byte j of a row's block: weight j in the low nibble, 16 + j in the high one), with the
// transpose done on the packed bytes: the 16-bit word j of a row holds weights (2j, 2j + 1) in its low nibbles
// and (16 + 2j, 17 + 2j) in its high ones, so a transpose of words (four two-source word permutes) gives lines
// j and 8 + j at once. Each line's 32 values: rows 0-7 then 8-15, in k-pairs, widened, scaled by the rows' d
// (and shifted by their m, or offset by 8) and rounded to bfloat16 by one instruction.
static inline void q4_lines(int format, const uint8_t *q, int64_t row_bytes, const float *scales, const float *mins,
                            uint16_t *lines) {
    __m512i rows[4];  // rows 4a .. 4a + 3, one per 128-bit lane
    for (int a = 0; a < 4; a++) {
        rows[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(q + 4 * a * row_bytes)));
        for (int l = 1; l < 4; l++)
            rows[a] = _mm512_inserti32x4(rows[a], _mm_loadu_si128((const __m128i *)(q + (4 * a + l) * row_bytes)), l);
    }
    // Word w of a permute's result: line (first + w / 8)'s word of row w % 8 (of rows 0-7 or 8-15).
    const __m512i lines_0_3 = _mm512_set_epi16(59, 51, 43, 35, 27, 19, 11, 3, 58, 50, 42, 34, 26, 18, 10, 2, 57, 49, 41,
                                               33, 25, 17, 9, 1, 56, 48, 40, 32, 24, 16, 8, 0);
    const __m512i lines_4_7 = _mm512_add_epi16(lines_0_3, _mm512_set1_epi16(4));
    // [nibble half][lines 0-3 or 4-7][rows 0-7 or 8-15]: 64 bytes, line (first + c)'s 16 bytes in chunk c.
    uint8_t bytes[2][2][2][64] __attribute__((aligned(64)));
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    for (int half = 0; half < 2; half++)
        for (int group = 0; group < 2; group++) {
            const __m512i words =
                _mm512_permutex2var_epi16(rows[2 * half], group ? lines_4_7 : lines_0_3, rows[2 * half + 1]);
            _mm512_store_si512(bytes[0][group][half], _mm512_and_si512(words, low_nibbles));
            _mm512_store_si512(bytes[1][group][half], _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles));
        }
    const __m512 d = _mm512_loadu_ps(scales);
    const __m512i first_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second_rows = _mm512_add_epi32(first_rows, _mm512_set1_epi32(8));
    const __m512 d_first = _mm512_permutexvar_ps(first_rows, d), d_second = _mm512_permutexvar_ps(second_rows, d);
    __m512 m_first = _mm512_setzero_ps(), m_second = _mm512_setzero_ps();
    if (format == Q4_1 || format == Q4_K) {
        const __m512 m = _mm512_loadu_ps(mins);
        m_first = _mm512_permutexvar_ps(first_rows, m);
        m_second = _mm512_permutexvar_ps(second_rows, m);
    }
    const __m512i offset = _mm512_set1_epi32(format == Q4_0 ? 8 : 0);
    for (int line = 0; line < 16; line++) {
        const uint8_t *chunk = bytes[line / 8][line % 8 / 4][0] + line % 4 * 16;
        __m512 first = _mm512_cvtepi32_ps(
            _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)chunk)), offset));
        __m512 second = _mm512_cvtepi32_ps(
            _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(chunk + 64))), offset));
        first = _mm512_mul_ps(d_first, first);  // multiply, then add: dequantize_weight's two roundings
        second = _mm512_mul_ps(d_second, second);
        if (format == Q4_1 || format == Q4_K) {
            first = _mm512_add_ps(first, m_first);
            second = _mm512_add_ps(second, m_second);
        }
        _mm512_store_si512(lines + line * 32, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
}

// The same for Q5_0/Q5_1/Q5_K: block b of 16 rows (row i at row + i * row_bytes, `blocks` blocks each) unpacked to
// int8 q (- 16 for Q5_0) in k order, then int8_lines' arithmetic with the rows' scales (and the others' mins).
static inline void q5_lines(int format, const uint8_t *row, int64_t blocks, int64_t b, int64_t row_bytes,
                            const float *scales, const float *mins, uint16_t *lines) {
    int8_t q[16][BLOCK] __attribute__((aligned(64)));
    const __m256i offset = _mm256_set1_epi8(format == Q5_0 ? 16 : 0);
    for (int i = 0; i < 16; i++) {
        const uint8_t *r = row + i * row_bytes;
        const __m128i packed = _mm_loadu_si128((const __m128i *)(r + b * (BLOCK / 2)));
        const __m256i nibbles = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));  // weights 0-15, 16-31
        const __m256i fifth = fifth_bits(block_fifth_bits(r, blocks, b));
        _mm256_store_si256((__m256i *)q[i], _mm256_sub_epi8(_mm256_or_si256(nibbles, fifth), offset));
    }
    int8_lines(&q[0][0], BLOCK, scales, scales, format == Q5_0 ? NULL : mins, lines);
}

// Weight rows [first, first + PANEL) as one panel of the VNNI layout, [2][k / 2][16][2] bfloat16. `scales`,
// `mins` (Q4_1, Q5_1, Q8_0_MIN, Q4_K, Q5_K, Q6_K) and `second_scales` (Q6_K: its blocks' second halves') are
// scratch for the panel's block scales as float32, [k / 32][PANEL]. The next panel's values
// (contiguous: rows follow each other) are requested into L2 along the way, a part per block, so that the
// loads of 16 or 32 rows' interleaved streams find them there.
static void dequantize_panel(int format, const void *qs, const void *scale_values, const uint16_t *min_values,
                             int64_t first, int64_t n, int64_t k, uint16_t *panel, float *scales, float *mins,
                             float *second_scales) {
    const int64_t blocks = k / BLOCK, row_bytes = weight_row_bytes(format, k);
    for (int64_t o = 0; o < PANEL; o++) {
        if (format == INT8) {
            for (int64_t b = 0; b < blocks; b++) scales[b * PANEL + o] = ((const float *)scale_values)[first + o];
            continue;
        }
        if (k_quant_scales(format)) {  // 6-bit multiples of the super-block's d and dmin: one block at a time
            for (int64_t b = 0; b < blocks; b++)
                block_scale_min(format, scale_values, min_values, first + o, blocks, b, &scales[b * PANEL + o],
                                &mins[b * PANEL + o]);
            continue;
        }
        if (format == Q6_K) {  // a scale per 16 values and a min per block
            for (int64_t b = 0; b < blocks; b++) {
                scales[b * PANEL + o] = q6_k_half_scale(scale_values, min_values, first + o, k, 2 * b);
                second_scales[b * PANEL + o] = q6_k_half_scale(scale_values, min_values, first + o, k, 2 * b + 1);
                mins[b * PANEL + o] = q6_k_block_min(scale_values, min_values, first + o, k, b);
            }
            continue;
        }
        const uint16_t *row_scales = (const uint16_t *)scale_values + (first + o) * blocks;
        const uint16_t *row_mins = block_min_format(format) ? min_values + (first + o) * blocks : NULL;
        for (int64_t b = 0; b < blocks; b += 16) {
            const __mmask16 valid = blocks - b >= 16 ? 0xFFFF : (__mmask16)((1u << (blocks - b)) - 1);
            const __m512i positions = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                         _mm512_set1_epi32(PANEL));
            _mm512_mask_i32scatter_ps(scales + b * PANEL + o, valid, positions,
                                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, row_scales + b)), 4);
            if (row_mins)
                _mm512_mask_i32scatter_ps(mins + b * PANEL + o, valid, positions,
                                          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, row_mins + b)), 4);
        }
    }
    const char *next = first + PANEL < n ? (const char *)qs + (first + PANEL) * row_bytes : NULL;
    const int64_t prefetch_lines = (PANEL * row_bytes / 64 + 2 * blocks - 1) / (2 * blocks);  // per block
    for (int half = 0; half < 2; half++) {
        const int64_t row = first + half * 16;
        for (int64_t b = 0; b < blocks; b++) {
            if (next)
                for (int64_t line = 0; line < prefetch_lines; line++)
                    _mm_prefetch(next + ((half * blocks + b) * prefetch_lines + line) * 64, _MM_HINT_T1);
            uint16_t *lines = panel + half * k * 16 + b * 16 * 32;
            const float *block_scales = scales + b * PANEL + half * 16;
            if (nibble_format(format))
                q4_lines(format, (const uint8_t *)qs + row * row_bytes + b * (BLOCK / 2), row_bytes, block_scales,
                         mins + b * PANEL + half * 16, lines);
            else if (five_bit_format(format))
                q5_lines(format, (const uint8_t *)qs + row * row_bytes, blocks, b, row_bytes, block_scales,
                         mins + b * PANEL + half * 16, lines);
            else
                int8_lines((const int8_t *)qs + row * row_bytes + b * BLOCK, row_bytes, block_scales,
                           format == Q6_K ? second_scales + b * PANEL + half * 16 : block_scales,
                           format == Q6_K || format == Q8_0_MIN ? mins + b * PANEL + half * 16 : NULL, lines);
        }
    }
}

// Every row of x times one dequantized panel: outputs [col, col + PANEL) of out. The panel was just written
// into cache: gemm_group requests nothing ahead (at 64-256 rows 3-6% faster than requesting it again).
static void panel_rows(const uint16_t *x, int64_t x_stride, const uint16_t *panel, const uint16_t *bias,
                       uint16_t *out, int rows, int64_t n, int64_t k, int64_t col) {
#if defined(PANEL_GEMM_AMX)
    const int full_groups = rows / GROUP_ROWS, tail = rows % GROUP_ROWS;
    if (full_groups > 0) {
        configure_tiles(GROUP_ROWS);
        for (int g = 0; g < full_groups; g++)
            gemm_group(x + g * GROUP_ROWS * x_stride, x_stride, panel, bias, out + g * GROUP_ROWS * n, GROUP_ROWS, n,
                       k, col, 0, k, NULL, 0);
    }
    if (tail > 0) {
        configure_tiles(tail);
        gemm_group(x + full_groups * GROUP_ROWS * x_stride, x_stride, panel, bias, out + full_groups * GROUP_ROWS * n,
                   tail, n, k, col, 0, k, NULL, 0);
    }
#else
    const uint32_t *w0 = (const uint32_t *)panel, *w1 = w0 + k / 2 * 16;
    for (int first = 0; first < rows; first += ROW_BLOCK)
        bf16_gemm_unit(x, x_stride, w0, w1, first, first + ROW_BLOCK < rows ? first + ROW_BLOCK : rows,
                       bias ? bias + col : NULL, out + col, n, k);
#endif
}
#endif

// out [rows, n] = x [rows, k] (bfloat16, row stride x_stride) @ W^T + bias (bfloat16 or NULL), W [n, k] as
// quant_linear `w` describes it, n a multiple of 32: what one thread of the enclosing parallel region does (a
// contiguous run of panels). No barrier at the end: callers inside a region add one.
static void quant_panel_gemm_share(const quant_linear *w, const uint16_t *x, int64_t x_stride, const uint16_t *bias,
                                   uint16_t *out, int rows, int64_t n, int64_t k) {
#if defined(PANEL_GEMM_AMX) || defined(PANEL_GEMM_BF16)
    const int64_t panels = n / PANEL, thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
    if (begin == end) return;
#if defined(PANEL_W8A8)
    if (w->format == INT8_PANELS || (w->format == INT8 && w8a8_takes(k))) {
        w8a8_panel_gemm_share(w->qs, w->format == INT8_PANELS, w->scales, x, x_stride, bias, out, rows, n, k);
        return;
    }
#endif
    // The panel (bfloat16) and its block scales, mins and second scales (float32): this thread's cache-resident
    // scratch.
    uint16_t *panel = aligned_alloc(64, (size_t)(PANEL * k) * sizeof(uint16_t) + 3 * (size_t)(k / BLOCK * PANEL) * sizeof(float));
    float *scales = (float *)(panel + PANEL * k), *mins = scales + k / BLOCK * PANEL;
    float *second_scales = mins + k / BLOCK * PANEL;
    for (int64_t p = begin; p < end; p++) {
        dequantize_panel((int)w->format, w->qs, w->scales, w->mins, p * PANEL, n, k, panel, scales, mins,
                         second_scales);
        panel_rows(x, x_stride, panel, bias, out, rows, n, k, p * PANEL);
    }
#if defined(PANEL_GEMM_AMX)
    _tile_release();
#endif
    free(panel);
#endif
}

// Where int8 weights (INT8) run with int8 activations past the GEMV (w8a8_panel_gemm.c): 2 on AMX tiles, 1 on
// AVX512-VNNI; 0 where on bfloat16 panels like the other formats.
int quant_panel_gemm_w8a8(void) {
#if defined(PANEL_W8A8) && defined(PANEL_GEMM_AMX)
    return 2;
#elif defined(PANEL_W8A8)
    return 1;
#else
    return 0;
#endif
}

// out = x @ W^T + bias from inside a parallel region (decoder_stack_quant.c's GEMM): the GEMV for as many
// rows as w's activation scratch holds, panels past them (INT8_PANELS: panels for every row count).
// Bit-identical to QuantGemm.linear, which draws the same line.
static void quant_linear_share(const quant_linear *w, const uint16_t *x, int64_t x_stride, const uint16_t *bias,
                               uint16_t *out, int rows, int64_t n, int64_t k) {
    if (rows <= w->scratch_rows && w->format != INT8_PANELS)
        quant_gemm_share(w, x, 1, x_stride, bias, out, rows, n, k);
    else
        quant_panel_gemm_share(w, x, x_stride, bias, out, rows, n, k);
}

void quant_panel_gemm(int format, const uint16_t *x, int64_t x_stride, int64_t rows, const void *qs,
                      const void *scales, const void *mins, const uint16_t *bias, uint16_t *out, int64_t n, int64_t k,
                      int num_threads) {
    const quant_linear w = {format, qs, scales, mins, 0, 0, 0, 0};
#pragma omp parallel num_threads(num_threads)
    quant_panel_gemm_share(&w, x, x_stride, bias, out, (int)rows, n, k);
}
