/* Worker stage, CPU ops: float32 matrix products for a few rows (decode at small batch).
 *
 *   pipeline_cpu_gemv_kn: y [M, N] = x [M, K] @ W [K, N] (+ bias), W pre-transposed [in, out]
 *   pipeline_cpu_gemv_nk: y [M, N] = x [M, K] @ W[N, K]^T (+ bias), W as nn.Linear stores it
 *
 * With M <= 8 the product is bound by reading W once, so both stream W strictly in memory
 * order: the [K, N] kernel walks four rows of W at a time and keeps the output row in L1,
 * the [N, K] kernel takes four output rows at a time as dot products with x (in L1). On a
 * cache-cold decode step this reads W at close to the machine's streaming bandwidth, where
 * BLAS GEMV ran at about two thirds of it; larger M goes to BLAS GEMM, which is
 * compute-bound there. Threads (if more than one) split the output columns. No state.
 */
#ifndef PIPELINE_CPU_OPS_GEMV_H
#define PIPELINE_CPU_OPS_GEMV_H

#include <stdint.h>
#include <string.h>
#include <omp.h>

#define PIPE_GEMV_MAX_M 8
/* Below this many weight bytes one thread is faster than waking the others. */
#define PIPE_GEMV_PAR_MIN_BYTES (1 << 20)

/* Columns [n0, n1) of y = x @ W[K, N] for all M rows; y rows ldy floats apart. */
static void pipe_gemv_kn_cols(float *y, int64_t ldy, const float *x, int64_t ldx,
                              const float *W, const float *bias, int64_t M, int64_t K,
                              int64_t N, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m++) {
        float *yr = y + m * ldy;
        if (bias != NULL) memcpy(yr + n0, bias + n0, (size_t)(n1 - n0) * sizeof(float));
        else memset(yr + n0, 0, (size_t)(n1 - n0) * sizeof(float));
    }
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *restrict w0 = W + k * N, *restrict w1 = w0 + N;
        const float *restrict w2 = w1 + N, *restrict w3 = w2 + N;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * ldx + k;
            const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
            float *restrict yr = y + m * ldy;
            for (int64_t n = n0; n < n1; n++)
                yr[n] += a0 * w0[n] + a1 * w1[n] + a2 * w2[n] + a3 * w3[n];
        }
    }
    for (; k < K; k++) {
        const float *restrict w0 = W + k * N;
        for (int64_t m = 0; m < M; m++) {
            const float a0 = x[m * ldx + k];
            float *restrict yr = y + m * ldy;
            for (int64_t n = n0; n < n1; n++) yr[n] += a0 * w0[n];
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PIPE_GEMV_NK_AVX2 1
static inline float pipe_gemv_hsum(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

/* Rows [n0, n1) of W[N, K]: y[m, n] = dot(x[m], W[n]) (+ bias[n]). */
static void pipe_gemv_nk_rows(float *y, int64_t ldy, const float *x, int64_t ldx,
                              const float *W, const float *bias, int64_t M, int64_t K,
                              int64_t n0, int64_t n1) {
    int64_t n = n0;
#ifdef PIPE_GEMV_NK_AVX2
    /* Four rows (4K floats, contiguous) per group; while the first x row runs, the next
     * group is prefetched a cache line per row per 16 floats, since the hardware prefetcher
     * restarts at every 4 KiB page and a group is often exactly one page. */
    if (K % 8 == 0) {
        for (; n + 4 <= n1; n += 4) {
            const float *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            for (int64_t m = 0; m < M; m++) {
                const float *xr = x + m * ldx;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t k = 0; k < K; k += 8) {
                    if (m == 0 && (k & 15) == 0 && n + 8 <= n1) {
                        _mm_prefetch((const char *)(w0 + 4 * K + k), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w1 + 4 * K + k), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w2 + 4 * K + k), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w3 + 4 * K + k), _MM_HINT_T0);
                    }
                    const __m256 xv = _mm256_loadu_ps(xr + k);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
                }
                float *yr = y + m * ldy + n;
                yr[0] = pipe_gemv_hsum(a0) + (bias ? bias[n] : 0.0f);
                yr[1] = pipe_gemv_hsum(a1) + (bias ? bias[n + 1] : 0.0f);
                yr[2] = pipe_gemv_hsum(a2) + (bias ? bias[n + 2] : 0.0f);
                yr[3] = pipe_gemv_hsum(a3) + (bias ? bias[n + 3] : 0.0f);
            }
        }
    }
#endif
    for (; n + 4 <= n1; n += 4) {
        const float *restrict w0 = W + n * K, *restrict w1 = w0 + K;
        const float *restrict w2 = w1 + K, *restrict w3 = w2 + K;
        for (int64_t m = 0; m < M; m++) {
            const float *restrict xr = x + m * ldx;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t k = 0; k < K; k++) {
                const float xv = xr[k];
                s0 += xv * w0[k];
                s1 += xv * w1[k];
                s2 += xv * w2[k];
                s3 += xv * w3[k];
            }
            float *yr = y + m * ldy + n;
            yr[0] = s0 + (bias ? bias[n] : 0.0f);
            yr[1] = s1 + (bias ? bias[n + 1] : 0.0f);
            yr[2] = s2 + (bias ? bias[n + 2] : 0.0f);
            yr[3] = s3 + (bias ? bias[n + 3] : 0.0f);
        }
    }
    for (; n < n1; n++) {
        const float *restrict w0 = W + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *restrict xr = x + m * ldx;
            float s0 = 0.0f;
            #pragma omp simd reduction(+:s0)
            for (int64_t k = 0; k < K; k++) s0 += xr[k] * w0[k];
            y[m * ldy + n] = s0 + (bias ? bias[n] : 0.0f);
        }
    }
}

/* Split [0, N) into `parts` ranges aligned to 16 columns; range i is [*lo, *hi). */
static inline void pipe_split_cols(int64_t N, int64_t parts, int64_t i, int64_t *lo, int64_t *hi) {
    const int64_t chunk = ((N + parts - 1) / parts + 15) / 16 * 16;
    *lo = i * chunk < N ? i * chunk : N;
    *hi = *lo + chunk < N ? *lo + chunk : N;
}

/* kn: W is [K, N]; otherwise [N, K]. y and x rows are ldy / ldx floats apart. */
static void pipeline_cpu_gemv(float *y, int64_t ldy, const float *x, int64_t ldx,
                              const float *W, const float *bias, int64_t M, int64_t K,
                              int64_t N, int kn) {
    const int par = K * N * (int64_t)sizeof(float) >= PIPE_GEMV_PAR_MIN_BYTES
                    && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        int64_t lo, hi;
        pipe_split_cols(N, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
        if (lo < hi) {
            if (kn) pipe_gemv_kn_cols(y, ldy, x, ldx, W, bias, M, K, N, lo, hi);
            else pipe_gemv_nk_rows(y, ldy, x, ldx, W, bias, M, K, lo, hi);
        }
    }
}

#endif
