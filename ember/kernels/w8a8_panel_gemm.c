// int8 weights (one scale per output row, quant_gemm.c's INT8) times batches of bfloat16 rows with int8
// activations (W8A8): quant_panel_gemm.c's path for that format on CPUs with AVX512-VNNI (Zen 4/5, Cooper Lake),
// where vpdpbusd does 64 multiply-adds per instruction and vdpbf16ps 32, at the same rate, and with AMX, where a
// tile's int8 dot products (tdpbsud) do twice the multiply-adds of its bfloat16 ones and read half the bytes.
//
// Activations are quantized per row and group of W8A8_GROUP values along k: s = max |x| / 127,
// q = round(x * (1 / s)) to nearest even. A scale per whole row (vLLM's and SGLang's per-token W8A8) costs
// SmolLM2 7% of perplexity, nearly all of it in the MLP's down projection, whose input has outlier values;
// per group of 64 it is within noise of weight-only int8 (docs/benchmarks.md, issue 14). A group is one AMX
// tile's depth (16 rows of 4 bytes).
//
// Both multiply unsigned bytes by signed ones, so the weights are stored as w + 128 (unsigned) and the
// activations stay signed: dot(w + 128, q) = dot(w, q) + 128 sum(q), and the second term, a number per row and
// group, is taken off once per row. Each weight panel of 32 outputs is laid out as [2][k / 4][16][4] bytes (one
// 64-byte line: four consecutive k of 16 outputs, a 16 x 16 transpose of 4-byte groups; 16 lines are an AMX B
// tile). A group's integer dot products are exact in int32 and in float32 (|sum| <= 64 * 255 * 127 < 2^24):
//   y = scale_n * (sum over groups of s_g * dot_g(w + 128, q)  -  sum over groups of s_g * 128 sum_g(q)) + bias,
// each product and sum rounded in float32 in that order (no fused multiply-adds: tests/kernels reproduces it
// bit for bit, and both instruction sets give the same outputs), then rounded once to bfloat16.
//
// Included by quant_panel_gemm.c (needs transpose_16x16_epi32, PANEL, bf16_simd.h, quant_gemm.c's W8A8_GROUP from
// w8a8_f32_gemm.c, and with AMX amx_gemm.c's configure_tiles).

#if defined(PANEL_GEMM_AMX)
#define W8A8_TILE_ROWS GROUP_ROWS  // two A tiles
#else
#define W8A8_TILE_ROWS 6  // 6 x 2 int32 and 6 x 2 float32 accumulators, the two weight vectors: 28 zmm registers
#endif

// Does quant_panel_gemm.c run int8 weights of width k here? (Whole groups only: others take bfloat16 panels.)
static inline int w8a8_takes(int64_t k) { return k % W8A8_GROUP == 0; }

// This thread's quantized activations, grown as a step's rows need (kept from call to call: a step runs ~120
// GEMMs, and a fresh allocation of rows x k bytes per call would fault its pages in each time).
static __thread uint8_t *w8a8_activations;
static __thread size_t w8a8_activation_bytes;

typedef struct {
    int8_t *q;            // [rows, k]
    float *scales;        // [rows, k / W8A8_GROUP]
    float *offsets;       // [rows]: sum over groups of s_g * 128 sum_g(q)
} w8a8_rows_t;

// x [rows, k] (bfloat16, row stride x_stride) -> a, per row and group.
static void w8a8_quantize_rows(const uint16_t *x, int64_t x_stride, int rows, int64_t k, w8a8_rows_t a) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const int64_t groups = k / W8A8_GROUP;
    for (int r = 0; r < rows; r++) {
        float offset = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *values = x + r * x_stride + g * W8A8_GROUP;
            __m512 v[W8A8_GROUP / 16];
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < W8A8_GROUP / 16; i++) {
                v[i] = load_bf16(values + 16 * i);
                amax = _mm512_max_ps(amax, _mm512_and_ps(v[i], magnitude));
            }
            const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
            const __m512 inverse = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
            __m512i sum = _mm512_setzero_si512();
            for (int i = 0; i < W8A8_GROUP / 16; i++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128((__m128i *)(a.q + r * k + g * W8A8_GROUP + 16 * i), _mm512_cvtepi32_epi8(q));
            }
            a.scales[r * groups + g] = scale;
            offset += scale * (float)(128 * _mm512_reduce_add_epi32(sum));
        }
        a.offsets[r] = offset;
    }
}

// The panel layout of int8 weights [n, k] (n a multiple of 32, k of 64), as INT8_PANELS stores them whole and
// w8a8_pack_panel makes one panel at a time: [n / 32][2][k / 4][16][4] bytes of w + 128.
//
// Weight rows [first, first + 32) of int8 [n, k] as one panel [2][k / 4][16][4] of w + 128. The next panel's
// rows (when `prefetch_next`) are requested into L2 along the way, so that they arrive while this panel's
// tiles run.
static void w8a8_pack_panel(const void *values, int64_t first, int64_t k, int prefetch_next, uint8_t *panel) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);  // w + 128 = w XOR 0x80 for signed bytes
    for (int half = 0; half < 2; half++)
        for (int64_t k0 = 0; k0 < k; k0 += 64) {
            __m512i v[16];
            for (int i = 0; i < 16; i++) {
                const int8_t *row = (const int8_t *)values + (first + half * 16 + i) * k + k0;
                if (prefetch_next) _mm_prefetch((const char *)(row + PANEL * k), _MM_HINT_T1);
                v[i] = _mm512_xor_si512(_mm512_loadu_si512(row), bias);
            }
            transpose_16x16_epi32(v);
            for (int line = 0; line < 16; line++) _mm512_store_si512(panel + (half * (k / 4) + k0 / 4 + line) * 64, v[line]);
        }
}

// 16 of an output row's values from their group sums: (sum - offset) * column scale + bias, rounded to bfloat16
// (both paths' last step, in this order).
static inline void w8a8_store_half(__m512 sum, float offset, __m512 column_scales, __m512 column_bias, uint16_t *out) {
    store_bf16(out, round_bf16(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(sum, _mm512_set1_ps(offset)), column_scales),
                                             column_bias)));
}

// Group g's (of `groups`) share of lines [first_line, last_line) of each half of the next panel `next` (or NULL;
// a line: 4 k of 16 columns, half_bytes apart), requested into L2: a tile requesting its share of the next panel
// this way spreads the requests over its arithmetic, and the panel's tiles together request all of it.
// Inlined: a call inside a tile's loop spills the tile's accumulators around it.
static inline __attribute__((always_inline)) void w8a8_prefetch_share(const uint8_t *next, int64_t half_bytes,
                                                                     int64_t first_line, int64_t last_line,
                                                                     int64_t g, int64_t groups) {
    if (!next) return;
    for (int64_t line = first_line + (last_line - first_line) * g / groups;
         line < first_line + (last_line - first_line) * (g + 1) / groups; line++) {
        _mm_prefetch((const char *)(next + line * 64), _MM_HINT_T1);
        _mm_prefetch((const char *)(next + half_bytes + line * 64), _MM_HINT_T1);
    }
}

#if defined(PANEL_GEMM_AMX)
// One row tile's (t) products with one half (h) of a panel over every group, its 16 rows' float32 sums kept in
// registers: per group of 64 k one tdpbsud, its int32 tile stored and each row's products scaled into its sum (the
// VNNI path's arithmetic, in its order), then the rows stored. Row tiles and halves are passes: the A and B tiles
// are read again from L1/L2 for each, and each group's int32 products go to L1 once. A macro, as the tile numbers
// must be literals: A tile A_TILE, destination DEST (configured for `count` rows), B tile 2.
#define W8A8_PASS(A_TILE, DEST, t, h)                                                                                \
    do {                                                                                                         \
        const int count = (t) ? second : first;                                                                  \
        const int8_t *tile_q = a.q + (int64_t)(t) * TILE_ROWS * k;                                              \
        const float *tile_scales = a.scales + (int64_t)(t) * TILE_ROWS * groups;                                \
        __m512 sums[TILE_ROWS];                                                                                  \
        for (int m = 0; m < TILE_ROWS; m++) sums[m] = _mm512_setzero_ps();                                      \
        for (int64_t g = 0; g < groups; g++) {                                                                   \
            w8a8_prefetch_share(next, half_bytes, first_line, last_line, pass * groups + g, passes * groups);    \
            _tile_zero(DEST);                                                                                    \
            _tile_loadd(A_TILE, tile_q + g * W8A8_GROUP, k);                                                     \
            _tile_loadd(2, panel + (h) * half_bytes + g * 1024, 64);                                             \
            _tile_dpbsud(DEST, A_TILE, 2);                                                                       \
            _tile_stored(DEST, dots, 64);                                                                        \
            _Pragma("GCC unroll 16") for (int m = 0; m < TILE_ROWS; m++) if (m < count) {                        \
                const __m512 scale = _mm512_set1_ps(tile_scales[m * groups + g]);                                \
                sums[m] = _mm512_add_ps(sums[m], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * m)), \
                                                              scale));                                          \
            }                                                                                                    \
        }                                                                                                        \
        const __m512 column_scales = _mm512_loadu_ps(col_scales + 16 * (h));                                     \
        const __m512 column_bias = bias ? load_bf16(bias + 16 * (h)) : _mm512_setzero_ps();                      \
        for (int m = 0; m < count; m++)                                                                          \
            w8a8_store_half(sums[m], a.offsets[(t) * TILE_ROWS + m], column_scales, column_bias,                 \
                            out + ((t) * TILE_ROWS + m) * n + 16 * (h));                                         \
        pass++;                                                                                                  \
    } while (0)

// Rows [0, rows) of a (rows <= 32, the tiles configured for them) times one packed panel into out's 32
// columns (row stride n), in passes of W8A8_PASS. `next` (or NULL): the next panel in memory (INT8_PANELS), whose
// lines [first_line, last_line) this tile requests (w8a8_prefetch_share), spread over all the passes.
static void w8a8_rows(w8a8_rows_t a, int64_t k, const uint8_t *panel, const uint8_t *next, int64_t first_line,
                      int64_t last_line, const float *col_scales, const uint16_t *bias, uint16_t *out, int64_t n,
                      int rows) {
    const int64_t groups = k / W8A8_GROUP, half_bytes = k / 4 * 64;
    const int first = rows < TILE_ROWS ? rows : TILE_ROWS, second = rows - first;  // rows of each A tile
    const int passes = second > 0 ? 4 : 2;
    int pass = 0;
    int32_t dots[TILE_FLOATS] __attribute__((aligned(64)));
    W8A8_PASS(0, 4, 0, 0);
    W8A8_PASS(0, 5, 0, 1);
    if (second > 0) {
        W8A8_PASS(1, 6, 1, 0);
        W8A8_PASS(1, 7, 1, 1);
    }
}
#undef W8A8_PASS
#else
// acc + the dot products of u (unsigned bytes) and q (4 signed bytes, broadcast to every lane). In assembly:
// GCC 12 copies the intrinsic's accumulator through other registers and the stack in the tile's loop (2.5x
// slower there). The broadcast is a register the row's two products share: as the instruction's memory operand
// each product loaded it again, and the loads held the loop (docs/benchmarks.md, Zen 5).
static inline __m512i w8a8_dot(__m512i acc, __m512i u, __m512i q) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(q));
    return acc;
}

// Rows [0, rows) of a (a constant count up to W8A8_TILE_ROWS) times one packed panel into out's 32 columns
// from `out` (row stride n). Inlined per row count, so the accumulators are registers.
// `next` (or NULL): the next panel in memory (INT8_PANELS), whose lines [first_line, last_line) this tile
// requests (w8a8_prefetch_share).
static inline __attribute__((always_inline)) void w8a8_tile(w8a8_rows_t a, int64_t k, const uint8_t *panel,
                                                           const uint8_t *next, int64_t first_line,
                                                           int64_t last_line, const float *col_scales,
                                                           const uint16_t *bias, uint16_t *out, int64_t n,
                                                           const int rows) {
    const int64_t groups = k / W8A8_GROUP, half_bytes = k / 4 * 64;
    const uint8_t *w0 = panel, *w1 = panel + half_bytes;
    __m512 sum0[W8A8_TILE_ROWS], sum1[W8A8_TILE_ROWS];
    for (int m = 0; m < rows; m++) sum0[m] = sum1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc0[W8A8_TILE_ROWS], acc1[W8A8_TILE_ROWS];
        for (int m = 0; m < rows; m++) acc0[m] = acc1[m] = _mm512_setzero_si512();
        w8a8_prefetch_share(next, half_bytes, first_line, last_line, g, groups);
        for (int64_t p = g * W8A8_GROUP / 4; p < (g + 1) * W8A8_GROUP / 4; p++) {
            const __m512i wa = _mm512_load_si512(w0 + p * 64), wb = _mm512_load_si512(w1 + p * 64);
            for (int m = 0; m < rows; m++) {
                const __m512i q = _mm512_broadcastd_epi32(_mm_loadu_si32(a.q + m * k + 4 * p));
                acc0[m] = w8a8_dot(acc0[m], wa, q);
                acc1[m] = w8a8_dot(acc1[m], wb, q);
            }
        }
        for (int m = 0; m < rows; m++) {
            const __m512 scale = _mm512_set1_ps(a.scales[m * groups + g]);
            sum0[m] = _mm512_add_ps(sum0[m], _mm512_mul_ps(_mm512_cvtepi32_ps(acc0[m]), scale));
            sum1[m] = _mm512_add_ps(sum1[m], _mm512_mul_ps(_mm512_cvtepi32_ps(acc1[m]), scale));
        }
    }
    const __m512 s0 = _mm512_loadu_ps(col_scales), s1 = _mm512_loadu_ps(col_scales + 16);
    const __m512 b0 = bias ? load_bf16(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_bf16(bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        w8a8_store_half(sum0[m], a.offsets[m], s0, b0, out + m * n);
        w8a8_store_half(sum1[m], a.offsets[m], s1, b1, out + m * n + 16);
    }
}

static void w8a8_rows(w8a8_rows_t a, int64_t k, const uint8_t *panel, const uint8_t *next, int64_t first_line,
                      int64_t last_line, const float *col_scales, const uint16_t *bias, uint16_t *out, int64_t n,
                      int rows) {
#define W8A8_TILE(ROWS) w8a8_tile(a, k, panel, next, first_line, last_line, col_scales, bias, out, n, ROWS)
    switch (rows) {
        case 6: W8A8_TILE(6); break;
        case 5: W8A8_TILE(5); break;
        case 4: W8A8_TILE(4); break;
        case 3: W8A8_TILE(3); break;
        case 2: W8A8_TILE(2); break;
        default: W8A8_TILE(1); break;
    }
#undef W8A8_TILE
}

#endif

// out [rows, n] = x @ W^T + bias for int8 W (qs [n, k], scales [n] float32; w8a8_takes(k)), or with `packed`
// the same weight in the panel layout (INT8_PANELS): this thread's contiguous run of panels. Every thread
// quantizes all the rows itself (rows x k operations against the GEMM's rows x k x n / threads), so that no
// barrier is needed.
static void w8a8_panel_gemm_share(const void *qs, int packed, const float *scales, const uint16_t *x,
                                  int64_t x_stride, const uint16_t *bias, uint16_t *out, int rows, int64_t n,
                                  int64_t k) {
    const int64_t panels = n / PANEL, thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
    if (begin == end) return;
    const size_t bytes = (size_t)rows * ((size_t)k + (size_t)(k / W8A8_GROUP + 1) * sizeof(float));
    if (bytes > w8a8_activation_bytes) {
        free(w8a8_activations);
        w8a8_activation_bytes = (bytes + 63) / 64 * 64;
        w8a8_activations = aligned_alloc(64, w8a8_activation_bytes);
    }
    float *row_floats = (float *)w8a8_activations;
    const w8a8_rows_t a = {(int8_t *)(row_floats + (size_t)rows * (size_t)(k / W8A8_GROUP + 1)), row_floats,
                           row_floats + (size_t)rows * (size_t)(k / W8A8_GROUP)};
    w8a8_quantize_rows(x, x_stride, rows, k, a);
    uint8_t *scratch = packed ? NULL : aligned_alloc(64, (size_t)(PANEL * k));
#if defined(PANEL_GEMM_AMX)
    int configured = 0;  // the rows the tiles are configured for
#endif
    for (int64_t p = begin; p < end; p++) {
        const uint8_t *panel = packed ? (const uint8_t *)qs + p * PANEL * k : scratch;
        if (!packed) w8a8_pack_panel(qs, p * PANEL, k, p + 1 < end, scratch);
        for (int first = 0; first < rows; first += W8A8_TILE_ROWS) {
            const w8a8_rows_t tile_a = {a.q + (int64_t)first * k, a.scales + (int64_t)first * (k / W8A8_GROUP),
                                        a.offsets + first};
            const int tile_rows = rows - first < W8A8_TILE_ROWS ? rows - first : W8A8_TILE_ROWS;
            // The next panel's lines (k / 4 per half), shared among the tiles as their rows are.
            const uint8_t *next = packed && p + 1 < end ? panel + PANEL * k : NULL;
#if defined(PANEL_GEMM_AMX)
            if (tile_rows != configured) configure_tiles(configured = tile_rows);
#endif
            w8a8_rows(tile_a, k, panel, next, k / 4 * first / rows, k / 4 * (first + tile_rows) / rows,
                      scales + p * PANEL, bias ? bias + p * PANEL : NULL, out + (int64_t)first * n + p * PANEL, n,
                      tile_rows);
        }
    }
#if defined(PANEL_GEMM_AMX)
    _tile_release();
#endif
    free(scratch);
}
