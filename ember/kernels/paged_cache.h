// Where a sequence's tokens sit in one layer's paged KV cache ([blocks, block_size, 2, kv_heads, HEAD_DIM] of
// bfloat16, or of int8 with scales: kv_cache.h), shared by the bfloat16 attention kernels.
#pragma once
#include <stdint.h>

#include "kv_cache.h"

typedef KV_ELEMENT(uint16_t) cache_element;  // bfloat16's bits, or int8

// The cache rows of positions [start, start + count): one division per tile, not one per row.
static inline void cache_rows(const cache_element *cache, const int64_t *table, int block_size, int64_t token_stride,
                              int64_t start, int64_t count, const cache_element **rows) {
    int64_t block = start / block_size, offset = start % block_size;
    for (int64_t i = 0; i < count; i++) {
        rows[i] = cache + (table[block] * block_size + offset) * token_stride;
        if (++offset == block_size) {
            block++;
            offset = 0;
        }
    }
}
