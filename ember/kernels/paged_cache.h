// Where a sequence's tokens sit in one layer's paged KV cache ([blocks, block_size, 2, kv_heads, HEAD_DIM] of
// the model's dtype, or of int8 with scales: kv_cache.h), shared by the attention kernels. PAGED_CACHE_VALUE:
// the element type of a cache in the model's dtype (bfloat16's bits unless the includer says float).
#pragma once
#include <stdint.h>

#include "kv_cache.h"

#ifndef PAGED_CACHE_VALUE
#define PAGED_CACHE_VALUE uint16_t
#endif
typedef KV_ELEMENT(PAGED_CACHE_VALUE) cache_element;  // the model dtype's, or int8

// The cache rows of positions [start, start + count): one division per tile, not one per row, and one multiply
// per block: within a block the rows are token_stride apart.
static inline void cache_rows(const cache_element *cache, const int64_t *table, int block_size, int64_t token_stride,
                              int64_t start, int64_t count, const cache_element **rows) {
    int64_t block = start / block_size, offset = start % block_size;
    const cache_element *row = cache + (table[block] * block_size + offset) * token_stride;
    for (int64_t i = 0; i < count; i++) {
        rows[i] = row;
        row += token_stride;
        if (++offset == block_size && i + 1 < count) {  // the table may end with this block
            offset = 0;
            row = cache + table[++block] * block_size * token_stride;
        }
    }
}
