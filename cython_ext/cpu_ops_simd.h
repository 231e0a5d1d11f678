/* Worker stage, CPU ops: the two inner loops of paged attention.
 *
 *   pipe_scores:     s[j] = dot(q, k_j)              for n keys `stride` elements apart
 *   pipe_accumulate: acc = acc * corr + sum_j p[j] v_j
 *
 * q, s, p and acc are float32; keys and values are read in the cache dtype and widened in
 * registers, so decode streams a bf16/fp16 cache without a conversion pass. A plain dot
 * product is one long FMA dependency chain and an accumulate that reloads acc for every
 * key is bound by load/store ports (both ran at ~3 GB/s of KV); the AVX2 versions keep
 * four keys' chains (scores) or a 64-float slice of acc (accumulate) in registers. They
 * need head_dim % 8 == 0 (every Llama-family model); other head sizes and CPUs without
 * AVX2/FMA/F16C use the portable float32 loops on rows packed by the caller. No state.
 */
#ifndef PIPELINE_CPU_OPS_SIMD_H
#define PIPELINE_CPU_OPS_SIMD_H

#include <stdint.h>
#include "cpu_ops_dtype.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PIPE_HAVE_AVX2 1
#endif

static inline void pipe_scores_portable(const float *restrict q, const float *restrict k,
                                        int64_t stride, int64_t n, int64_t D, float *restrict s) {
    for (int64_t j = 0; j < n; j++) {
        const float *kj = k + j * stride;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; d++) dot += q[d] * kj[d];
        s[j] = dot;
    }
}

static inline void pipe_accumulate_portable(float *restrict acc, float corr,
                                            const float *restrict p, const float *restrict v,
                                            int64_t stride, int64_t n, int64_t D) {
    for (int64_t d = 0; d < D; d++) acc[d] *= corr;
    for (int64_t j = 0; j < n; j++) {
        const float *vj = v + j * stride;
        const float pj = p[j];
        for (int64_t d = 0; d < D; d++) acc[d] += pj * vj[d];
    }
}

#ifdef PIPE_HAVE_AVX2
#define PIPE_INLINE static inline __attribute__((always_inline))

/* Eight elements at p[i] widened to float32; `dtype` is a constant after inlining. */
PIPE_INLINE __m256 pipe_ld8(const void *p, int64_t i, int dtype) {
    if (dtype == PIPE_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dtype == PIPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

PIPE_INLINE float pipe_hsum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

PIPE_INLINE void pipe_scores_avx2(const float *restrict q, const void *restrict k,
                                  int64_t stride, int64_t n, int64_t D, float *restrict s,
                                  int dtype) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const int64_t r0 = j * stride, r1 = r0 + stride, r2 = r1 + stride, r3 = r2 + stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, pipe_ld8(k, r0 + d, dtype), a0);
            a1 = _mm256_fmadd_ps(qv, pipe_ld8(k, r1 + d, dtype), a1);
            a2 = _mm256_fmadd_ps(qv, pipe_ld8(k, r2 + d, dtype), a2);
            a3 = _mm256_fmadd_ps(qv, pipe_ld8(k, r3 + d, dtype), a3);
        }
        /* [sum a0, sum a1, sum a2, sum a3] with two hadds and one cross-lane add */
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    for (; j < n; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), pipe_ld8(k, j * stride + d, dtype), a);
        s[j] = pipe_hsum8(a);
    }
}

PIPE_INLINE void pipe_accumulate_avx2(float *restrict acc, float corr, const float *restrict p,
                                      const void *restrict v, int64_t stride, int64_t n,
                                      int64_t D, int dtype) {
    const __m256 c = _mm256_set1_ps(corr);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * i), c);
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_fmadd_ps(pj, pipe_ld8(v, j * stride + d + 8 * i, dtype), r[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + d + 8 * i, r[i]);
    }
    for (; d < D; d += 8) { /* tail, 8 floats at a time */
        __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        for (int64_t j = 0; j < n; j++)
            r0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), pipe_ld8(v, j * stride + d, dtype), r0);
        _mm256_storeu_ps(acc + d, r0);
    }
}
#endif

/* s[j] = exp(s[j] - mx) for j < n; returns the sum. The AVX2 exp reduces to 2^k * e^r,
 * |r| <= ln2/2, with a degree-6 Taylor polynomial (relative error ~2e-7); inputs are
 * clamped at -87 so the 2^k scale stays a normal float (e^-87 ~ 1e-38, a weight of 0). */
static inline float pipe_exp_sum(float *s, int64_t n, float mx) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef PIPE_HAVE_AVX2
    const __m256 vmx = _mm256_set1_ps(mx), lo = _mm256_set1_ps(-87.0f);
    const __m256 log2e = _mm256_set1_ps(1.44269504f), ln2_hi = _mm256_set1_ps(0.693359375f);
    const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f), one = _mm256_set1_ps(1.0f);
    __m256 vsum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx), lo);
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
        __m256 p = _mm256_set1_ps(1.0f / 720.0f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, one);
        p = _mm256_fmadd_ps(p, r, one);
        const __m256i scale = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = pipe_hsum8(vsum);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* Can pipe_scores/pipe_accumulate read rows of `dtype` in place (else pack to float32)? */
static inline int pipe_simd_in_place(int64_t D, int dtype) {
#ifdef PIPE_HAVE_AVX2
    return D % 8 == 0;
#else
    return dtype == PIPE_F32;
#endif
}

/* k: rows of `dtype` (or packed float32 rows with dtype PIPE_F32). */
static inline void pipe_scores(const float *q, const void *k, int64_t stride, int64_t n,
                               int64_t D, float *s, int dtype) {
#ifdef PIPE_HAVE_AVX2
    if (D % 8 == 0) {
        if (dtype == PIPE_F32) pipe_scores_avx2(q, k, stride, n, D, s, PIPE_F32);
        else if (dtype == PIPE_BF16) pipe_scores_avx2(q, k, stride, n, D, s, PIPE_BF16);
        else pipe_scores_avx2(q, k, stride, n, D, s, PIPE_F16);
        return;
    }
#endif
    pipe_scores_portable(q, (const float *)k, stride, n, D, s);
}

static inline void pipe_accumulate(float *acc, float corr, const float *p, const void *v,
                                   int64_t stride, int64_t n, int64_t D, int dtype) {
#ifdef PIPE_HAVE_AVX2
    if (D % 8 == 0) {
        if (dtype == PIPE_F32) pipe_accumulate_avx2(acc, corr, p, v, stride, n, D, PIPE_F32);
        else if (dtype == PIPE_BF16) pipe_accumulate_avx2(acc, corr, p, v, stride, n, D, PIPE_BF16);
        else pipe_accumulate_avx2(acc, corr, p, v, stride, n, D, PIPE_F16);
        return;
    }
#endif
    pipe_accumulate_portable(acc, corr, p, (const float *)v, stride, n, D);
}

#endif
