# cython: language_level=3
# distutils: language = c++
"""Worker stage, CUDA ops: Cython entry points over libpipeline_cuda.so (pipeline_cuda.h).

Same signatures as ``pipeline._ext.cpu_ops`` so ``pipeline.worker.ops`` dispatches to either
with one call: raw ``data_ptr()`` addresses, sizes, a dtype code and a ``cudaStream_t``
(``torch.cuda.current_stream().cuda_stream``). Kernels are only enqueued, so index values
cannot be checked here; these return -1 like the CPU ops do on success and raise
RuntimeError when a launch fails. Owns no state.
"""
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free


cdef extern from "pipeline_cuda.h":
    int pipeline_cuda_reshape_and_cache(
        const void *key, const void *value, void *k_cache, void *v_cache,
        const int64_t *slot_mapping, int64_t num_tokens, int64_t key_stride,
        int64_t value_stride, int64_t num_slots, int64_t num_kv_heads, int64_t head_dim,
        int dtype, void *stream) nogil
    int pipeline_cuda_paged_attention(
        void *out, const void *q, const void *k_cache, const void *v_cache,
        const int32_t *cu_seqlens_q, const int32_t *seq_lens, const int32_t *block_tables,
        int64_t num_seqs, int64_t num_tokens, int64_t q_stride, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
        int64_t max_blocks, float scale, int dtype, int num_splits, float *workspace,
        void *stream) nogil
    int pipeline_cuda_attention_splits(int64_t num_tokens, int64_t num_heads,
                                       int64_t max_context) nogil
    int pipeline_cuda_copy_blocks(
        void *const *caches, int64_t num_caches, const int64_t *pairs, int64_t num_pairs,
        int64_t num_blocks, int64_t block_bytes, void *stream) nogil
    int pipeline_cuda_enqueue_layer_signal(void *stream, void *shm_base, int64_t step,
                                           int layer) nogil
    int pipeline_cuda_add_rms_norm(void *x, const void *add, void *h, const void *weight,
                                   int64_t rows, int64_t dim, float eps, int dtype,
                                   void *stream) nogil
    int pipeline_cuda_silu_mul(void *out, const void *gate_up, int64_t rows, int64_t inter,
                               int dtype, void *stream) nogil
    int pipeline_cuda_rotary(void *x, const void *cos, const void *sin, int64_t tokens,
                             int64_t heads, int64_t head_dim, int64_t row_stride, int dtype,
                             void *stream) nogil
    const char *pipeline_cuda_error_string(int code)
    int PIPELINE_CUDA_MAX_HEAD_DIM

MAX_HEAD_DIM = PIPELINE_CUDA_MAX_HEAD_DIM


cdef int _check(int code, str what) except -1:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}: "
                           f"{pipeline_cuda_error_string(code).decode()}")
    return 0


def reshape_and_cache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                      uintptr_t slot_mapping, int64_t num_tokens, int64_t key_stride,
                      int64_t value_stride, int64_t num_blocks, int64_t block_size,
                      int64_t num_kv_heads, int64_t head_dim, int dtype,
                      uintptr_t stream=0) -> int:
    """Enqueue the K/V write; slots outside [0, num_blocks * block_size) are skipped."""
    cdef int code
    with nogil:
        code = pipeline_cuda_reshape_and_cache(
            <const void *>key, <const void *>value, <void *>k_cache, <void *>v_cache,
            <const int64_t *>slot_mapping, num_tokens, key_stride, value_stride,
            num_blocks * block_size, num_kv_heads, head_dim, dtype, <void *>stream)
    _check(code, "reshape_and_cache")
    return -1


def paged_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
                    uintptr_t cu_seqlens_q, uintptr_t seq_lens, uintptr_t block_tables,
                    int64_t num_seqs, int64_t num_tokens, int64_t q_stride,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                    float scale, int dtype, uintptr_t stream=0, int num_splits=1,
                    uintptr_t workspace=0) -> int:
    """Enqueue causal paged attention into ``out``. With ``num_splits`` > 1 (see
    attention_splits) ``workspace`` is a device float32 buffer of
    num_tokens * num_heads * num_splits * (head_dim + 2) elements."""
    cdef int code
    with nogil:
        code = pipeline_cuda_paged_attention(
            <void *>out, <const void *>q, <const void *>k_cache, <const void *>v_cache,
            <const int32_t *>cu_seqlens_q, <const int32_t *>seq_lens,
            <const int32_t *>block_tables, num_seqs, num_tokens, q_stride, num_heads,
            num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale, dtype, num_splits,
            <float *>workspace, <void *>stream)
    _check(code, "paged_attention")
    return -1


def attention_splits(int64_t num_tokens, int64_t num_heads, int64_t max_context) -> int:
    """Context splits paged_attention should use for this shape on the current device."""
    return pipeline_cuda_attention_splits(num_tokens, num_heads, max_context)


def copy_blocks(list caches, uintptr_t pairs, int64_t num_pairs, int64_t num_blocks,
                int64_t block_bytes, uintptr_t stream=0) -> int:
    """Enqueue block copies (pairs is a device int64 [num_pairs, 2]) in every cache; pairs
    with a block id outside [0, num_blocks) are skipped."""
    cdef int64_t n = len(caches), i
    cdef int code
    cdef void **ptrs = <void **>malloc(max(n, 1) * sizeof(void *))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            ptrs[i] = <void *><uintptr_t>caches[i]
        with nogil:
            code = pipeline_cuda_copy_blocks(ptrs, n, <const int64_t *>pairs, num_pairs,
                                             num_blocks, block_bytes, <void *>stream)
    finally:
        free(ptrs)
    _check(code, "copy_blocks")
    return -1


def enqueue_layer_signal(uintptr_t stream, uintptr_t shm_base, int64_t step, int layer) -> None:
    """Enqueue a host function publishing (step, layer) into the layer-signal segment at
    ``shm_base`` once the work already on ``stream`` has finished."""
    cdef int code
    with nogil:
        code = pipeline_cuda_enqueue_layer_signal(<void *>stream, <void *>shm_base, step, layer)
    _check(code, "enqueue_layer_signal")


def add_rms_norm(uintptr_t x, uintptr_t add, uintptr_t h, uintptr_t weight, int64_t rows,
                 int64_t dim, float eps, int dtype, uintptr_t stream=0) -> None:
    """Enqueue x += add (add 0: none), h = weight * rmsnorm(x) (half types; fused.cu)."""
    cdef int code
    with nogil:
        code = pipeline_cuda_add_rms_norm(<void *>x, <const void *>add, <void *>h,
                                          <const void *>weight, rows, dim, eps, dtype,
                                          <void *>stream)
    _check(code, "add_rms_norm")


def silu_mul(uintptr_t out, uintptr_t gate_up, int64_t rows, int64_t inter, int dtype,
             uintptr_t stream=0) -> None:
    """Enqueue out = silu(gate) * up over gate_up [rows, 2 * inter] (half types; fused.cu)."""
    cdef int code
    with nogil:
        code = pipeline_cuda_silu_mul(<void *>out, <const void *>gate_up, rows, inter, dtype,
                                      <void *>stream)
    _check(code, "silu_mul")


def rotary(uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t tokens, int64_t heads,
           int64_t head_dim, int64_t row_stride, int dtype, uintptr_t stream=0) -> None:
    """Enqueue rotate-half RoPE in place on x [tokens, heads, head_dim] (half types; fused.cu)."""
    cdef int code
    with nogil:
        code = pipeline_cuda_rotary(<void *>x, <const void *>cos, <const void *>sin, tokens,
                                    heads, head_dim, row_stride, dtype, <void *>stream)
    _check(code, "rotary")
