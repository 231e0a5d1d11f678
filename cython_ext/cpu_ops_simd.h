/* Worker stage, CPU ops: the two inner loops of paged attention, in float32.
 *
 *   pipe_scores:     s[j] = dot(q, k_j)              for n keys at `stride` floats apart
 *   pipe_accumulate: acc = acc * corr + sum_j p[j] v_j
 *
 * A plain dot product is one long FMA dependency chain, and an accumulate that reloads
 * acc for every key is bound by load/store ports; both ran at ~3 GB/s of KV. The AVX+FMA
 * versions keep four keys' chains (scores) or a 64-float slice of acc (accumulate) in
 * registers. They need head_dim % 8 == 0 (every Llama-family model); other head sizes and
 * CPUs without AVX/FMA take the portable loops, which GCC vectorises less well. No state.
 */
#ifndef PIPELINE_CPU_OPS_SIMD_H
#define PIPELINE_CPU_OPS_SIMD_H

#include <stdint.h>
#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#define PIPE_HAVE_AVX_FMA 1
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

#ifdef PIPE_HAVE_AVX_FMA
static inline float pipe_hsum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline void pipe_scores_avx(const float *restrict q, const float *restrict k,
                                   int64_t stride, int64_t n, int64_t D, float *restrict s) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k + j * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
        }
        /* [sum a0, sum a1, sum a2, sum a3] with two hadds and one cross-lane add */
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    for (; j < n; j++) {
        const float *kj = k + j * stride;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kj + d), a);
        s[j] = pipe_hsum8(a);
    }
}

static inline void pipe_accumulate_avx(float *restrict acc, float corr, const float *restrict p,
                                       const float *restrict v, int64_t stride, int64_t n,
                                       int64_t D) {
    const __m256 c = _mm256_set1_ps(corr);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * i), c);
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            const float *vj = v + j * stride + d;
            for (int i = 0; i < 8; i++) r[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), r[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + d + 8 * i, r[i]);
    }
    for (; d < D; d += 16) { /* tail: 16 or 8 floats */
        const int two = d + 16 <= D;
        __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        __m256 r1 = two ? _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8), c) : _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            const float *vj = v + j * stride + d;
            r0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), r0);
            if (two) r1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), r1);
        }
        _mm256_storeu_ps(acc + d, r0);
        if (two) _mm256_storeu_ps(acc + d + 8, r1);
        else break;
    }
}
#endif

static inline void pipe_scores(const float *q, const float *k, int64_t stride, int64_t n,
                               int64_t D, float *s) {
#ifdef PIPE_HAVE_AVX_FMA
    if (D % 8 == 0) { pipe_scores_avx(q, k, stride, n, D, s); return; }
#endif
    pipe_scores_portable(q, k, stride, n, D, s);
}

static inline void pipe_accumulate(float *acc, float corr, const float *p, const float *v,
                                   int64_t stride, int64_t n, int64_t D) {
#ifdef PIPE_HAVE_AVX_FMA
    if (D % 8 == 0) { pipe_accumulate_avx(acc, corr, p, v, stride, n, D); return; }
#endif
    pipe_accumulate_portable(acc, corr, p, v, stride, n, D);
}

#endif
