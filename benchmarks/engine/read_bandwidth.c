// How fast this machine reads memory: an AVX-512 (or, without it, AVX) sum over 512 MB, either in one sequential pass per thread
// or in chunks of CHUNK_BYTES visited in random order (the shape of a paged KV cache; whole chunks only).
// Best of 5.
//   cc -O3 -march=native -fopenmp benchmarks/engine/read_bandwidth.c -o /tmp/read_bandwidth
//   OMP_NUM_THREADS=2 /tmp/read_bandwidth [CHUNK_BYTES]     (no argument: sequential)
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TOTAL_BYTES ((size_t)512 << 20)

// One cache line added into a running sum: a 512-bit load, or two 256-bit loads on a CPU without AVX-512.
#if defined(__AVX512F__)
typedef __m512 line_sum;
static inline line_sum line_sum_zero(void) { return _mm512_setzero_ps(); }
static inline line_sum add_line(line_sum sum, const char *p) { return _mm512_add_ps(sum, _mm512_load_ps((const float *)p)); }
static inline float line_sum_total(line_sum sum) { return _mm512_reduce_add_ps(sum); }
#else
typedef struct { __m256 low, high; } line_sum;
static inline line_sum line_sum_zero(void) { return (line_sum){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline line_sum add_line(line_sum sum, const char *p) {
    return (line_sum){_mm256_add_ps(sum.low, _mm256_load_ps((const float *)p)),
                      _mm256_add_ps(sum.high, _mm256_load_ps((const float *)(p + 32)))};
}
static inline float line_sum_total(line_sum sum) {
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(sum.low, sum.high));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const size_t chunk = argc > 1 ? strtoull(argv[1], NULL, 10) : TOTAL_BYTES;
    if (chunk < 64 || chunk % 64 || chunk > TOTAL_BYTES) {
        fprintf(stderr, "CHUNK_BYTES must be a multiple of 64, at most %zu\n", TOTAL_BYTES);
        return 1;
    }
    char *buffer = aligned_alloc(4096, TOTAL_BYTES);
    memset(buffer, 1, TOTAL_BYTES);
    const size_t chunks = TOTAL_BYTES / chunk;
    size_t *order = malloc(chunks * sizeof(size_t));
    for (size_t i = 0; i < chunks; i++) order[i] = i;
    srand(1);
    for (size_t i = chunks - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1), swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    double best = 1e30;
    float total = 0;
    for (int repetition = 0; repetition < 5; repetition++) {
        const double start = now();
#pragma omp parallel reduction(+ : total)
        {
            line_sum sum = line_sum_zero();
            if (chunks == 1) {  // sequential: one contiguous part per thread
                const size_t part = TOTAL_BYTES / omp_get_num_threads();
                const char *p = buffer + part * omp_get_thread_num();
                for (size_t offset = 0; offset < part; offset += 64)
                    sum = add_line(sum, p + offset);
            } else {
#pragma omp for schedule(dynamic, 1)
                for (size_t c = 0; c < chunks; c++) {
                    const char *p = buffer + order[c] * chunk;
                    for (size_t offset = 0; offset < chunk; offset += 64)
                        sum = add_line(sum, p + offset);
                }
            }
            total += line_sum_total(sum);
        }
        const double seconds = now() - start;
        if (seconds < best) best = seconds;
    }
    printf("%d threads, %s: %.1f GB/s (checksum %g)\n", omp_get_max_threads(),
           chunks == 1 ? "sequential" : "chunks in random order", chunks * chunk / best / 1e9, total);
    return 0;
}
