/* Worker stage, CUDA ops: the C API of libpipeline_cuda.so (kernels.cu, attention.cu, fused.cu,
 * layer_signal.cu).
 *
 * Same layouts as the CPU ops (cython_ext/cpu_ops_*.h): caches are
 * [num_blocks, block_size, num_kv_heads, head_dim] in device memory; index tensors are
 * device int32/int64 arrays. Every function enqueues work on `stream` (a cudaStream_t passed
 * as void * so this header needs no CUDA include and Cython can compile it as plain C) and
 * returns 0, a cudaError_t value (> 0) from the launch, or a PIPELINE_CUDA_E* code (< 0).
 * Index values are not validated on the device: pipeline.worker.ops checks layouts, and
 * out-of-range slots are skipped rather than written. Owns no state.
 */
#ifndef PIPELINE_CUDA_H
#define PIPELINE_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    PIPELINE_CUDA_OK = 0,
    PIPELINE_CUDA_EDTYPE = -1,    /* dtype code not 0 (f32), 1 (bf16) or 2 (f16) */
    PIPELINE_CUDA_EHEAD_DIM = -2, /* head_dim above PIPELINE_CUDA_MAX_HEAD_DIM */
    PIPELINE_CUDA_ENOMEM = -3,    /* host allocation for a host-function argument failed */
    PIPELINE_CUDA_ESPLITS = -4,   /* num_splits < 1, or > 1 without a workspace */
    PIPELINE_CUDA_EHEADS = -5,    /* num_kv_heads < 1 or not dividing num_heads */
};
#define PIPELINE_CUDA_MAX_HEAD_DIM 256

/* Write key/value rows [num_tokens, num_kv_heads, head_dim] (row strides in elements) into
 * the caches at slot_mapping[t] = block * block_size + offset; slots < 0 or >= num_slots
 * are skipped. */
int pipeline_cuda_reshape_and_cache(
    const void *key, const void *value, void *k_cache, void *v_cache,
    const int64_t *slot_mapping, int64_t num_tokens, int64_t key_stride, int64_t value_stride,
    int64_t num_slots, int64_t num_kv_heads, int64_t head_dim, int dtype, void *stream);

/* How many splits of the context paged attention should use for this batch shape on the
 * current device (1 = none). max_context bounds every seq_len (max_blocks * block_size). */
int pipeline_cuda_attention_splits(int64_t num_tokens, int64_t num_heads, int64_t max_context);

/* Causal paged attention over a varlen batch: out [num_tokens, num_heads, head_dim]
 * (contiguous), q rows `q_stride` elements apart. Rows past cu_seqlens_q[num_seqs] are
 * zeroed. With num_splits > 1, `workspace` is a device float32 buffer of
 * num_tokens * num_heads * num_splits * (head_dim + 2) elements. Keys whose block id is
 * outside [0, num_blocks), and positions past max_blocks * block_size, are left out rather
 * than read (a wrong result, never an illegal address). */
int pipeline_cuda_paged_attention(
    void *out, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *cu_seqlens_q, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t num_seqs, int64_t num_tokens, int64_t q_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
    int64_t max_blocks, float scale, int dtype, int num_splits, float *workspace, void *stream);

/* For each of num_caches caches, copy block pairs[i][0] onto pairs[i][1] (pairs is a
 * device int64 [num_pairs, 2]); blocks are block_bytes long. Pairs with a block id outside
 * [0, num_blocks) are skipped. Pairs are copied concurrently: no dst may be another pair's
 * src or dst (copy-on-write pairs never are: every dst is a freshly allocated block). */
int pipeline_cuda_copy_blocks(
    void *const *caches, int64_t num_caches, const int64_t *pairs, int64_t num_pairs,
    int64_t num_blocks, int64_t block_bytes, void *stream);

/* Enqueue on `stream` a host function that calls pipeline_signal_publish(shm_base, step,
 * layer) (cython_ext/shm_atomic.h) once all work before it on the stream is done. The
 * caller makes `stream` (a side stream) wait for the layer's KV write first. */
int pipeline_cuda_enqueue_layer_signal(void *stream, void *shm_base, int64_t step, int layer);

/* fused.cu, half types only (dtype 1 or 2; float32 keeps torch's ops). x and h are
 * contiguous [rows, dim]: x += add (skipped when add is NULL), then
 * h = weight * T(rmsnorm(x)) with the norm in float32. */
int pipeline_cuda_add_rms_norm(void *x, const void *add, void *h, const void *weight,
                               int64_t rows, int64_t dim, float eps, int dtype, void *stream);

/* out [rows, inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:] (gate_up contiguous). */
int pipeline_cuda_silu_mul(void *out, const void *gate_up, int64_t rows, int64_t inter,
                           int dtype, void *stream);

/* Rotate-half RoPE in place on x [tokens, heads, head_dim], rows row_stride elements apart,
 * with contiguous [tokens, head_dim] tables cos = [c, c] and sin = [-s, s] in x's dtype. */
int pipeline_cuda_rotary(void *x, const void *cos, const void *sin, int64_t tokens,
                         int64_t heads, int64_t head_dim, int64_t row_stride, int dtype,
                         void *stream);

/* Human-readable text for a return code of the functions above. */
const char *pipeline_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif
