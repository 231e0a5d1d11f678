/* Worker stage, CPU ops: matrix products with bfloat16 or int8 weights, float32 activations.
 *
 *   pipeline_cpu_gemv_bf16: y [M, N] = x [M, K] @ W[N, K]^T (+ bias), W bfloat16
 *   pipeline_cpu_gemv_i8:   y [M, N] = x [M, K] @ (scale[n] * Q[N, K])^T (+ bias), Q int8
 *   pipeline_cpu_dequant_i8: D[N, K] = scale[n] * Q[N, K] as bfloat16 or float32
 *
 * For M <= PIPE_GEMV_MAX_M (decode at small batch) a step is bound by reading W, so these
 * stream W once, in memory order, two or one bytes per weight instead of four. bf16: with
 * AVX-512 BF16 the rows of x are rounded to bf16 once and each 32 weights take one
 * VDPBF16PS (float32 accumulate); on AVX2 the weights are widened in registers (a shift)
 * and multiplied with float32 x. int8: each row of x is quantised per token (symmetric, to
 * [-127, 127], scale absmax / 127) and the dot products are exact int32 sums: VPDPBUSD on
 * AVX-512 VNNI (x offset to unsigned by +128, corrected with the row sums of Q kept at
 * load), VPMADDUBSW on AVX2 (|q| times x with q's sign; no pair can saturate since
 * |q|, |x| <= 127), so every path gives the same integers. Larger M dequantises W (all
 * threads) for a BLAS/oneDNN GEMM, see layers/lowp.py.
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
    const int par = K * N * 2 >= PIPE_GEMV_PAR_MIN_BYTES && omp_get_max_threads() > 1;
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

/* ---- int8 ------------------------------------------------------------------------------ */

/* Row m of x quantised to int8 in q (K values), returning its scale (0 for a zero row). */
static float pipe_quantize_row(const float *x, int64_t K, int8_t *q) {
    if (K <= 0) return 0.0f;
    float amax = 0.0f;
    int finite = 1;
    for (int64_t k = 0; k < K; k++) {
        amax = fmaxf(amax, fabsf(x[k]));
        finite &= isfinite(x[k]);
    }
    if (!finite || !(amax > 0.0f)) { /* a zero row gives 0; NaN/inf poisons y as in float32 */
        memset(q, 0, (size_t)K);
        return finite ? 0.0f : NAN;
    }
    const float inv = 127.0f / amax;
    for (int64_t k = 0; k < K; k++) q[k] = (int8_t)lrintf(x[k] * inv);
    return amax / 127.0f;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void pipe_i8_rows_avx512(int32_t *acc, const int8_t *xq, const int8_t *Q,
                                const int32_t *qsum, int64_t M, int64_t K, int64_t N,
                                int64_t n0, int64_t n1) {
    /* x as unsigned (x + 128): sum (x + 128) q = sum x q + 128 * qsum[n]. */
    const __m512i off = _mm512_set1_epi8((char)0x80);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const int8_t *q0 = Q + n * K, *q1 = q0 + K, *q2 = q1 + K, *q3 = q2 + K;
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xr = xq + m * K;
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 64) {
                if (m == 0 && n + 8 <= n1) {
                    _mm_prefetch((const char *)(q0 + 4 * K + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(q1 + 4 * K + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(q2 + 4 * K + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(q3 + 4 * K + k), _MM_HINT_T0);
                }
                const __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(xr + k), off);
                a0 = _mm512_dpbusd_epi32(a0, xv, _mm512_loadu_si512(q0 + k));
                a1 = _mm512_dpbusd_epi32(a1, xv, _mm512_loadu_si512(q1 + k));
                a2 = _mm512_dpbusd_epi32(a2, xv, _mm512_loadu_si512(q2 + k));
                a3 = _mm512_dpbusd_epi32(a3, xv, _mm512_loadu_si512(q3 + k));
            }
            int32_t *ar = acc + m * N + n;
            ar[0] = _mm512_reduce_add_epi32(a0) - 128 * qsum[n];
            ar[1] = _mm512_reduce_add_epi32(a1) - 128 * qsum[n + 1];
            ar[2] = _mm512_reduce_add_epi32(a2) - 128 * qsum[n + 2];
            ar[3] = _mm512_reduce_add_epi32(a3) - 128 * qsum[n + 3];
        }
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            __m512i a0 = _mm512_setzero_si512();
            for (int64_t k = 0; k < K; k += 64)
                a0 = _mm512_dpbusd_epi32(a0, _mm512_xor_si512(_mm512_loadu_si512(xq + m * K + k), off),
                                         _mm512_loadu_si512(Q + n * K + k));
            acc[m * N + n] = _mm512_reduce_add_epi32(a0) - 128 * qsum[n];
        }
}

__attribute__((target("avx2,fma")))
static void pipe_i8_rows_avx2(int32_t *acc, const int8_t *xq, const int8_t *Q, int64_t M,
                              int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1;
        const int8_t *q0 = Q + n * K, *q1 = two ? q0 + K : q0;
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xr = xq + m * K;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0;
            for (int64_t k = 0; k < K; k += 32) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + k));
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q0 + k));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(q1 + k));
                /* |q| * (x with q's sign): exact, |q|, |x| <= 127 so a pair fits int16 */
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                         _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(xv, w0)), ones));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                         _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(xv, w1)), ones));
            }
            __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(a0), _mm256_extracti128_si256(a0, 1));
            __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(a1), _mm256_extracti128_si256(a1, 1));
            s0 = _mm_hadd_epi32(s0, s1); /* a0 pairs, a1 pairs */
            s0 = _mm_hadd_epi32(s0, s0);
            acc[m * N + n] = _mm_cvtsi128_si32(s0);
            if (two) acc[m * N + n + 1] = _mm_extract_epi32(s0, 1);
        }
    }
}

static void pipe_i8_rows_portable(int32_t *acc, const int8_t *xq, const int8_t *Q, int64_t M,
                                  int64_t K, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; k++) s += (int32_t)xq[m * K + k] * Q[n * K + k];
            acc[m * N + n] = s;
        }
}

static int pipe_i8_level(int64_t K) {
    int level = pipe_lp_level(1);
    if (level == PIPE_ISA_AVX512 && K % 64) level = PIPE_ISA_AVX2;
    if (level == PIPE_ISA_AVX2 && K % 32) level = PIPE_ISA_PORTABLE;
    return level;
}

/* Q values must lie in [-127, 127] (the quantiser never makes -128); qsum[n] = sum_k Q[n, k]. */
static int pipeline_cpu_gemv_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                                const int8_t *Q, const float *scale, const int32_t *qsum,
                                const float *bias, int64_t M, int64_t K, int64_t N) {
    const int level = pipe_i8_level(K);
    const size_t xbytes = ((size_t)(M * K) + 63) / 64 * 64;
    char *buf = (char *)pipe_lp_buffer(xbytes + (size_t)(M * N) * 4 + (size_t)M * 4);
    if (buf == NULL) return -1;
    int8_t *xq = (int8_t *)buf;
    int32_t *acc = (int32_t *)(buf + xbytes);
    float *xs = (float *)(acc + M * N);
    for (int64_t m = 0; m < M; m++) xs[m] = pipe_quantize_row(x + m * ldx, K, xq + m * K);
    const int par = K * N >= PIPE_GEMV_PAR_MIN_BYTES && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t lo, hi;
        pipe_split_cols(N, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        if (lo < hi) {
            if (level == PIPE_ISA_AVX512) pipe_i8_rows_avx512(acc, xq, Q, qsum, M, K, N, lo, hi);
            else if (level == PIPE_ISA_AVX2) pipe_i8_rows_avx2(acc, xq, Q, M, K, N, lo, hi);
            else pipe_i8_rows_portable(acc, xq, Q, M, K, N, lo, hi);
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = lo; n < hi; n++)
                    y[m * ldy + n] = (float)acc[m * N + n] * (xs[m] * scale[n]) + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}

/* D = scale[n] * Q[n, :] for rows [0, N), as bf16 (dtype PIPE_BF16) or float32 (PIPE_F32). */
static void pipeline_cpu_dequant_i8(void *D, int dtype, const int8_t *Q, const float *scale,
                                    int64_t N, int64_t K) {
    #pragma omp parallel for if (N * K >= PIPE_GEMV_PAR_MIN_BYTES) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float s = scale[n];
        const int8_t *q = Q + n * K;
        if (dtype == PIPE_F32) {
            float *d = (float *)D + n * K;
            for (int64_t k = 0; k < K; k++) d[k] = s * (float)q[k];
        } else {
            uint16_t *d = (uint16_t *)D + n * K;
            for (int64_t k = 0; k < K; k++) d[k] = pipe_f32_to_bf16(s * (float)q[k]);
        }
    }
}

#endif
