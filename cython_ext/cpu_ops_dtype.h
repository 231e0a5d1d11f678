/* Worker stage, CPU ops: element-type conversions shared by the KV-cache and attention ops.
 *
 * Caches hold float32, bfloat16 or float16; every computation runs in float32. The row
 * loops below are written so that GCC vectorises them at -O3 (bf16 is a 16-bit shift,
 * fp16 uses F16C where the CPU has it). Owns no state.
 */
#ifndef PIPELINE_CPU_OPS_DTYPE_H
#define PIPELINE_CPU_OPS_DTYPE_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

enum { PIPE_F32 = 0, PIPE_BF16 = 1, PIPE_F16 = 2 };

static inline int64_t pipe_dtype_size(int dtype) { return dtype == PIPE_F32 ? 4 : 2; }

static inline float pipe_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t pipe_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, do not round to inf */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#ifdef __F16C__
static inline float pipe_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t pipe_f32_to_f16(float f) {
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
#else
static inline float pipe_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t pipe_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t exp = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
    uint32_t man = u & 0x7fffffu;
    if (((u >> 23) & 0xffu) == 0xffu) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (uint16_t)half;
}
#endif

/* dst[i] = src[i] * mul for n elements of `dtype` at src. */
static inline void pipe_load_row(float *restrict dst, const void *restrict src, int64_t n,
                                 int dtype, float mul) {
    if (dtype == PIPE_F32) {
        const float *s = (const float *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i] * mul;
    } else if (dtype == PIPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        int64_t i = 0;
#ifdef __AVX2__
        /* GCC vectorised the loop below 4 wide: it was 40 % of a decode attention pass */
        const __m256 m = _mm256_set1_ps(mul);
        for (; i + 8 <= n; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), m));
        }
#endif
        for (; i < n; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            dst[i] = f * mul;
        }
    } else {
        const uint16_t *s = (const uint16_t *)src;
        int64_t i = 0;
#ifdef __F16C__
        __m256 m = _mm256_set1_ps(mul);
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), m));
        }
#endif
        for (; i < n; i++) dst[i] = pipe_f16_to_f32(s[i]) * mul;
    }
}

/* dst[i] = src[i] * mul, stored as `dtype`. */
static inline void pipe_store_row(void *restrict dst, const float *restrict src, int64_t n,
                                  int dtype, float mul) {
    if (dtype == PIPE_F32) {
        float *d = (float *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = src[i] * mul;
    } else if (dtype == PIPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = pipe_f32_to_bf16(src[i] * mul);
    } else {
        uint16_t *d = (uint16_t *)dst;
        int64_t i = 0;
#ifdef __F16C__
        __m256 m = _mm256_set1_ps(mul);
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + i), m);
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        }
#endif
        for (; i < n; i++) d[i] = pipe_f32_to_f16(src[i] * mul);
    }
}

#endif
