/* Worker stage, CPU ops: matrix products with bfloat16 weights, float32 activations, and the
 * run-time instruction-set dispatch they share with the int8 ones (cpu_ops_gemv_i8.h).
 *
 *   pipeline_cpu_gemv_bf16: y [M, N] = x [M, K] @ W[N, K]^T (+ bias), W bfloat16
 *
 * For M <= PIPE_GEMV_MAX_M (decode at small batch) a step is bound by reading W, so this
 * streams W once, in memory order, two bytes per weight instead of four: with AVX-512 BF16
 * the rows of x are rounded to bf16 once and each 32 weights take one VDPBF16PS (float32
 * accumulate); on AVX2 the weights are widened in registers (a shift) and multiplied with
 * float32 x. Larger M goes to a bf16 GEMM in torch (layers/lowp.py).
 *
 * Dispatch is at run time (the build may be -march=native elsewhere): each kernel has an
 * AVX-512 body, an AVX2 body (compiled with target attributes) and a portable one, and
 * pipe_lp_level() picks the best the CPU supports, capped by pipeline_cpu_set_isa() (tests
 * run every path on one machine). Threads split the output rows. State: the ISA cap and a
 * per-thread scratch buffer for the converted rows of x.
 */
#ifndef PIPELINE_CPU_OPS_GEMV_LP_H
#define PIPELINE_CPU_OPS_GEMV_LP_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>
#include "cpu_ops_dtype.h"
#include "cpu_ops_gemv.h"

enum { PIPE_ISA_PORTABLE = 0, PIPE_ISA_AVX2 = 1, PIPE_ISA_AVX512 = 2 };
/* Weight bytes from which the bf16/int8 GEMVs use every thread; lower than the float32
 * GEMV's since a 2- or 1-byte weight is read in a half or a quarter of the time. Tunable
 * (PIPE_LP_PAR_MIN_BYTES) for the measurement in docs/cpu.md. */
#ifndef PIPE_LP_PAR_MIN_BYTES
#define PIPE_LP_PAR_MIN_BYTES (1 << 17)
#endif
static int pipe_isa_cap = PIPE_ISA_AVX512;

/* The best level the CPU has for kernel `kind` (0: bf16, 1: int8), capped. */
static int pipe_lp_level(int kind) {
    int best = PIPE_ISA_PORTABLE;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = PIPE_ISA_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl")
        && (kind == 0 ? __builtin_cpu_supports("avx512bf16")
                      : __builtin_cpu_supports("avx512vnni")))
        best = PIPE_ISA_AVX512;
    return best < pipe_isa_cap ? best : pipe_isa_cap;
}

static void pipeline_cpu_set_isa(int cap) { pipe_isa_cap = cap; }

/* Scratch for M converted rows of x (bf16 or int8), grown on demand, one per calling thread
 * (the worker calls from one thread; the OpenMP team only reads it). */
static __thread void *pipe_lp_scratch = NULL;
static __thread size_t pipe_lp_scratch_bytes = 0;

static void *pipe_lp_buffer(size_t bytes) {
    if (bytes > pipe_lp_scratch_bytes) {
        free(pipe_lp_scratch);
        pipe_lp_scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        pipe_lp_scratch_bytes = pipe_lp_scratch ? bytes : 0;
    }
    return pipe_lp_scratch;
}

/* ---- bf16 ------------------------------------------------------------------------------ */

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void pipe_bf16_rows_avx512(float *y, int64_t ldy, const uint16_t *xb, const uint16_t *W,
                                  const float *bias, int64_t M, int64_t K, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *xr = xb + m * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 32) {
                if (m == 0 && n + 8 <= n1) { /* the next four rows, a line per row per 32 */
                    _mm_prefetch((const char *)(w0 + 4 * K + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w1 + 4 * K + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w2 + 4 * K + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w3 + 4 * K + k), _MM_HINT_T0);
                }
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + k), xv);
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + k), xv);
                a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + k), xv);
                a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + k), xv);
            }
            float *yr = y + m * ldy + n;
            yr[0] = _mm512_reduce_add_ps(a0) + (bias ? bias[n] : 0.0f);
            yr[1] = _mm512_reduce_add_ps(a1) + (bias ? bias[n + 1] : 0.0f);
            yr[2] = _mm512_reduce_add_ps(a2) + (bias ? bias[n + 2] : 0.0f);
            yr[3] = _mm512_reduce_add_ps(a3) + (bias ? bias[n + 3] : 0.0f);
        }
    }
    for (; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) {
            __m512 a0 = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32)
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(W + n * K + k),
                                      (__m512bh)_mm512_loadu_si512(xb + m * K + k));
            y[m * ldy + n] = _mm512_reduce_add_ps(a0) + (bias ? bias[n] : 0.0f);
        }
    }
}

__attribute__((target("avx2,fma")))
static inline __m256 pipe_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

__attribute__((target("avx2,fma")))
static inline float pipe_lp_hsum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma")))
static void pipe_bf16_rows_avx2(float *y, int64_t ldy, const float *x, int64_t ldx,
                                const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1;
        const uint16_t *w0 = W + n * K, *w1 = two ? w0 + K : w0;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * ldx;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
            for (int64_t k = 0; k < K; k += 16) {
                const __m256 x0 = _mm256_loadu_ps(xr + k), x1 = _mm256_loadu_ps(xr + k + 8);
                a0 = _mm256_fmadd_ps(pipe_bf16x8(w0 + k), x0, a0);
                a1 = _mm256_fmadd_ps(pipe_bf16x8(w0 + k + 8), x1, a1);
                b0 = _mm256_fmadd_ps(pipe_bf16x8(w1 + k), x0, b0);
                b1 = _mm256_fmadd_ps(pipe_bf16x8(w1 + k + 8), x1, b1);
            }
            y[m * ldy + n] = pipe_lp_hsum8(_mm256_add_ps(a0, a1)) + (bias ? bias[n] : 0.0f);
            if (two) y[m * ldy + n + 1] = pipe_lp_hsum8(_mm256_add_ps(b0, b1)) + (bias ? bias[n + 1] : 0.0f);
        }
    }
}

static void pipe_bf16_rows_portable(float *y, int64_t ldy, const float *x, int64_t ldx,
                                    const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                    int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * ldx + k] * pipe_bf16_to_f32(W[n * K + k]);
            y[m * ldy + n] = s + (bias ? bias[n] : 0.0f);
        }
}

/* The level the bf16 kernel uses for this K (the vector bodies need K % 32 / % 16 == 0). */
static int pipe_bf16_level(int64_t K) {
    int level = pipe_lp_level(0);
    if (level == PIPE_ISA_AVX512 && K % 32) level = PIPE_ISA_AVX2;
    if (level == PIPE_ISA_AVX2 && K % 16) level = PIPE_ISA_PORTABLE;
    return level;
}

static void pipeline_cpu_gemv_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                   const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                   int64_t N) {
    const int level = pipe_bf16_level(K);
    uint16_t *xb = NULL;
    if (level == PIPE_ISA_AVX512) { /* x rounded to bf16 once, M*K*2 bytes */
        xb = (uint16_t *)pipe_lp_buffer((size_t)(M * K) * 2);
        if (xb == NULL) return;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) xb[m * K + k] = pipe_f32_to_bf16(x[m * ldx + k]);
    }
    const int par = K * N * 2 >= PIPE_LP_PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t lo, hi;
        pipe_split_cols(N, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        if (lo < hi) {
            if (level == PIPE_ISA_AVX512) pipe_bf16_rows_avx512(y, ldy, xb, W, bias, M, K, lo, hi);
            else if (level == PIPE_ISA_AVX2) pipe_bf16_rows_avx2(y, ldy, x, ldx, W, bias, M, K, lo, hi);
            else pipe_bf16_rows_portable(y, ldy, x, ldx, W, bias, M, K, lo, hi);
        }
    }
}

#endif
