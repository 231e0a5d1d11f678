# cython: language_level=3
"""Worker stage, CPU ops: Cython entry points over the C kernels in cpu_ops_*.h.

Called by ``pipeline.worker.ops`` with raw ``data_ptr()`` addresses after it has checked
shapes, dtypes, devices and contiguity; these functions check the index values (slots,
block ids, sequence lengths) in C and return the first bad index or -1. Every kernel runs
with the GIL released, on OpenMP threads. The ``stream`` arguments exist so the signature
matches ``cuda_ops``; they are ignored on CPU. Owns no state.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport malloc, free


cdef extern from "cpu_ops_dtype.h":
    int64_t pipe_dtype_size(int dtype) nogil

cdef extern from "cpu_ops_cache.h":
    int64_t pipeline_cpu_reshape_and_cache(
        const char *key, const char *value, char *k_cache, char *v_cache,
        const int64_t *slot_mapping, int64_t num_tokens, int64_t key_stride,
        int64_t value_stride, int64_t num_blocks, int64_t block_size, int64_t row_elems,
        int64_t elem_size) nogil
    int64_t pipeline_cpu_copy_blocks(
        char *const *caches, int64_t num_caches, const int64_t *pairs, int64_t num_pairs,
        int64_t num_blocks, int64_t block_bytes) nogil

cdef extern from "cpu_ops_attn.h":
    ctypedef struct pipe_attn_args:
        const char *q
        const char *k_cache
        const char *v_cache
        const int32_t *cu_seqlens_q
        const int32_t *seq_lens
        const int32_t *block_tables
        int64_t num_seqs, num_tokens, q_stride, num_heads, num_kv_heads, head_dim
        int64_t num_blocks, block_size, max_blocks
        float scale
        int dtype
        int q_dtype
    int64_t pipeline_cpu_paged_attention(char *out, const pipe_attn_args *a) nogil

cdef extern from "cpu_ops_bw.h":
    double pipe_read_sum(const float *x, int64_t n, int threads) nogil
    double pipe_amx_peak(int kind, int64_t iters, int threads) nogil
    double pipe_fma_peak(int64_t iters, int threads) nogil

cdef extern from "cpu_ops_gemv.h":
    int PIPE_GEMV_MAX_M
    void pipeline_cpu_gemv(float *y, int64_t ldy, const float *x, int64_t ldx, const float *W,
                           const float *bias, int64_t M, int64_t K, int64_t N, int kn) nogil

cdef extern from "cpu_ops_gemv_lp.h":
    int pipe_bf16_level(int64_t K) nogil
    void pipeline_cpu_set_isa(int cap) nogil
    int pipeline_cpu_gemv_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                               const uint16_t *W, const float *bias, int64_t M, int64_t K,
                               int64_t N) nogil

cdef extern from "cpu_ops_gemv_i8.h":
    int pipe_i8_level(int64_t K) nogil
    int pipeline_cpu_gemv_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                             const int8_t *Q, const float *scale,
                             const float *bias, int64_t M, int64_t K, int64_t N) nogil
    void pipeline_cpu_dequant_i8(void *D, int dtype, const int8_t *Q, const float *scale,
                                 int64_t N, int64_t K) nogil

cdef extern from "cpu_ops_gemv_q4.h":
    int pipe_q4_level() nogil
    int PIPE_Q4_GEMV_MAX_M
    int pipe_linear_q4_route(int64_t M) nogil
    int pipeline_cpu_gemv_q4(float *y, int64_t ldy, const float *x, int64_t ldx,
                             const uint8_t *P, const uint16_t *S, const uint8_t *Z,
                             const int32_t *perm, const float *bias, int64_t M, int64_t K,
                             int64_t N, int64_t gs) nogil
    int64_t pipeline_cpu_dequant_q4(void *D, int dtype, const uint8_t *P, const uint16_t *S,
                                    const uint8_t *Z, const int32_t *perm, int64_t N, int64_t K,
                                    int64_t gs, const int64_t *rows, int64_t R) nogil

cdef extern from "cpu_ops_amx_gemm.h":
    int pipe_amx_ok() nogil
    int pipe_amx_i8_fits(int64_t K) nogil
    int pipeline_cpu_amx_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                              const uint16_t *W, const float *bias, int64_t M, int64_t K,
                              int64_t N) nogil
    int pipeline_cpu_amx_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                            const int8_t *P, const float *scale, const float *bias, int64_t M,
                            int64_t K, int64_t N) nogil
    int PIPE_BF16_GEMV_MAX_M
    int PIPE_I8_GEMV_MAX_M
    int pipe_linear_bf16_route(int64_t M, int64_t K) nogil
    int pipe_linear_i8_route(int64_t M, int64_t K) nogil
    int pipeline_cpu_linear_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                 const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                 int64_t N) nogil
    int pipeline_cpu_linear_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                               const int8_t *P, const float *scale, const float *bias, int64_t M,
                               int64_t K, int64_t N) nogil
    int pipeline_cpu_swiglu(float *act, int64_t ldact, const float *x, int64_t ldx,
                            const void *W, const float *scale, int64_t M, int64_t K,
                            int64_t inter) nogil
    int pipeline_cpu_mlp_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                              const uint16_t *Wgu, const uint16_t *Wd, int64_t M, int64_t K,
                              int64_t inter) nogil

cdef extern from "cpu_ops_decoder.h":
    ctypedef struct pipe_layer:
        int fmt
        const void *w[4]
        const float *scale[4]
        const float *bias[4]
        const float *ln_in
        const float *ln_post
        float eps_in, eps_post
        char *k_cache
        char *v_cache
        const uint8_t *zero[4]
        const int32_t *perm[4]
        int64_t group_size[4]
    ctypedef struct pipe_step:
        int64_t T, hidden, q_size, kv_size, num_heads, num_kv_heads, head_dim, inter
        float *residual
        float *h
        float *o
        float *down
        float *qkv
        float *attn
        float *gate_up
        float *act
        const int64_t *positions
        const int64_t *slots
        const float *cos
        const float *sin
        int64_t max_positions, num_slots
        int cache_dtype
        pipe_attn_args attn_args
    int64_t pipeline_cpu_decoder_layers(const pipe_layer *layers, int64_t first,
                                        int64_t num_layers, pipe_step *s) nogil
    int pipe_decoder_takes(const pipe_layer *layers, int64_t n, int64_t T, const int64_t *K) nogil

cdef extern from "cpu_ops_fused.h":
    void pipeline_cpu_rms_norm(float *out, const float *x, float *residual, const float *weight,
                               int64_t num_tokens, int64_t hidden, int64_t out_stride,
                               int64_t x_stride, int64_t res_stride, float eps) nogil
    int64_t pipeline_cpu_rope_and_cache(
        float *q, float *k, const float *v, int64_t q_stride, int64_t k_stride,
        int64_t v_stride, const int64_t *positions, const float *cos_table,
        const float *sin_table, int64_t max_positions, char *k_cache, char *v_cache,
        const int64_t *slot_mapping, int64_t num_tokens, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int dtype) nogil
    void pipeline_cpu_silu_and_mul(float *out, const float *x, int64_t num_tokens,
                                   int64_t inter, int64_t x_stride) nogil
    void pipeline_cpu_argmax(int64_t *out, const float *x, int64_t rows, int64_t n,
                             int64_t ld) nogil


def reshape_and_cache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                      uintptr_t slot_mapping, int64_t num_tokens, int64_t key_stride,
                      int64_t value_stride, int64_t num_blocks, int64_t block_size,
                      int64_t num_kv_heads, int64_t head_dim, int dtype,
                      uintptr_t stream=0) -> int:
    """Write K/V rows to their slots; returns the first out-of-range token or -1."""
    cdef int64_t bad
    with nogil:
        bad = pipeline_cpu_reshape_and_cache(
            <const char *>key, <const char *>value, <char *>k_cache, <char *>v_cache,
            <const int64_t *>slot_mapping, num_tokens, key_stride, value_stride,
            num_blocks, block_size, num_kv_heads * head_dim, pipe_dtype_size(dtype))
    return bad


def paged_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
                    uintptr_t cu_seqlens_q, uintptr_t seq_lens, uintptr_t block_tables,
                    int64_t num_seqs, int64_t num_tokens, int64_t q_stride,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                    float scale, int dtype, uintptr_t stream=0, int q_dtype=-1) -> int:
    """Causal paged attention; returns the first malformed sequence or -1. q and out are in
    the cache dtype, or in ``q_dtype`` when given (float32 over a half cache)."""
    cdef pipe_attn_args a
    cdef int64_t bad
    a.q = <const char *>q
    a.k_cache = <const char *>k_cache
    a.v_cache = <const char *>v_cache
    a.cu_seqlens_q = <const int32_t *>cu_seqlens_q
    a.seq_lens = <const int32_t *>seq_lens
    a.block_tables = <const int32_t *>block_tables
    a.num_seqs = num_seqs
    a.num_tokens = num_tokens
    a.q_stride = q_stride
    a.num_heads = num_heads
    a.num_kv_heads = num_kv_heads
    a.head_dim = head_dim
    a.num_blocks = num_blocks
    a.block_size = block_size
    a.max_blocks = max_blocks
    a.scale = scale
    a.dtype = dtype
    a.q_dtype = dtype if q_dtype < 0 else q_dtype
    with nogil:
        bad = pipeline_cpu_paged_attention(<char *>out, &a)
    return bad


def copy_blocks(list caches, uintptr_t pairs, int64_t num_pairs, int64_t num_blocks,
                int64_t block_bytes, uintptr_t stream=0) -> int:
    """Copy block pairs (src, dst) in every cache; returns the first bad pair or -1."""
    cdef int64_t n = len(caches), i, bad
    cdef char **ptrs = <char **>malloc(max(n, 1) * sizeof(char *))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            ptrs[i] = <char *><uintptr_t>caches[i]
        with nogil:
            bad = pipeline_cpu_copy_blocks(ptrs, n, <const int64_t *>pairs, num_pairs,
                                           num_blocks, block_bytes)
    finally:
        free(ptrs)
    return bad


def rms_norm(uintptr_t out, uintptr_t x, uintptr_t residual, uintptr_t weight,
             int64_t num_tokens, int64_t hidden, int64_t out_stride, int64_t x_stride,
             int64_t res_stride, float eps) -> None:
    """float32 RMSNorm of x (+ residual, written back when residual != 0) into out."""
    with nogil:
        pipeline_cpu_rms_norm(<float *>out, <const float *>x, <float *>residual,
                              <const float *>weight, num_tokens, hidden, out_stride, x_stride,
                              res_stride, eps)


def rope_and_cache(uintptr_t q, uintptr_t k, uintptr_t v, int64_t q_stride, int64_t k_stride,
                   int64_t v_stride, uintptr_t positions, uintptr_t cos_table,
                   uintptr_t sin_table, int64_t max_positions, uintptr_t k_cache,
                   uintptr_t v_cache, uintptr_t slot_mapping, int64_t num_tokens,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t num_slots, int dtype) -> int:
    """RoPE on float32 q/k rows in place, then k/v to their cache slots; returns the first
    token with an out-of-range position or slot, or -1."""
    cdef int64_t bad
    with nogil:
        bad = pipeline_cpu_rope_and_cache(
            <float *>q, <float *>k, <const float *>v, q_stride, k_stride, v_stride,
            <const int64_t *>positions, <const float *>cos_table, <const float *>sin_table,
            max_positions, <char *>k_cache, <char *>v_cache, <const int64_t *>slot_mapping,
            num_tokens, num_heads, num_kv_heads, head_dim, num_slots, dtype)
    return bad


def silu_and_mul(uintptr_t out, uintptr_t x, int64_t num_tokens, int64_t inter,
                 int64_t x_stride) -> None:
    """out [T, I] = silu(x[:, :I]) * x[:, I:] in float32."""
    with nogil:
        pipeline_cpu_silu_and_mul(<float *>out, <const float *>x, num_tokens, inter, x_stride)


def argmax(uintptr_t out, uintptr_t x, int64_t rows, int64_t n, int64_t ld) -> None:
    """int64 out [rows] = argmax of each float32 row of x [rows, n] (rows ld apart), as
    torch.argmax answers: the first maximum, or the first NaN."""
    with nogil:
        pipeline_cpu_argmax(<int64_t *>out, <const float *>x, rows, n, ld)


GEMV_MAX_M = PIPE_GEMV_MAX_M


def gemv(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t weight, uintptr_t bias,
         int64_t m, int64_t k, int64_t n, bint kn) -> None:
    """float32 y [m, n] = x [m, k] @ W (+ bias) for m <= GEMV_MAX_M; W is [k, n] when kn,
    else [n, k]."""
    with nogil:
        pipeline_cpu_gemv(<float *>y, ldy, <const float *>x, ldx, <const float *>weight,
                          <const float *>bias, m, k, n, kn)


def read_sum(uintptr_t x, int64_t n, int threads) -> float:
    """The sum of n float32 at x, read by ``threads`` threads at the memory system's pace:
    ``pipeline bench worker``'s read-bandwidth probe (the sum keeps the reads alive)."""
    cdef double total
    with nogil:
        total = pipe_read_sum(<const float *>x, n, threads)
    return total


ISA_NAMES = ("portable", "avx2", "avx512", "amx")


def set_isa(str cap) -> None:
    """Cap the instruction set of the bf16/int8/int4 kernels ("amx", the default, "avx512",
    "avx2" or "portable"); each still uses the best level below the cap that the CPU has."""
    if cap not in ISA_NAMES:
        raise ValueError(f"isa must be one of {', '.join(ISA_NAMES)}, got {cap!r}")
    pipeline_cpu_set_isa(ISA_NAMES.index(cap))


def lp_isa(str kind, int64_t k) -> str:
    """The instruction set the "bf16", "int8" or "int4" kernel runs with for rows of k values."""
    if kind not in ("bf16", "int8", "int4"):
        raise ValueError(f"kind must be bf16, int8 or int4, got {kind!r}")
    return ISA_NAMES[pipe_bf16_level(k) if kind == "bf16" else
                     pipe_i8_level(k) if kind == "int8" else pipe_q4_level()]


BF16_GEMV_MAX_M = PIPE_BF16_GEMV_MAX_M
INT8_GEMV_MAX_M = PIPE_I8_GEMV_MAX_M
INT4_GEMV_MAX_M = PIPE_Q4_GEMV_MAX_M
ROUTE_NAMES = ("blas", "gemv", "amx")


def linear_route(str kind, int64_t m, int64_t k) -> str:
    """The kernel linear_bf16 / linear_i8 / an int4 weight take for m rows of k values:
    "gemv", "amx" or "blas" (not taken: the caller multiplies a dequantised copy)."""
    if kind == "bf16":
        return ROUTE_NAMES[pipe_linear_bf16_route(m, k)]
    if kind == "int8":
        return ROUTE_NAMES[pipe_linear_i8_route(m, k)]
    if kind == "int4":
        return ROUTE_NAMES[pipe_linear_q4_route(m)]
    raise ValueError(f"kind must be bf16, int8 or int4, got {kind!r}")


def linear_bf16(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t weight,
                uintptr_t bias, int64_t m, int64_t k, int64_t n) -> bool:
    """As gemv_bf16, by the GEMV up to BF16_GEMV_MAX_M rows and on AMX tiles beyond (the
    GEMV where AMX is absent and the CPU has AVX-512 BF16 or AVX2, or m <= GEMV_MAX_M);
    False (nothing written) where neither applies: the caller multiplies a dequantised copy."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_linear_bf16(<float *>y, ldy, <const float *>x, ldx,
                                      <const uint16_t *>weight, <const float *>bias, m, k, n)
    if rc < 0:
        raise MemoryError(f"linear_bf16: no scratch for {m} rows of {k} values")
    return rc == 0


def linear_i8(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t q, uintptr_t scale,
              uintptr_t bias, int64_t m, int64_t k, int64_t n) -> bool:
    """As gemv_i8, by the GEMV up to INT8_GEMV_MAX_M rows and on AMX tiles beyond (the GEMV
    up to 32 rows where AMX or amx_i8_fits(k) is not, any rows on AVX2 alone); False
    (nothing written) otherwise."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_linear_i8(<float *>y, ldy, <const float *>x, ldx, <const int8_t *>q,
                                    <const float *>scale, <const float *>bias, m, k, n)
    if rc < 0:
        raise MemoryError(f"linear_i8: no scratch for {m} rows of {k} values")
    return rc == 0


def swiglu(uintptr_t act, int64_t ldact, uintptr_t x, int64_t ldx, uintptr_t weight,
           uintptr_t scale, int64_t m, int64_t k, int64_t inter) -> bool:
    """act [m, inter] = silu(x @ gate^T) * (x @ up^T) from a gate_up weight [2 * inter, k]
    packed as for linear_bf16 (scale 0) or linear_i8, on AMX tiles with gate_up never
    written; False (nothing written) where that kernel does not run (m within the GEMV's
    rows, no AMX, inter not a multiple of 16): the caller runs the projection and
    silu_and_mul, which give the same floats."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_swiglu(<float *>act, ldact, <const float *>x, ldx, <const void *>weight,
                                 <const float *>scale, m, k, inter)
    if rc < 0:
        raise MemoryError(f"swiglu: no scratch for {m} rows of {k} values")
    return rc == 0


def mlp_bf16(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t gate_up,
             uintptr_t down, int64_t m, int64_t k, int64_t inter) -> bool:
    """y [m, k] = down(silu(x @ gate^T) * (x @ up^T)) for bf16 gate_up [2 * inter, k] and
    down [k, inter] packed as for linear_bf16, on AMX tiles with the activation passed as
    the down product's bf16 tiles; False (nothing written) where swiglu would decline."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_mlp_bf16(<float *>y, ldy, <const float *>x, ldx, <const uint16_t *>gate_up,
                                   <const uint16_t *>down, m, k, inter)
    if rc < 0:
        raise MemoryError(f"mlp_bf16: no scratch for {m} rows of {inter} values")
    return rc == 0


def amx_ok() -> bool:
    """Whether the AMX kernels run: the CPU has AMX bf16/int8, the kernel granted this process
    the tile data (asked once) and set_isa does not cap it."""
    return bool(pipe_amx_ok())


def amx_i8_fits(int64_t k) -> bool:
    """Whether the int8 AMX kernel takes rows of k values (ceil(k/4) a multiple of 16)."""
    return bool(pipe_amx_i8_fits(k))


def amx_peak(int kind, int64_t iters, int threads) -> float:
    """FLOP/s of ``threads`` threads issuing tile products with no memory traffic: kind 0
    TDPBF16PS, 1 TDPBSSD (int8 ops). 0.0 without AMX."""
    cdef double r
    with nogil:
        r = pipe_amx_peak(kind, iters, threads)
    return r


PEAK_KINDS = ("fp32_fma", "amx_bf16", "amx_int8")


def peak_flops(str kind, int threads, int tries=5) -> float:
    """The peak FLOP/s (int8: ops/s) of one instruction kind on ``threads`` threads, no memory
    traffic, best of ``tries``: "fp32_fma" (AVX2 VFMADD231PS), "amx_bf16" (TDPBF16PS),
    "amx_int8" (TDPBSSD). ValueError for another kind or one this CPU lacks."""
    if kind not in PEAK_KINDS:
        raise ValueError(f"kind must be one of {', '.join(PEAK_KINDS)}, got {kind!r}")
    cdef double r = 0.0, best = 0.0
    cdef int code = PEAK_KINDS.index(kind)
    cdef int64_t fma_iters = 20_000_000 // max(1, threads)  # ~0.05 s at 100 GFLOP/s
    for _ in range(max(1, tries)):
        with nogil:
            if code == 0:
                r = pipe_fma_peak(fma_iters, threads)
            else:
                r = pipe_amx_peak(code - 1, 200_000, threads)
        best = max(best, r)
    if best <= 0.0:
        raise ValueError(f"peak_flops: this CPU has no {kind}")
    return best


def gemv_bf16(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t weight,
              uintptr_t bias, int64_t m, int64_t k, int64_t n) -> None:
    """float32 y [m, n] = x [m, k] @ W^T (+ bias), W bfloat16 packed [ceil(n/16), kp/2, 16, 2]
    (kp: k rounded up to 32; cpu_ops_gemv_lp.h). Any m."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_gemv_bf16(<float *>y, ldy, <const float *>x, ldx,
                                    <const uint16_t *>weight, <const float *>bias, m, k, n)
    if rc != 0:
        raise MemoryError(f"gemv_bf16: no scratch for {m} rows of {k} values")


def amx_bf16(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t weight,
             uintptr_t bias, int64_t m, int64_t k, int64_t n) -> bool:
    """As gemv_bf16, on AMX tiles; False (nothing written) without AMX or scratch memory."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_amx_bf16(<float *>y, ldy, <const float *>x, ldx,
                                   <const uint16_t *>weight, <const float *>bias, m, k, n)
    return rc == 0


def amx_i8(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t q, uintptr_t scale,
           uintptr_t bias, int64_t m, int64_t k, int64_t n) -> bool:
    """As gemv_i8, on AMX tiles (the same floats); False (nothing written) without AMX, for a
    k that amx_i8_fits refuses, or without scratch memory."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_amx_i8(<float *>y, ldy, <const float *>x, ldx, <const int8_t *>q,
                                 <const float *>scale, <const float *>bias, m, k, n)
    return rc == 0


def gemv_i8(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t q, uintptr_t scale,
            uintptr_t bias, int64_t m, int64_t k, int64_t n) -> None:
    """float32 y [m, n] = x [m, k] @ (scale * Q)^T (+ bias), Q int8 in [-127, 127] packed
    [ceil(n/16), ceil(k/4), 16, 4] (cpu_ops_gemv_i8.h), scale float32 with ceil(n/16) * 16
    entries; x quantised per row to int8. Any m."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_gemv_i8(<float *>y, ldy, <const float *>x, ldx, <const int8_t *>q,
                                  <const float *>scale,
                                  <const float *>bias, m, k, n)
    if rc != 0:
        raise MemoryError(f"gemv_i8: no scratch for {m} rows of {k} values")


def dequant_i8(uintptr_t out, int dtype, uintptr_t q, uintptr_t scale, int64_t n, int64_t k) -> None:
    """out [n, k] = scale[:, None] * Q (packed as for gemv_i8) as float32 (dtype 0) or
    bfloat16 (dtype 1)."""
    with nogil:
        pipeline_cpu_dequant_i8(<void *>out, dtype, <const int8_t *>q, <const float *>scale, n, k)


def gemv_q4(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, uintptr_t q, uintptr_t scale,
            uintptr_t zero, uintptr_t perm, uintptr_t bias, int64_t m, int64_t k, int64_t n,
            int64_t group_size) -> None:
    """float32 y [m, n] = x [m, k] @ W^T (+ bias), W group-wise 4-bit (cpu_ops_gemv_q4.h):
    q uint8 [ceil(n/16), ceil(k/gs) * gs / 8, 64], scale fp16 and zero uint8 (0: all 8)
    [ceil(n/16), ceil(k/gs), 16], perm int32 [k] or 0; x quantised per row to int8. Any m."""
    cdef int rc
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
    with nogil:
        rc = pipeline_cpu_gemv_q4(<float *>y, ldy, <const float *>x, ldx, <const uint8_t *>q,
                                  <const uint16_t *>scale, <const uint8_t *>zero,
                                  <const int32_t *>perm, <const float *>bias, m, k, n, group_size)
    if rc != 0:
        raise MemoryError(f"gemv_q4: no scratch for {m} rows of {k} values")


def dequant_q4(uintptr_t out, int dtype, uintptr_t q, uintptr_t scale, uintptr_t zero,
               uintptr_t perm, int64_t n, int64_t k, int64_t group_size, uintptr_t rows=0,
               int64_t num_rows=-1) -> None:
    """out [n, k] = scale * (q - zero) (packed as for gemv_q4, columns in perm's order) as
    float32 (dtype 0) or bfloat16 (dtype 1); with num_rows >= 0, out [num_rows, k] holds the
    output channels rows (int64 [num_rows]) names (an embedding lookup)."""
    cdef int64_t bad
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
    if num_rows == 0:
        return
    if num_rows < 0:
        rows = 0
    elif rows == 0:
        raise ValueError("rows must point at num_rows int64 row indices")
    with nogil:
        bad = pipeline_cpu_dequant_q4(<void *>out, dtype, <const uint8_t *>q,
                                      <const uint16_t *>scale, <const uint8_t *>zero,
                                      <const int32_t *>perm, n, k, group_size,
                                      <const int64_t *>rows, num_rows)
    if bad >= 0:
        raise IndexError(f"row {(<const int64_t *>rows)[bad]} is out of range for {n} rows")


cdef class DecoderLayers:
    """The layer table of ``pipeline_cpu_decoder_layers`` (cpu_ops_decoder.h): per layer the
    projection format (0 float32 [in, out], 1 bf16, 2 int8, 3 int4), the four projections' weight,
    scale and bias addresses (0: none), the two norms' weight addresses and eps, and
    the layer's K/V cache addresses; int4 rows add the zero-point and permutation addresses
    (0: none) and the four group sizes; the most tokens a step may bring. Built once per model
    and KV cache; the model keeps the tensors alive."""
    cdef pipe_layer *layers
    cdef readonly int64_t num_layers
    cdef readonly int64_t max_tokens

    def __cinit__(self, list rows, int64_t max_tokens):
        cdef int64_t i
        cdef int p
        self.num_layers = len(rows)
        # float32 projections run in the GEMV only; the caller caps what else must match its
        # own path (int4: the GEMV's rows, beyond which LowpWeight dequantises for BLAS)
        self.max_tokens = min(max_tokens, PIPE_GEMV_MAX_M) if any(r[0] == 0 for r in rows) else max_tokens
        self.layers = <pipe_layer *>malloc(max(self.num_layers, 1) * sizeof(pipe_layer))
        if self.layers == NULL:
            raise MemoryError("DecoderLayers: no memory for the layer table")
        for i, row in enumerate(rows):
            fmt, w, scale, bias, ln_in, ln_post, eps_in, eps_post, k_cache, v_cache = row[:10]
            zero, perm, gs = row[10:] if len(row) == 13 else ((0,) * 4, (0,) * 4, (8,) * 4)
            if fmt not in (0, 1, 2, 3) or not (len(w) == len(scale) == len(bias) == 4) \
                    or len(row) not in (10, 13) or len(gs) != 4 or any(g <= 0 or g % 8 for g in gs):
                raise ValueError(f"layer {i}: bad row {row!r}")
            self.layers[i].fmt = fmt
            for p in range(4):
                self.layers[i].group_size[p] = gs[p]
                self.layers[i].zero[p] = <const uint8_t *><uintptr_t>zero[p]
                self.layers[i].perm[p] = <const int32_t *><uintptr_t>perm[p]
            for p in range(4):
                self.layers[i].w[p] = <const void *><uintptr_t>w[p]
                self.layers[i].scale[p] = <const float *><uintptr_t>scale[p]
                self.layers[i].bias[p] = <const float *><uintptr_t>bias[p]
            self.layers[i].ln_in = <const float *><uintptr_t>ln_in
            self.layers[i].ln_post = <const float *><uintptr_t>ln_post
            self.layers[i].eps_in = eps_in
            self.layers[i].eps_post = eps_post
            self.layers[i].k_cache = <char *><uintptr_t>k_cache
            self.layers[i].v_cache = <char *><uintptr_t>v_cache

    def __dealloc__(self):
        free(self.layers)

    def run(self, int64_t first, tuple dims, tuple buffers, uintptr_t positions, uintptr_t slots,
            uintptr_t cos, uintptr_t sin, int64_t max_positions, int64_t num_slots,
            int cache_dtype, uintptr_t cu_seqlens_q, uintptr_t seq_lens, uintptr_t block_tables,
            int64_t num_seqs, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
            float scale) -> int:
        """Layers [first, num_layers) over T <= max_tokens tokens (dims: T, hidden, q_size,
        kv_size, num_heads, num_kv_heads, head_dim, intermediate; buffers: residual, h, o,
        down, qkv, attn, gate_up, act addresses). -1 when done, -2 when a projection would not
        run in C for these many rows (nothing done: the caller's loop runs), else 4 * layer +
        what failed (0 scratch memory, 1 RoPE/cache index, 2 attention)."""
        cdef pipe_step s
        cdef int64_t rc
        cdef int64_t depth[4]
        if not 0 <= first <= self.num_layers or len(dims) != 8 or len(buffers) != 8:
            raise ValueError("DecoderLayers.run: bad first layer, dims or buffers")
        s.T, s.hidden, s.q_size, s.kv_size, s.num_heads, s.num_kv_heads, s.head_dim, s.inter = dims
        if not 0 < s.T <= self.max_tokens:
            raise ValueError(f"DecoderLayers.run: {s.T} tokens, at most {self.max_tokens}")
        depth[0], depth[1], depth[2], depth[3] = s.hidden, s.q_size, s.hidden, s.inter
        if not pipe_decoder_takes(self.layers, self.num_layers, s.T, depth):
            return -2
        s.residual = <float *><uintptr_t>buffers[0]
        s.h = <float *><uintptr_t>buffers[1]
        s.o = <float *><uintptr_t>buffers[2]
        s.down = <float *><uintptr_t>buffers[3]
        s.qkv = <float *><uintptr_t>buffers[4]
        s.attn = <float *><uintptr_t>buffers[5]
        s.gate_up = <float *><uintptr_t>buffers[6]
        s.act = <float *><uintptr_t>buffers[7]
        s.positions = <const int64_t *>positions
        s.slots = <const int64_t *>slots
        s.cos = <const float *>cos
        s.sin = <const float *>sin
        s.max_positions = max_positions
        s.num_slots = num_slots
        s.cache_dtype = cache_dtype
        s.attn_args.cu_seqlens_q = <const int32_t *>cu_seqlens_q
        s.attn_args.seq_lens = <const int32_t *>seq_lens
        s.attn_args.block_tables = <const int32_t *>block_tables
        s.attn_args.num_seqs = num_seqs
        s.attn_args.num_tokens = s.T
        s.attn_args.num_heads = s.num_heads
        s.attn_args.num_kv_heads = s.num_kv_heads
        s.attn_args.head_dim = s.head_dim
        s.attn_args.num_blocks = num_blocks
        s.attn_args.block_size = block_size
        s.attn_args.max_blocks = max_blocks
        s.attn_args.scale = scale
        with nogil:
            rc = pipeline_cpu_decoder_layers(self.layers, first, self.num_layers, &s)
        return rc


cdef extern from "cpu_ops_pack.h":
    int pipeline_cpu_pack_bf16(uint16_t *out, const void *w, int dtype, int64_t N, int64_t K,
                               int64_t ld) nogil
    int pipeline_cpu_pack_i8(int8_t *out, float *scale, const void *w, int dtype, int64_t N,
                             int64_t K, int64_t ld) nogil
    int64_t pipeline_cpu_unpack_rows(float *out, const void *P, const float *scale, int64_t N,
                                     int64_t K, int64_t Kc, const int64_t *rows, int64_t R) nogil


cdef extern from "cpu_ops_pack_q4.h":
    int pipeline_cpu_pack_q4(uint8_t *P, uint16_t *S, uint8_t *Z, const void *w, int dtype,
                             int64_t N, int64_t K, int64_t ld, int64_t gs) nogil


def pack_q4(uintptr_t packed, uintptr_t scale, uintptr_t zero, uintptr_t w, int dtype, int64_t n,
            int64_t k, int64_t ld, int64_t group_size) -> None:
    """w [n, k] (row stride ld elements, dtype 0 float32 / 1 bfloat16 / 2 float16) quantised in
    groups of group_size inputs as int4.quantize_int4 does, into gemv_q4's blocks: packed
    uint8 [ceil(n/16), G * group_size / 8, 64], scale fp16 and zero uint8 (0: symmetric)
    [ceil(n/16), G, 16], G = ceil(k / group_size) (cpu_ops_pack_q4.h)."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_pack_q4(<uint8_t *>packed, <uint16_t *>scale, <uint8_t *>zero,
                                  <const void *>w, dtype, n, k, ld, group_size)
    if rc:
        raise ValueError(f"group_size must be a multiple of 8 up to 128, got {group_size}")


def _pack_rc(int rc, str what, int dtype, int64_t n, int64_t k, int64_t ld):
    if rc == -1:
        raise ValueError(f"{what} in place: w must have dense rows, a multiple of 16 of them "
                         f"and of {32 if what == 'pack_bf16' else 4} columns (bf16: of bfloat16), "
                         f"got dtype code {dtype} [{n}, {k}] row stride {ld}")
    if rc:
        raise MemoryError(f"{what}: no memory for a block's scratch")


def pack_bf16(uintptr_t out, uintptr_t w, int dtype, int64_t n, int64_t k, int64_t ld) -> None:
    """out [ceil(n/16), kp/2, 16, 2] bf16 (kp: k rounded up to 32) = w [n, k] (row stride ld
    elements, dtype 0 float32 / 1 bfloat16 / 2 float16) rounded as torch rounds to bfloat16,
    zero-padded (cpu_ops_pack.h). out == w packs a dense bf16 [16 * b, 32 * c] in place."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_pack_bf16(<uint16_t *>out, <const void *>w, dtype, n, k, ld)
    _pack_rc(rc, "pack_bf16", dtype, n, k, ld)


def unpack_rows(uintptr_t out, uintptr_t packed, uintptr_t scale, int64_t n, int64_t k,
                int64_t units, uintptr_t rows, int64_t num_rows) -> None:
    """out [num_rows, k] float32 = the rows (int64 [num_rows]) of a [n, k] weight packed by
    pack_bf16 (scale 0) or pack_i8 (times its scale), ``units`` 32-bit units a packed row (an
    embedding lookup). IndexError for a row outside [0, n)."""
    cdef int64_t bad
    if num_rows <= 0:
        return
    with nogil:
        bad = pipeline_cpu_unpack_rows(<float *>out, <const void *>packed, <const float *>scale,
                                       n, k, units, <const int64_t *>rows, num_rows)
    if bad >= 0:
        raise IndexError(f"row {(<const int64_t *>rows)[bad]} is out of range for {n} rows")


def pack_i8(uintptr_t out, uintptr_t scale, uintptr_t w, int dtype, int64_t n, int64_t k,
            int64_t ld) -> None:
    """out [ceil(n/16), ceil(k/4), 16, 4] int8 and scale [ceil(n/16) * 16] float32 (padded
    with 1) = w [n, k] quantised per row as lowp.quantize_int8 does (cpu_ops_pack.h). out == w
    packs a dense [16 * b, 4 * c] in place (the bytes past the result are given back)."""
    cdef int rc
    with nogil:
        rc = pipeline_cpu_pack_i8(<int8_t *>out, <float *>scale, <const void *>w, dtype, n, k, ld)
    _pack_rc(rc, "pack_i8", dtype, n, k, ld)
