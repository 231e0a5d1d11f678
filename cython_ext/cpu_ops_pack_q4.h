/* Worker stage, CPU ops: quantising a float weight to group-wise 4 bits at load time, straight
 * into the blocks of cpu_ops_gemv_q4.h.
 *
 * w [N, K] (rows at stride ld elements, dense K; float32, bfloat16 or float16) becomes
 *   P [ceil(N/16)][Kp/8][64] nibbles (byte 4j + t of line i: q[16b + j, 8i + t] low,
 *     q[16b + j, 8i + 4 + t] high), Kp = G * gs, G = ceil(K / gs);
 *   S [ceil(N/16)][G][16] fp16 scales; Z [ceil(N/16)][G][16] uint8 zero points, or none;
 * rows past N zero in all three. Per group of gs inputs (zeros past K), as layers/int4.py's
 * quantize_int4 does it, bit for bit:
 *   symmetric: m = the first value of largest magnitude, scale = fp16(m / -8), z = 8;
 *   zero points: lo = min(min, 0), hi = max(max, 0), scale = fp16((hi - lo) / 15),
 *                z = clamp(rint(-lo / s), 0, 15);
 *   s = the fp16 scale as float (1 where it is 0), q = clamp(rint(x / s) + z, 0, 15).
 * One pass over w, no float32 copy of it (torch's path took ~6 s of one core for a 0.5B
 * model's 494M weights, in float32 chunks). OpenMP over blocks. Owns no state.
 */
#ifndef PIPELINE_CPU_OPS_PACK_Q4_H
#define PIPELINE_CPU_OPS_PACK_Q4_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include "cpu_ops_dtype.h"

/* True float32 divisions, as torch computes them (the build's -ffast-math would allow a
 * reciprocal, which differs in the last bit and so in q at ties). */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#define PIPE_Q4_MAX_GS 128

/* One group of 16 rows: v [16][gs] floats in, q [16][gs] nibbles, scale and zero out. */
static void pipe_pack_q4_group(const float *v, int64_t gs, int rows, int sym, uint8_t *q,
                               uint16_t *S, uint8_t *Z) {
    for (int j = 0; j < 16; j++) {
        const float *x = v + j * gs;
        uint8_t *qj = q + j * gs;
        if (j >= rows) { /* padding rows: all zero, as pack_int4 and _blocks pad */
            memset(qj, 0, (size_t)gs);
            S[j] = 0;
            if (Z) Z[j] = 0;
            continue;
        }
        float scale32, z = 8.f, lo = 0.f;
        if (sym) { /* the largest magnitude, then its first holder (argmax's pick) */
            float amax = 0.f, m = x[0];
            int64_t k = 0;
#ifdef __AVX2__
            __m256 a8 = _mm256_setzero_ps();
            const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (; k < gs; k += 8) a8 = _mm256_max_ps(a8, _mm256_and_ps(_mm256_loadu_ps(x + k), abs));
            float lanes[8];
            _mm256_storeu_ps(lanes, a8);
            for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#endif
            for (; k < gs; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
            k = 0;
#ifdef __AVX2__ /* the first holder, 8 at a time (a scalar scan was a quarter of the packing) */
            const __m256 am8 = _mm256_set1_ps(amax);
            for (; k < gs; k += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(
                    _mm256_and_ps(_mm256_loadu_ps(x + k), abs), am8, _CMP_EQ_OQ));
                if (hit) {
                    k += __builtin_ctz((unsigned)hit);
                    break;
                }
            }
#endif
            for (; k < gs; k++)
                if (fabsf(x[k]) == amax) break;
            m = k < gs ? x[k] : m;
            scale32 = m / -8.f;
        } else {
            float hi = 0.f;
            for (int64_t k = 0; k < gs; k++) {
                lo = x[k] < lo ? x[k] : lo;
                hi = x[k] > hi ? x[k] : hi;
            }
            scale32 = (hi - lo) / 15.f;
        }
        S[j] = pipe_f32_to_f16(scale32);
        const float s = pipe_f16_to_f32(S[j]) == 0.f ? 1.f : pipe_f16_to_f32(S[j]);
        if (!sym) {
            z = rintf(-lo / s);
            z = z < 0.f ? 0.f : z > 15.f ? 15.f : z;
            Z[j] = (uint8_t)z;
        }
        int64_t k = 0;
#ifdef __AVX2__ /* the same IEEE division and rounding, 8 at a time (gs is a multiple of 8) */
        const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z), hi15 = _mm256_set1_ps(15.f);
        for (; k < gs; k += 8) {
            __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            /* max(t, 0) is 0 for a NaN t, as the cast below gives */
            t = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, zv), _mm256_setzero_ps()), hi15);
            const __m256i i32 = _mm256_cvtps_epi32(t);
            const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(qj + k), _mm_packus_epi16(i16, i16));
        }
#endif
        for (; k < gs; k++) {
            float t = rintf(x[k] / s) + z;
            t = t != t ? 0.f : t < 0.f ? 0.f : t > 15.f ? 15.f : t; /* NaN: 0, as torch's cast */
            qj[k] = (uint8_t)t;
        }
    }
}

/* 0, or -1 (a group size that is not a multiple of 8 up to PIPE_Q4_MAX_GS). Z NULL: symmetric. */
static int pipeline_cpu_pack_q4(uint8_t *P, uint16_t *S, uint8_t *Z, const void *w, int dtype,
                                int64_t N, int64_t K, int64_t ld, int64_t gs) {
    if (gs <= 0 || gs % 8 || gs > PIPE_Q4_MAX_GS) return -1;
    const int64_t G = (K + gs - 1) / gs, nb = (N + 15) / 16, lines = G * gs / 8;
    const int64_t esize = pipe_dtype_size(dtype);
    #pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
    for (int64_t b = 0; b < nb; b++) {
        float v[16 * PIPE_Q4_MAX_GS];
        uint8_t q[16 * PIPE_Q4_MAX_GS];
        const int rows = N - b * 16 < 16 ? (int)(N - b * 16) : 16;
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * gs, kn = K - k0 < gs ? K - k0 : gs;
            for (int j = 0; j < rows; j++) {
                const char *row = (const char *)w + ((b * 16 + j) * ld + k0) * esize;
                float *vj = v + j * gs;
                int64_t k = 0;
                if (dtype == PIPE_F32) {
                    memcpy(vj, row, (size_t)kn * 4);
                    k = kn;
                }
#if defined(__AVX2__) && defined(__F16C__) /* 8 at a time: the helpers are not inlined here */
                for (; k + 8 <= kn; k += 8) {
                    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
                    _mm256_storeu_ps(vj + k, dtype == PIPE_BF16
                        ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                        : _mm256_cvtph_ps(h));
                }
#endif
                for (; k < kn; k++)
                    vj[k] = dtype == PIPE_BF16 ? pipe_bf16_to_f32(((const uint16_t *)row)[k])
                                               : pipe_f16_to_f32(((const uint16_t *)row)[k]);
                for (; k < gs; k++) vj[k] = 0.f;
            }
            pipe_pack_q4_group(v, gs, rows, Z == NULL, q, S + (b * G + g) * 16,
                               Z ? Z + (b * G + g) * 16 : NULL);
            uint8_t *out = P + (b * lines + k0 / 8) * 64;
            for (int64_t i = 0; i < gs / 8; i++)
                for (int j = 0; j < 16; j++)
                    for (int t = 0; t < 4; t++)
                        out[i * 64 + j * 4 + t] = (uint8_t)(q[j * gs + 8 * i + t]
                                                             | q[j * gs + 8 * i + 4 + t] << 4);
        }
    }
    return 0;
}

#pragma GCC pop_options
#endif
