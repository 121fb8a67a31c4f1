// Every decoder layer of a Llama-family model for one engine step (decodes, prompt chunks or both), in one
// call and one OpenMP parallel region: CPU's answer to replaying a CUDA graph.
//
// Run op by op, a step crosses from Python into C ~9 times per layer and opens as many parallel regions:
// milliseconds of interpreter, ctypes and thread wake-ups per step for SmolLM2, whatever the batch. Here the same
// kernels (the files included below, unchanged, so results are bit-identical to the op-by-op path) run back
// to back, their work shared among the region's threads and separated by barriers.
//
// Built with the HEAD_DIM and QUERIES_PER_KV of the attention kernels; needs AMX (amx_gemm.c).
#include "amx_gemm.c"
#include "fused_ops.c"
#include "paged_decode_attention.c"
#include "paged_prefill_attention.c"

// One layer's tensors, as the caller lays them out: nine pointers (int64 each on the Python side).
typedef struct {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *down;
    uint16_t *kv_cache;  // [blocks, block_size, 2, kv_heads, HEAD_DIM]
} layer_tensors;

// residual: [rows, hidden] the token embeddings in, the last layer's residual stream out; out: [rows, hidden]
// the final-normed hidden states. Scratch: h [rows, hidden], normed [rows, hidden], qkv [rows, qkv_width],
// attn [rows, heads * HEAD_DIM], gate_up [rows, 2 * intermediate], act [rows, intermediate]. cos/sin_signed:
// [rows, HEAD_DIM]; slots [rows]. Rows [0, num_decodes) are single-token decodes (decode_block_tables
// [num_decodes, decode_max_blocks], decode_context_lens [num_decodes]); the rest are the prompt chunks of
// num_chunks sequences (chunk_block_tables [num_chunks, chunk_max_blocks], chunk_query_starts
// [num_chunks + 1] counted from row num_decodes, chunk_context_lens [num_chunks]), as the attention kernels
// take them.
void decoder_stack(const layer_tensors *layers, int num_layers, const uint16_t *final_norm, uint16_t *residual,
                   uint16_t *out, uint16_t *h, uint16_t *normed, uint16_t *qkv, uint16_t *attn, uint16_t *gate_up,
                   uint16_t *act, const uint16_t *cos, const uint16_t *sin_signed, const int64_t *slots, int rows,
                   int num_decodes, const int64_t *decode_block_tables, int64_t decode_max_blocks,
                   const int64_t *decode_context_lens, int num_chunks, const int64_t *chunk_block_tables,
                   int64_t chunk_max_blocks, const int64_t *chunk_query_starts, const int64_t *chunk_context_lens,
                   int hidden, int intermediate, int num_heads, int num_kv_heads, int block_size, float eps,
                   float scale, int num_threads) {
    const int64_t q_width = (int64_t)num_heads * HEAD_DIM;
    const int64_t qkv_width = q_width + 2 * (int64_t)num_kv_heads * HEAD_DIM;
#pragma omp parallel num_threads(num_threads)
    {
        for (int l = 0; l < num_layers; l++) {
            const layer_tensors *t = &layers[l];
            // The first layer's residual stream is the embeddings themselves (nothing to add).
            add_rms_norm_rows(l == 0 ? residual : h, residual, t->input_norm, normed, rows, hidden, eps);
            amx_gemm_share(normed, hidden, t->qkv, t->qkv_bias, qkv, rows, qkv_width, hidden);
#pragma omp barrier
            rotary_and_cache_rows(qkv, cos, sin_signed, slots, t->kv_cache, rows, num_heads, num_kv_heads,
                                  HEAD_DIM);
            if (num_decodes > 0)
                paged_decode_attention_tasks(qkv, qkv_width, t->kv_cache, decode_block_tables, decode_max_blocks,
                                             decode_context_lens, attn, num_decodes, num_kv_heads, block_size,
                                             scale);
            if (num_chunks > 0) {
                paged_prefill_attention_tasks(qkv + num_decodes * qkv_width, qkv_width, t->kv_cache,
                                              chunk_block_tables, chunk_max_blocks, chunk_query_starts,
                                              chunk_context_lens, attn + num_decodes * q_width, num_chunks,
                                              num_kv_heads, block_size, scale);
#pragma omp barrier
            }
            amx_gemm_share(attn, q_width, t->o, t->o_bias, h, rows, hidden, q_width);
#pragma omp barrier
            add_rms_norm_rows(h, residual, t->post_norm, normed, rows, hidden, eps);
            amx_gemm_share(normed, hidden, t->gate_up, NULL, gate_up, rows, 2 * (int64_t)intermediate, hidden);
#pragma omp barrier
            silu_and_mul_rows(gate_up, act, rows, intermediate);
            amx_gemm_share(act, intermediate, t->down, NULL, h, rows, hidden, intermediate);
#pragma omp barrier
        }
        add_rms_norm_rows(h, residual, final_norm, out, rows, hidden, eps);
    }
}
