/* Worker stage, CPU ops: the AVX2 body of the load-time packers (cpu_ops_pack.h), for a build
 * without AVX-512 (-march=native on AMD Zen 2/3, Intel before Skylake-X).
 *
 * Same results as the AVX-512 body, 8 units at a time: a row's 8 units (16 bf16 or 32 int8)
 * are made in one register, 16 rows of them transposed as two 8x8 blocks of 32-bit units and
 * written as 8 lines of 16 units. The scalar loop it replaces called the dtype helpers per
 * element (GCC does not inline them into this -fno-fast-math code): 5.4 ns a weight, ~2.7 s
 * of one core for a 0.5B model. Included by cpu_ops_pack.h inside its no-fast-math region
 * (true divisions). No state.
 */
#ifndef PIPELINE_CPU_OPS_PACK_AVX2_H
#define PIPELINE_CPU_OPS_PACK_AVX2_H

#if !PIPE_PACK_AVX512 && defined(__AVX2__) && defined(__F16C__)
#define PIPE_PACK_AVX2 1
#include <immintrin.h>

/* 8 floats of row from column k, columns >= K as 0. */
static inline __m256 pipe_pack_load8(const char *row, int dtype, int64_t k, int64_t K) {
    if (k + 8 > K) {
        float t[8];
        for (int e = 0; e < 8; e++) t[e] = k + e < K ? pipe_pack_load(row, dtype, k + e) : 0.f;
        return _mm256_loadu_ps(t);
    }
    if (dtype == PIPE_F32) return _mm256_loadu_ps((const float *)row + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (dtype == PIPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* r[i] (8 units of row i) -> r[c] (unit c of rows 0..7). */
static inline void pipe_pack_transpose8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) { /* u[g + c]: rows g..g+3, units c and 4 + c */
        u[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

/* 8 floats -> 8 bf16 in the low halves of 32-bit lanes (pipe_pack_bf16_of's rounding). */
static inline __m256i pipe_pack_bf16x8(__m256 x, uint32_t nan) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32((int)nan),
                              _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

/* 16 columns of a row from k as 8 bf16 pairs (a bf16 source as it is, as torch's .to). */
static inline __m256i pipe_pack_bf16_unit8(const char *row, int dtype, int64_t k, int64_t K) {
    if (dtype == PIPE_BF16 && k + 16 <= K)
        return _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
    if (dtype == PIPE_BF16) {
        uint16_t t[16];
        for (int e = 0; e < 16; e++) t[e] = k + e < K ? ((const uint16_t *)row)[k + e] : 0;
        return _mm256_loadu_si256((const __m256i *)t);
    }
    const __m256i lo = pipe_pack_bf16x8(pipe_pack_load8(row, dtype, k, K), PIPE_PACK_NAN(dtype));
    const __m256i hi = pipe_pack_bf16x8(pipe_pack_load8(row, dtype, k + 8, K), PIPE_PACK_NAN(dtype));
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8); /* lanes back in order */
}

/* 8 floats -> 8 int32 of pipe_pack_q8 (rint(x / s), NaN -> 0, within +-127). */
static inline __m256i pipe_pack_q8x8(__m256 x, __m256 s) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(x, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_andnot_ps(_mm256_cmp_ps(q, q, _CMP_UNORD_Q), q);
    q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
    return _mm256_cvtps_epi32(q);
}

/* 32 columns of a row from k as 8 int8 quads. */
static inline __m256i pipe_pack_i8_unit8(const char *row, int dtype, int64_t k, int64_t K, float s) {
    const __m256 sv = _mm256_set1_ps(s);
    const __m256i a = pipe_pack_q8x8(pipe_pack_load8(row, dtype, k, K), sv);
    const __m256i b = pipe_pack_q8x8(pipe_pack_load8(row, dtype, k + 8, K), sv);
    const __m256i c = pipe_pack_q8x8(pipe_pack_load8(row, dtype, k + 16, K), sv);
    const __m256i d = pipe_pack_q8x8(pipe_pack_load8(row, dtype, k + 24, K), sv);
    /* packs interleave by 128-bit lane: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 */
    const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    return _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The largest magnitude of a row's K values, NaN reported in *nan. */
static inline float pipe_pack_amax8(const char *row, int dtype, int64_t K, int *nan) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 a = _mm256_and_ps(pipe_pack_load8(row, dtype, k, K), abs);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, a);
    }
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    *nan = _mm256_movemask_ps(bad) != 0;
    return amax;
}

/* One 16-row block as pipe_pack_block (units of 2 bf16 or 4 int8, `units` per row). */
static inline void pipe_pack_block8(uint32_t *out, const char *w, int dtype, int64_t rows,
                                    int64_t K, int64_t ld_bytes, int64_t units, int i8,
                                    const float *s) {
    for (int64_t j = 0; j < units; j += 8) {
        __m256i r[16];
        for (int i = 0; i < 16; i++) {
            const char *row = w + i * ld_bytes;
            r[i] = i >= rows ? _mm256_setzero_si256()
                   : i8 ? pipe_pack_i8_unit8(row, dtype, j * 4, K, s[i])
                        : pipe_pack_bf16_unit8(row, dtype, j * 2, K);
        }
        pipe_pack_transpose8(r);
        pipe_pack_transpose8(r + 8);
        const int64_t n = units - j < 8 ? units - j : 8;
        for (int64_t c = 0; c < n; c++) {
            _mm256_storeu_si256((__m256i *)(out + (j + c) * 16), r[c]);
            _mm256_storeu_si256((__m256i *)(out + (j + c) * 16 + 8), r[8 + c]);
        }
    }
}
#else
#define PIPE_PACK_AVX2 0
#endif

#endif
