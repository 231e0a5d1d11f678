/* Worker stage, CPU ops: packing a projection weight into the kernels' blocks at load time.
 *
 * A weight [N, K] (rows at any stride, dense K; float32, bfloat16 or float16) becomes the
 * VNNI layout of cpu_ops_gemv_lp.h / cpu_ops_gemv_i8.h / cpu_ops_amx.h:
 *   bf16: [ceil(N/16)][Kp/2][16][2] (Kp = K rounded up to 32), RNE rounding as torch's
 *         Tensor.to(bfloat16) does it (integer bias, denormals kept, NaN -> torch's NaN);
 *   int8: per-row symmetric quantisation (scale = absmax/127 in float32, 1 for an all-zero
 *         or NaN row; q = clamp(rint(x / scale), -127, 127), NaN -> 0) into
 *         [ceil(N/16)][ceil(K/4)][16][4], scales padded with 1 to a multiple of 16 rows,
 * zero padding, bit-identical to lowp.py's torch path. Both layouts store one 32-bit unit
 * (2 bf16 / 4 int8 of one row) per (row, unit): a 16-row block is read 16 units at a time
 * from each row, transposed in registers and written as 1 KB of contiguous output, so the
 * source is read once and the output written once, with no temporary. OpenMP over blocks.
 * Owns no state.
 */
#ifndef PIPELINE_CPU_OPS_PACK_H
#define PIPELINE_CPU_OPS_PACK_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include "cpu_ops_dtype.h"

/* The int8 scale and quotient must be the true float32 division torch computes: the build's
 * -ffast-math would allow x * (1 / s), which differs in the last bit (and so in q at ties). */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

/* torch's NaN from float32 (its vector path) and from float16 (c10's scalar one). */
#define PIPE_PACK_NAN(dtype) ((dtype) == PIPE_F16 ? 0x7fc0u : 0xffffu)

/* torch's float -> bfloat16: pipe_f32_to_bf16's rounding (c10's round_to_nearest_even,
 * denormals kept), with torch's NaN for the source dtype. */
static inline uint16_t pipe_pack_bf16_of(float f, uint32_t nan) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)nan : pipe_f32_to_bf16(f);
}

static inline float pipe_pack_load(const char *row, int dtype, int64_t k) {
    if (dtype == PIPE_F32) return ((const float *)row)[k];
    uint16_t h = ((const uint16_t *)row)[k];
    return dtype == PIPE_BF16 ? pipe_bf16_to_f32(h) : pipe_f16_to_f32(h);
}

static inline int8_t pipe_pack_q8(float x, float s) {
    float q = rintf(x / s);
    if (q != q) return 0; /* NaN (a NaN or inf/inf) -> 0, as torch's cast gives */
    return (int8_t)(q > 127.f ? 127 : q < -127.f ? -127 : (int)q);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PIPE_PACK_AVX512 1
#else
#define PIPE_PACK_AVX512 0
#endif

#if PIPE_PACK_AVX512
#include <immintrin.h>

/* r[i] (16 units of row i) -> r[c] (unit c of rows 0..15): 32-bit 16x16 transpose. */
static inline void pipe_pack_transpose(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + c]: rows g..g+3, unit 4 * lane + c */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int c = 0; c < 4; c++) { /* t[h + c]: units c, 8 + c; t[h + 4 + c]: 4 + c, 12 + c */
            t[h + c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0x88);
            t[h + 4 + c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0xdd);
        }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
    }
}

static inline __mmask16 pipe_pack_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* 16 floats of row from column k (columns >= K read as 0). */
static inline __m512 pipe_pack_load16(const char *row, int dtype, int64_t k, int64_t K) {
    __mmask16 m = pipe_pack_mask(K - k);
    if (dtype == PIPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)row + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k);
    if (dtype == PIPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i pipe_pack_bf16x16(__m512 x, uint32_t nan) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32((int)nan), r);
    return _mm512_cvtepi32_epi16(r);
}

/* 32 columns of a row from k as 16 bf16 pairs. */
static inline __m512i pipe_pack_bf16_unit16(const char *row, int dtype, int64_t k, int64_t K) {
    if (dtype == PIPE_BF16) {
        int64_t n = K - k;
        __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1);
        return _mm512_maskz_loadu_epi16(m, (const uint16_t *)row + k);
    }
    __m256i lo = pipe_pack_bf16x16(pipe_pack_load16(row, dtype, k, K), PIPE_PACK_NAN(dtype));
    __m256i hi = pipe_pack_bf16x16(pipe_pack_load16(row, dtype, k + 16, K), PIPE_PACK_NAN(dtype));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m128i pipe_pack_q8x16(__m512 x, __m512 s) {
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(x, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __mmask16 ok = _mm512_cmp_ps_mask(q, q, _CMP_ORD_Q);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    return _mm512_cvtepi32_epi8(_mm512_maskz_cvtps_epi32(ok, q));
}

/* 64 columns of a row from k as 16 int8 quads. */
static inline __m512i pipe_pack_i8_unit16(const char *row, int dtype, int64_t k, int64_t K, float s) {
    __m512 sv = _mm512_set1_ps(s);
    __m512i r = _mm512_castsi128_si512(pipe_pack_q8x16(pipe_pack_load16(row, dtype, k, K), sv));
    r = _mm512_inserti32x4(r, pipe_pack_q8x16(pipe_pack_load16(row, dtype, k + 16, K), sv), 1);
    r = _mm512_inserti32x4(r, pipe_pack_q8x16(pipe_pack_load16(row, dtype, k + 32, K), sv), 2);
    return _mm512_inserti32x4(r, pipe_pack_q8x16(pipe_pack_load16(row, dtype, k + 48, K), sv), 3);
}
#endif

#include "cpu_ops_pack_avx2.h"

/* torch's amax/amin in float32; a NaN anywhere or an all-zero row gives scale 1. */
static float pipe_pack_scale(const char *row, int dtype, int64_t K) {
    float amax = 0.f;
    int nan = 0;
    int64_t k = 0;
#if PIPE_PACK_AVX512
    __m512 m = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (; k < K; k += 16) {
        __m512 a = _mm512_abs_ps(pipe_pack_load16(row, dtype, k, K));
        bad |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, a);
    }
    nan = bad != 0;
    amax = _mm512_reduce_max_ps(m);
#elif PIPE_PACK_AVX2
    amax = pipe_pack_amax8(row, dtype, K, &nan);
    k = K;
#endif
    for (; k < K; k++) {
        float a = fabsf(pipe_pack_load(row, dtype, k));
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    return nan || !(amax > 0.f) ? 1.f : amax / 127.f;
}

/* One 16-row block: units of `per` elements (2 bf16, 4 int8), `units` per row in the output. */
static void pipe_pack_block(uint32_t *out, const char *w, int dtype, int64_t rows, int64_t K,
                            int64_t ld_bytes, int64_t units, int i8, const float *s) {
    int64_t per = i8 ? 4 : 2;
#if PIPE_PACK_AVX512
    (void)per;
    for (int64_t j = 0; j < units; j += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) {
            const char *row = w + i * ld_bytes;
            r[i] = i >= rows ? _mm512_setzero_si512()
                   : i8 ? pipe_pack_i8_unit16(row, dtype, j * 4, K, s[i])
                        : pipe_pack_bf16_unit16(row, dtype, j * 2, K);
        }
        pipe_pack_transpose(r);
        int64_t n = units - j < 16 ? units - j : 16;
        for (int64_t c = 0; c < n; c++) _mm512_storeu_si512(out + (j + c) * 16, r[c]);
    }
#elif PIPE_PACK_AVX2
    (void)per;
    pipe_pack_block8(out, w, dtype, rows, K, ld_bytes, units, i8, s);
#else
    for (int64_t j = 0; j < units; j++)
        for (int64_t i = 0; i < 16; i++) {
            uint32_t v = 0;
            for (int64_t e = 0; e < per; e++) {
                int64_t k = j * per + e;
                if (i >= rows || k >= K) continue;
                float x = pipe_pack_load(w + i * ld_bytes, dtype, k);
                uint32_t b = i8 ? (uint8_t)pipe_pack_q8(x, s[i]) : pipe_pack_bf16_of(x, PIPE_PACK_NAN(dtype));
                v |= b << (e * (32 / per));
            }
            out[j * 16 + i] = v;
        }
#endif
}

/* In place (out == w: dense rows, N a multiple of 16, K of 32 for bf16 (over bf16) or of 4
 * for int8, so a block's output is no larger than its input): each block is packed to its
 * place over input already consumed (a block written over its own input, bf16's and int8's
 * block 0, from a per-thread scratch copy): no fresh output memory to fault in. The blocks
 * go in waves [lo, hi) whose outputs all end before the input
 * of block lo (bf16: each block over itself, one wave; int8 over bf16: waves of 1, 1, 2, 4..
 * blocks), so no thread writes over input another has yet to read; the input's bytes past
 * the int8 output go back to the kernel (MADV_DONTNEED: they read as zeros if touched). */
static int pipe_pack(uint32_t *out, float *scale, const void *w, int dtype, int64_t N, int64_t K,
                     int64_t ld, int i8) {
    int64_t nb = (N + 15) / 16, esize = pipe_dtype_size(dtype);
    int64_t units = i8 ? (K + 3) / 4 : (K + 31) / 32 * 16;
    int64_t ob = units * 64, sb = 16 * ld * esize; /* bytes of a block out and in */
    int inplace = (const void *)out == w;
    if (inplace && (N % 16 || ld != K || (i8 ? K % 4 : dtype != PIPE_BF16 || K % 32))) return -1;
    int failed = 0;
    #pragma omp parallel if (N * K >= (1 << 16)) reduction(| : failed)
    {
        char *scratch = (char *)malloc((size_t)sb);
        failed |= scratch == NULL;
        for (int64_t lo = 0, hi; lo < nb; lo = hi) {
            hi = !inplace || ob == sb ? nb : lo * sb / ob > lo + 1 ? lo * sb / ob : lo + 1;
            hi = hi < nb ? hi : nb;
            #pragma omp for schedule(static)
            for (int64_t b = lo; b < hi; b++) {
                const char *w0 = (const char *)w + b * sb;
                int64_t rows = N - b * 16 < 16 ? N - b * 16 : 16;
                if (!scratch) continue; /* no memory: reported */
                /* A block written over its own input needs the copy (bf16; int8's block 0);
                 * a later int8 wave in place writes below the input it reads. Out of place
                 * every block is copied too: read as 16 row streams straight from a mapped
                 * file, the transpose ran at half the speed of one sequential copy and a
                 * transpose from L1/L2 (the loader packs from the page cache). */
                if (!inplace || ob == sb || b == 0)
                    w0 = (const char *)memcpy(scratch, w0, (size_t)(((rows - 1) * ld + K) * esize));
                if (i8)
                    for (int64_t i = 0; i < 16; i++)
                        scale[b * 16 + i] = i < rows ? pipe_pack_scale(w0 + i * ld * esize, dtype, K) : 1.f;
                pipe_pack_block(out + b * units * 16, w0, dtype, rows, K, ld * esize, units, i8,
                                i8 ? scale + b * 16 : NULL);
            }
        }
        free(scratch);
    }
    if (inplace && !failed && ob < sb) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = ((uintptr_t)out + (uintptr_t)(nb * ob) + page - 1) / page * page;
        uintptr_t hi = ((uintptr_t)w + (uintptr_t)(nb * sb)) / page * page;
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    }
    return failed ? -2 : 0;
}

/* out [ceil(N/16)][Kp/2][16][2] bf16 from w [N, K] (row stride ld elements) of `dtype`;
 * out may be w (see pipe_pack). 0, or -1 (in place where it cannot be), -2 (no memory). */
static inline int pipeline_cpu_pack_bf16(uint16_t *out, const void *w, int dtype, int64_t N,
                                         int64_t K, int64_t ld) {
    return pipe_pack((uint32_t *)out, NULL, w, dtype, N, K, ld, 0);
}

/* out [ceil(N/16)][ceil(K/4)][16][4] int8 and scale [ceil(N/16) * 16] from w [N, K]; out
 * may be w (see pipe_pack). 0, -1 or -2 as pipeline_cpu_pack_bf16. */
static inline int pipeline_cpu_pack_i8(int8_t *out, float *scale, const void *w, int dtype,
                                       int64_t N, int64_t K, int64_t ld) {
    return pipe_pack((uint32_t *)out, scale, w, dtype, N, K, ld, 1);
}

/* The embedding lookup of a packed table: out [R, K] float32 = rows[0..R) of the [N, K]
 * weight packed as above with Kc units a row (bf16: Kp / 2, int8: ceil(K / 4)), bf16 widened
 * (scale NULL) or int8 times its row's scale: the floats of lowp.py's unpack in torch.
 * Returns the index of a row outside [0, N), or -1 (nothing written). */
static int64_t pipeline_cpu_unpack_rows(float *out, const void *P, const float *scale,
                                        int64_t N, int64_t K, int64_t Kc, const int64_t *rows,
                                        int64_t R) {
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= N) return r;
    #pragma omp parallel for schedule(static) if (R * K >= (1 << 20))
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = rows[r], b = n / 16, j = n % 16;
        float *o = out + r * K;
        if (scale) {
            const int8_t *p = (const int8_t *)P + (b * Kc * 16 + j) * 4;
            for (int64_t k = 0; k < K; k++) o[k] = (float)p[(k / 4) * 64 + k % 4] * scale[n];
        } else {
            const uint16_t *p = (const uint16_t *)P + (b * Kc * 16 + j) * 2;
            for (int64_t k = 0; k < K; k++) o[k] = pipe_bf16_to_f32(p[(k / 2) * 32 + k % 2]);
        }
    }
    return -1;
}

#pragma GCC pop_options
#endif
