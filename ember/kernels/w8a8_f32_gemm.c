// int8 weights in the W8A8 panel layout (INT8_PANELS: w + 128 as [n / 32][2][k / 4][16][4] bytes, one float
// scale per output row; w8a8_panel_gemm.c) times float32 rows with int8 activations, on AVX2 vectors: where
// `--dtype auto` picks float32 on a CPU without AVX-512 (AMD Zen 2/3, Intel client cores), batches past the
// GEMV's rows run on int8 copies of the weights instead of float32 ones (docs/benchmarks.md, issue 14).
//
// AVX2 has no VNNI. vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16, which w +
// 128 (up to 255) times an activation (up to 127) could overflow. So the activation's sign moves onto the weight:
// |q| (unsigned, at most 127) times w carrying q's sign (vpsignb; |w| <= 127) sums a pair to at most 2 * 127 *
// 127 < 2^15, exactly, and vpmaddwd by ones widens the pairs to int32. Activations are quantized per row and
// group of W8A8_GROUP as w8a8_panel_gemm.c's are (s = max |x| / 127, q = round(x * (1 / s)) to nearest even),
// and with the signed weights no offset term is needed:
//   y = scale_n * (sum over groups of s_g * dot_g(w, q)) + bias,
// each group's dot product exact in int32, then each product and sum in float32 in that order.
//
// Included by quant_gemm.c (its horizontal_max); needs only AVX2.

#define W8A8_GROUP 64  // activations' values per scale (w8a8_panel_gemm.c's too)
#define W8A8_F32_ROWS 3  // rows per register tile: 3 x 2 accumulators beside the weights fit 16 registers; 4 spilled
#define W8A8_F32_OUTPUTS 16   // outputs per tile: half a panel, one 64-byte line per 4 k
#define W8A8_F32_PREFETCH 4096  // bytes of weights requested ahead by a half panel's first tile
#define W8A8_F32_CHUNK 4  // half panels a thread takes at a time

// This thread's quantized activations, grown as a step's rows need (kept from call to call, like
// w8a8_panel_gemm.c's).
static __thread uint8_t *w8a8_f32_scratch;
static __thread size_t w8a8_f32_scratch_bytes;

// x [rows, k] (float32, row stride x_stride) -> q [rows, k] int8, their magnitudes |q| [rows, k] and scales
// [rows, k / W8A8_GROUP].
static void w8a8_f32_quantize_rows(const float *x, int64_t x_stride, int rows, int64_t k, int8_t *q,
                                   uint8_t *magnitudes, float *scales) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const int64_t groups = k / W8A8_GROUP;
    for (int r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *values = x + r * x_stride + g * W8A8_GROUP;
            __m256 v[W8A8_GROUP / 8];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < W8A8_GROUP / 8; i++) {
                v[i] = _mm256_loadu_ps(values + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
            }
            const float scale = horizontal_max(amax) / 127.0f;
            const __m256 inverse = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
            int8_t *out = q + r * k + g * W8A8_GROUP;
            uint8_t *out_magnitudes = magnitudes + r * k + g * W8A8_GROUP;
            for (int i = 0; i < W8A8_GROUP / 16; i++) {  // 16 values: two vectors of int32 packed to bytes
                const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i], inverse));
                const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i + 1], inverse));
                const __m256i words = _mm256_packs_epi32(low, high);  // per 128-bit lane: low 0-3, high 0-3, ...
                const __m128i bytes =
                    _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
                // bytes: low 0-3, high 0-3, low 4-7, high 4-7 -> 32-bit groups in order 0, 2, 1, 3
                const __m128i ordered = _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0));
                _mm_storeu_si128((__m128i *)(out + 16 * i), ordered);
                _mm_storeu_si128((__m128i *)(out_magnitudes + 16 * i), _mm_abs_epi8(ordered));
            }
            scales[r * groups + g] = scale;
        }
}

// Rows [0, rows) (a constant up to W8A8_F32_ROWS) of q (magnitudes in magnitudes, the same layout) times one
// half panel (16 outputs; `lines`: its k / 4 lines of 64 bytes) into out's 16 columns (row stride n), plus bias
// (16 values or NULL), times col_scales. Per 4 k and row: two broadcasts (q and |q|, both quantized ahead, so
// no vpabsb here), two vpsignb, two vpmaddubsw, two vpmaddwd and two vpaddd; the group sums go through `out` (in
// L1), so that no accumulator leaves the registers. With `prefetch` (the half panel's first tile, which reads it
// from memory), the weights W8A8_F32_PREFETCH bytes ahead are requested along the way: the hardware prefetcher
// alone leaves a decode's single stream per thread at about half the memory bandwidth.
static inline __attribute__((always_inline)) void w8a8_f32_tile(const int8_t *q, const uint8_t *magnitudes,
                                                               const float *x_scales, int64_t k,
                                                               const uint8_t *lines, int prefetch,
                                                               const float *col_scales, const float *bias,
                                                               float *out, int64_t n, const int rows) {
    const int64_t groups = k / W8A8_GROUP;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[W8A8_F32_ROWS][2];
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (int64_t p = g * W8A8_GROUP / 4; p < (g + 1) * W8A8_GROUP / 4; p++) {
            if (prefetch) _mm_prefetch((const char *)(lines + p * 64) + W8A8_F32_PREFETCH, _MM_HINT_T0);
            // outputs 0-7 and 8-15, 4 k each, as signed bytes (w + 128 XOR 0x80 = w)
            const __m256i w0 = _mm256_xor_si256(_mm256_load_si256((const __m256i *)(lines + p * 64)), flip);
            const __m256i w1 = _mm256_xor_si256(_mm256_load_si256((const __m256i *)(lines + p * 64 + 32)), flip);
            for (int m = 0; m < rows; m++) {
                const __m256i x4 = _mm256_set1_epi32(*(const int32_t *)(q + m * k + 4 * p));
                const __m256i magnitude = _mm256_set1_epi32(*(const int32_t *)(magnitudes + m * k + 4 * p));
                acc[m][0] = _mm256_add_epi32(
                    acc[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w0, x4)), ones));
                acc[m][1] = _mm256_add_epi32(
                    acc[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w1, x4)), ones));
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m256 scale = _mm256_set1_ps(x_scales[m * groups + g]);
            for (int h = 0; h < 2; h++) {
                const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][h]), scale);
                float *sums = out + m * n + 8 * h;
                _mm256_storeu_ps(sums, g == 0 ? scaled : _mm256_add_ps(_mm256_loadu_ps(sums), scaled));
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 s = _mm256_loadu_ps(col_scales + 8 * h);
        const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
        for (int m = 0; m < rows; m++) {
            float *sums = out + m * n + 8 * h;
            _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(sums), s), b));
        }
    }
}

static void w8a8_f32_rows(const int8_t *q, const uint8_t *magnitudes, const float *x_scales, int64_t k,
                          const uint8_t *lines, int prefetch, const float *col_scales, const float *bias, float *out,
                          int64_t n, int rows) {
#define W8A8_F32_TILE(ROWS) \
    w8a8_f32_tile(q, magnitudes, x_scales, k, lines, prefetch, col_scales, bias, out, n, ROWS)
    switch (rows) {
        case 3: W8A8_F32_TILE(3); break;
        case 2: W8A8_F32_TILE(2); break;
        default: W8A8_F32_TILE(1); break;
    }
#undef W8A8_F32_TILE
}

// out [rows, n] = x [rows, k] (float32, row stride x_stride) @ W^T + bias (float32 or NULL), W the INT8_PANELS
// weight `panels` with per-row `col_scales`, n a multiple of 32 and k of W8A8_GROUP: the region's threads take
// runs of W8A8_F32_CHUNK half panels as they finish the last (a thread the VM's host holds back takes fewer),
// every row of them (the half panel stays in L1 from one row tile to the next). Every thread quantizes all the
// rows itself (rows x k operations against the GEMM's rows x k x n / threads), so that no barrier is needed;
// none at the end either: callers inside a region add one.
static void w8a8_f32_gemm_share(const void *panels, const void *col_scales, const float *x, int64_t x_stride,
                                const float *bias, float *out, int rows, int64_t n, int64_t k) {
    const int64_t halves = n / W8A8_F32_OUTPUTS;
    const int64_t groups = k / W8A8_GROUP;
    const size_t bytes = (size_t)rows * ((size_t)groups * sizeof(float) + 2 * (size_t)k);
    if (bytes > w8a8_f32_scratch_bytes) {
        free(w8a8_f32_scratch);
        w8a8_f32_scratch_bytes = (bytes + 63) / 64 * 64;
        w8a8_f32_scratch = aligned_alloc(64, w8a8_f32_scratch_bytes);
    }
    float *x_scales = (float *)w8a8_f32_scratch;
    int8_t *q = (int8_t *)(x_scales + (size_t)rows * (size_t)groups);
    uint8_t *magnitudes = (uint8_t *)q + (size_t)rows * (size_t)k;
    w8a8_f32_quantize_rows(x, x_stride, rows, k, q, magnitudes, x_scales);
#pragma omp for schedule(dynamic, W8A8_F32_CHUNK) nowait
    for (int64_t h = 0; h < halves; h++) {
        // Half h: panel h / 2's half h % 2, whose k / 4 lines follow each other.
        const uint8_t *lines = (const uint8_t *)panels + (h / 2) * 2 * W8A8_F32_OUTPUTS * k + (h % 2) * (k / 4) * 64;
        for (int first = 0, tile; first < rows; first += tile) {
            // Tiles of 3 rows, the last four as 2 + 2: a tile of one row pays the weights' loads for a third of
            // the arithmetic.
            const int left = rows - first;
            tile = left == 4 ? 2 : left < W8A8_F32_ROWS ? left : W8A8_F32_ROWS;
            w8a8_f32_rows(q + (int64_t)first * k, magnitudes + (int64_t)first * k, x_scales + first * groups, k, lines,
                          first == 0, (const float *)col_scales + h * W8A8_F32_OUTPUTS,
                          bias ? bias + h * W8A8_F32_OUTPUTS : NULL, out + (int64_t)first * n + h * W8A8_F32_OUTPUTS, n,
                          tile);
        }
    }
}
