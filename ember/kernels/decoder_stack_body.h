// Every decoder layer of a Llama-family model for one engine step (decodes, prompt chunks or both), in one
// call and one OpenMP parallel region: CPU's answer to replaying a CUDA graph. Written once for every dtype and
// weight format; each decoder_stack*.c defines the macros below and includes this file.
//
// Run op by op, a step crosses from Python into C ~9 times per layer and opens as many parallel regions:
// milliseconds of interpreter, ctypes and thread wake-ups per step for SmolLM2, whatever the batch. Here the
// including file's kernels run back to back, their work shared among the region's threads and separated by
// barriers; they are the op-by-op path's own kernels, so results are bit-identical to it.
//
// The macro contract. The including file defines, before including this header:
//   STACK_T     the element type of activations, norms, biases and the KV cache (uint16_t for bfloat16, float;
//               the cache's is int8 in builds with KV_INT8).
//   STACK_NAME  the exported function's name.
// and the in-region kernels: each is called by every thread of the already-open parallel region and shares its
// work among them (an orphaned `omp for`, or a split by omp_get_thread_num()); none opens a region of its own.
//   STACK_GEMM(x, x_stride, weight, bias, out, rows, n, k)
//       out [rows, n] = x [rows, k] (row stride x_stride) @ W^T + bias. weight: the layer struct's
//       `const void *`, in whatever format the GEMM takes (packed panels, a quantized weight's descriptor);
//       bias: const STACK_T * or NULL. May return before other threads finish: the body adds a barrier.
//   STACK_ADD_RMS_NORM(x, residual, weight, out, rows, width, eps)
//       residual += x (skipped when x == residual), out = rms_norm(residual) * weight. Must end with the threads
//       synchronized (an `omp for` without nowait).
//   STACK_ROTARY_AND_CACHE(qkv, cos, sin_signed, slots, cache, rows, num_heads, num_kv_heads, head_dim)
//       RoPE on qkv's q and k heads in place, each row's k and v written to its cache slot. Ends synchronized.
//   STACK_DECODE_ATTENTION(q, q_row_stride, cache, block_tables, max_blocks, context_lens, out, num_seqs,
//                          num_kv_heads, block_size, scale)
//       single-token queries against the paged cache. Ends synchronized.
//   STACK_PREFILL_ATTENTION(q, q_row_stride, cache, block_tables, max_blocks, query_starts, context_lens, out,
//                           num_seqs, num_kv_heads, block_size, scale)
//       causal prompt chunks against the paged cache. May return unsynchronized: the body adds a barrier.
//   STACK_SILU_AND_MUL(gate_up, out, rows, width)
//       out = silu(gate) * up for gate_up rows [gate (width), up (width)]. Ends synchronized (the down
//       projection's GEMM reads `out` right after it).
// HEAD_DIM is a compile-time constant (build.py defines it with QUERIES_PER_KV for the attention kernels).
#include <stddef.h>
#include <stdint.h>

#include "kv_cache.h"

// One layer's tensors, as the caller lays them out: nine pointers (int64 each on the Python side). The four
// projections' weights are whatever STACK_GEMM takes.
typedef struct {
    const STACK_T *input_norm;
    const void *qkv;
    const STACK_T *qkv_bias;
    const void *o;
    const STACK_T *o_bias;
    const STACK_T *post_norm;
    const void *gate_up, *down;
    KV_ELEMENT(STACK_T) *kv_cache;  // [blocks, block_size, 2, kv_heads, HEAD_DIM] (int8 builds: kv_cache.h)
} layer_tensors;

// residual: [rows, hidden] the token embeddings in, the last layer's residual stream out; out: [rows, hidden]
// the final-normed hidden states. Scratch: h [rows, hidden], normed [rows, hidden], qkv [rows, qkv_width],
// attn [rows, heads * HEAD_DIM], gate_up [rows, 2 * intermediate], act [rows, intermediate]. cos/sin_signed:
// [rows, HEAD_DIM]; slots [rows]. Rows [0, num_decodes) are single-token decodes (decode_block_tables
// [num_decodes, decode_max_blocks], decode_context_lens [num_decodes]); the rest are the prompt chunks of
// num_chunks sequences (chunk_block_tables [num_chunks, chunk_max_blocks], chunk_query_starts
// [num_chunks + 1] counted from row num_decodes, chunk_context_lens [num_chunks]), as the attention kernels
// take them.
void STACK_NAME(const layer_tensors *layers, int num_layers, const STACK_T *final_norm, STACK_T *residual,
                STACK_T *out, STACK_T *h, STACK_T *normed, STACK_T *qkv, STACK_T *attn, STACK_T *gate_up,
                STACK_T *act, const STACK_T *cos, const STACK_T *sin_signed, const int64_t *slots, int rows,
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
            STACK_ADD_RMS_NORM(l == 0 ? residual : h, residual, t->input_norm, normed, rows, hidden, eps);
            STACK_GEMM(normed, hidden, t->qkv, t->qkv_bias, qkv, rows, qkv_width, hidden);
#pragma omp barrier
            STACK_ROTARY_AND_CACHE(qkv, cos, sin_signed, slots, t->kv_cache, rows, num_heads, num_kv_heads,
                                   HEAD_DIM);
            if (num_decodes > 0)
                STACK_DECODE_ATTENTION(qkv, qkv_width, t->kv_cache, decode_block_tables, decode_max_blocks,
                                       decode_context_lens, attn, num_decodes, num_kv_heads, block_size, scale);
            if (num_chunks > 0) {
                STACK_PREFILL_ATTENTION(qkv + num_decodes * qkv_width, qkv_width, t->kv_cache, chunk_block_tables,
                                        chunk_max_blocks, chunk_query_starts, chunk_context_lens,
                                        attn + num_decodes * q_width, num_chunks, num_kv_heads, block_size, scale);
#pragma omp barrier
            }
            STACK_GEMM(attn, q_width, t->o, t->o_bias, h, rows, hidden, q_width);
#pragma omp barrier
            STACK_ADD_RMS_NORM(h, residual, t->post_norm, normed, rows, hidden, eps);
            STACK_GEMM(normed, hidden, t->gate_up, NULL, gate_up, rows, 2 * (int64_t)intermediate, hidden);
#pragma omp barrier
            STACK_SILU_AND_MUL(gate_up, act, rows, intermediate);
            STACK_GEMM(act, intermediate, t->down, NULL, h, rows, hidden, intermediate);
#pragma omp barrier
        }
        STACK_ADD_RMS_NORM(h, residual, final_norm, out, rows, hidden, eps);
    }
}
