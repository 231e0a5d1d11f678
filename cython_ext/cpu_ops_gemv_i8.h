/* Worker stage, CPU ops: products with int8 weights (per output channel), float32 activations.
 *
 *   pipeline_cpu_gemv_i8:    y [M, N] = x [M, K] @ (scale[n] * Q[n, :])^T (+ bias)
 *   pipeline_cpu_dequant_i8: D [N, K] = scale[n] * Q[n, :] as bfloat16 or float32
 *
 * Q is packed in blocks of 16 output channels, 4 inputs deep: P[N/16][K4][16][4] (K4 = K/4
 * rounded up, N and K zero-padded), so one 64-byte load holds 4 inputs of 16 outputs and
 * the 16 sums of a block stay in the 16 lanes of one register: no horizontal reduction per
 * output, and each block of P (16 K bytes) is read from memory once per call and from L1
 * for every group of rows of x. Each row of x is quantised per token (symmetric, to
 * [-127, 127], scale absmax / 127); the dot products are exact int32 sums: VPDPBUSD on
 * AVX-512 VNNI (q offset to unsigned by +128, corrected with each row's sum of x),
 * VPMADDUBSW on AVX2 (|q| times x with q's sign: with |q|, |x| <= 127 no pair saturates),
 * plain C otherwise; so every path gives the same floats. Rows of x go in groups of up to
 * 8 (AVX-512) or 4 (AVX2) whose accumulators stay in registers, so a batch-32 step costs
 * about 32 VPDPBUSD per 64 weight bytes instead of re-reading Q (on AVX2 a prefill's rows go in
 * panels whose quantised x stays in L2). Threads split the blocks.
 * Dispatch and scratch: cpu_ops_gemv_lp.h. No state of its own.
 */
#ifndef PIPELINE_CPU_OPS_GEMV_I8_H
#define PIPELINE_CPU_OPS_GEMV_I8_H

#include "cpu_ops_gemv_lp.h"

#define PIPE_I8_BLOCK 16
#ifndef PIPE_I8_PANEL_BYTES
#define PIPE_I8_PANEL_BYTES (256 << 10) /* quantised x kept in L2 per panel of rows (AVX2) */
#endif

/* Rows per panel for M rows of row_bytes of quantised x (int8, int4 on AVX2): all of them
 * while they fit PIPE_I8_PANEL_BYTES, else about that many, in fours (the row groups). A
 * prefill's x (1.8 MB at 2048 x 896) read again for every block of 16 outputs came from L3;
 * in panels it stays in L2 and the weights stream once per panel. Exact int32 sums per row
 * and block: the same floats in any order. */
static inline int64_t pipe_i8_panel_rows(int64_t M, int64_t row_bytes) {
    if (M * row_bytes <= PIPE_I8_PANEL_BYTES) return M;
    return PIPE_I8_PANEL_BYTES / row_bytes / 4 * 4 + 4;
}

/* pipe_quantize_row with AVX-512: the same absmax, product and rounding (to nearest even, as
 * lrintf), 16 values at a time; every path of the GEMV and the AMX kernel goes through the
 * one function that pipe_quantize_row picks, so they quantise alike. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static float pipe_quantize_row_avx512(const float *x, int64_t K, int64_t K4, int8_t *q) {
    const int64_t K16 = K / 16 * 16;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; k < K16; k += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + k));
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ); /* inf or NaN */
        amax = _mm512_max_ps(amax, a);
    }
    float m = _mm512_reduce_max_ps(amax);
    int finite = bad == 0;
    for (int64_t k = K16; k < K; k++) {
        m = fmaxf(m, fabsf(x[k]));
        finite &= isfinite(x[k]);
    }
    memset(q + K16, 0, (size_t)(K4 * 4 - K16));
    if (!finite || !(m > 0.0f)) {
        memset(q, 0, (size_t)K16);
        return finite ? 0.0f : NAN;
    }
    const float inv = 127.0f / m;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t k = 0; k < K16; k += 16)
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(
            _mm512_mul_ps(_mm512_loadu_ps(x + k), vinv))));
    for (int64_t k = K16; k < K; k++) q[k] = (int8_t)lrintf(x[k] * inv);
    return m / 127.0f;
}

/* The same with AVX2, 32 values at a time (the scalar loop below called fmaxf and lrintf per
 * value: ~3% of an int4 decode step at batch 1, with the other threads waiting on it). */
__attribute__((target("avx2,fma")))
static float pipe_quantize_row_avx2(const float *x, int64_t K, int64_t K4, int8_t *q) {
    const int64_t K8 = K / 8 * 8, K32 = K / 32 * 32;
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* inf or NaN */
        amax = _mm256_max_ps(amax, a);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float m = _mm_cvtss_f32(h);
    int finite = _mm256_movemask_ps(bad) == 0;
    for (int64_t k = K8; k < K; k++) {
        m = fmaxf(m, fabsf(x[k]));
        finite &= isfinite(x[k]);
    }
    memset(q + K32, 0, (size_t)(K4 * 4 - K32));
    if (!finite || !(m > 0.0f)) {
        memset(q, 0, (size_t)K32);
        return finite ? 0.0f : NAN;
    }
    const float inv = 127.0f / m;
    const __m256 vinv = _mm256_set1_ps(inv);
    /* two saturating packs interleave the four vectors' 4-byte quarters per 128-bit lane */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t k = 0; k < K32; k += 32) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), vinv));
        const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), vinv));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permutevar8x32_epi32(p, order));
    }
    for (int64_t k = K32; k < K; k++) q[k] = (int8_t)lrintf(x[k] * inv);
    return m / 127.0f;
}

/* Row x (K values) quantised into q (K4 * 4 bytes, zero-padded); returns its scale (0 for a
 * zero row, NaN for a row with NaN/inf, which then poisons its outputs as in float32). The
 * vector bodies follow the ISA cap (pipeline_cpu_set_isa), so tests reach each of them. */
static float pipe_quantize_row(const float *x, int64_t K, int64_t K4, int8_t *q) {
    const int level = pipe_lp_level(1);
    if (level >= PIPE_ISA_AVX512) return pipe_quantize_row_avx512(x, K, K4, q);
    if (level == PIPE_ISA_AVX2) return pipe_quantize_row_avx2(x, K, K4, q);
    float amax = 0.0f;
    int finite = 1;
    for (int64_t k = 0; k < K; k++) {
        amax = fmaxf(amax, fabsf(x[k]));
        finite &= isfinite(x[k]);
    }
    memset(q, 0, (size_t)(K4 * 4));
    if (!finite || !(amax > 0.0f)) return finite ? 0.0f : NAN;
    const float inv = 127.0f / amax;
    for (int64_t k = 0; k < K; k++) q[k] = (int8_t)lrintf(x[k] * inv);
    return amax / 127.0f;
}

/* y[m, b*16 + j] for j < 16 (and < N) from the 16 int32 sums of block b: one fused
 * multiply-add, sum * (xs * scale) + bias, written as fmaf so that this scalar copy and the
 * AVX-512 one (pipe_i8_store16, the AMX kernel's) round alike: the paths stay bit-identical
 * whatever -ffast-math contracts. Not inlined: one compiled copy for every scalar caller. */
static __attribute__((noinline)) void pipe_i8_store(float *y, int64_t ldy, const int32_t *sums, int64_t m,
                                 int64_t b, int64_t N, const float *xs, const float *scale,
                                 const float *bias) {
    const int64_t n0 = b * PIPE_I8_BLOCK;
    const int64_t n1 = n0 + PIPE_I8_BLOCK < N ? n0 + PIPE_I8_BLOCK : N;
    for (int64_t n = n0; n < n1; n++)
        y[m * ldy + n] = fmaf((float)sums[n - n0], xs[m] * scale[n], bias ? bias[n] : 0.0f);
}

/* pipe_i8_store with AVX-512: the same operations, 16 lanes at once. */
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
static inline void pipe_i8_store16(float *y, int64_t ldy, const int32_t *sums, int64_t m,
                                   int64_t b, int64_t N, const float *xs, const float *scale,
                                   const float *bias, int nt) {
    const int64_t n0 = b * PIPE_I8_BLOCK;
    const __mmask16 k = N - n0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
    const __m512 s = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums));
    const __m512 f = _mm512_mul_ps(_mm512_set1_ps(xs[m]), _mm512_maskz_loadu_ps(k, scale + n0));
    const __m512 c = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    pipe_store16(y + m * ldy + n0, k, _mm512_fmadd_ps(s, f, c), nt);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline __attribute__((always_inline))
void pipe_i8_group_avx512(const int R, int64_t m0, const int8_t *P, const int8_t *xq, int64_t K4,
                          const int32_t *xsum, int64_t b, int32_t (*sums)[PIPE_I8_BLOCK]) {
    /* VPDPBUSD multiplies unsigned by signed bytes and can broadcast only the signed operand
     * from memory: so q goes unsigned (q + 128, one XOR per 64 bytes, shared by the R rows),
     * x stays signed and is broadcast straight from memory, and the sums are corrected by
     * 128 * sum_k x[k]. */
    const int8_t *pb = P + b * PIPE_I8_BLOCK * 4 * K4;
    const __m512i off = _mm512_set1_epi8((char)0x80);
    if (R == 1) {
        /* One row: four independent sums over k4, or each 64-byte block waits for the last
         * one's VPDPBUSD (its latency, not the memory, set the pace: batch 1 read its weights
         * at ~11 GB/s a core). Integer sums: the same result in any order. */
        const int8_t *xr = xq + m0 * K4 * 4;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k4 = 0;
        for (; k4 + 4 <= K4; k4 += 4) {
            a0 = _mm512_dpbusd_epi32(a0, _mm512_xor_si512(_mm512_loadu_si512(pb + k4 * 64), off),
                                     _mm512_set1_epi32(*(const int32_t *)(xr + k4 * 4)));
            a1 = _mm512_dpbusd_epi32(a1, _mm512_xor_si512(_mm512_loadu_si512(pb + k4 * 64 + 64), off),
                                     _mm512_set1_epi32(*(const int32_t *)(xr + k4 * 4 + 4)));
            a2 = _mm512_dpbusd_epi32(a2, _mm512_xor_si512(_mm512_loadu_si512(pb + k4 * 64 + 128), off),
                                     _mm512_set1_epi32(*(const int32_t *)(xr + k4 * 4 + 8)));
            a3 = _mm512_dpbusd_epi32(a3, _mm512_xor_si512(_mm512_loadu_si512(pb + k4 * 64 + 192), off),
                                     _mm512_set1_epi32(*(const int32_t *)(xr + k4 * 4 + 12)));
        }
        for (; k4 < K4; k4++)
            a0 = _mm512_dpbusd_epi32(a0, _mm512_xor_si512(_mm512_loadu_si512(pb + k4 * 64), off),
                                     _mm512_set1_epi32(*(const int32_t *)(xr + k4 * 4)));
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
        _mm512_storeu_si512(sums[0], _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xsum[m0])));
        return;
    }
    __m512i acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < K4; k4++) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(pb + k4 * 64), off);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(
                *(const int32_t *)(xq + (m0 + r) * K4 * 4 + k4 * 4)));
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_si512(sums[r], _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * xsum[m0 + r])));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void pipe_i8_blocks_avx512(float *y, int64_t ldy, const int8_t *P, const int8_t *xq,
                                  const float *xs, const float *scale, const int32_t *xsum,
                                  const float *bias, int64_t M, int64_t K4, int64_t N,
                                  int64_t b0, int64_t b1) {
    int32_t sums[8][PIPE_I8_BLOCK];
    for (int64_t b = b0; b < b1; b++) {
        /* Many rows reuse each block from L1 long enough to fetch the next one meanwhile (the
         * hardware prefetcher stops at page ends); a few rows stream it once, and there the
         * extra prefetches only compete with the loads (batch 1: 0.9 against 1.2 ms). */
        if (M >= 8 && b + 1 < b1)
            for (int64_t off = 0; off < PIPE_I8_BLOCK * 4 * K4; off += 64)
                _mm_prefetch((const char *)(P + (b + 1) * PIPE_I8_BLOCK * 4 * K4 + off), _MM_HINT_T1);
        int64_t m0 = 0;
        for (; m0 + 8 <= M; m0 += 8) {
            pipe_i8_group_avx512(8, m0, P, xq, K4, xsum, b, sums);
            for (int r = 0; r < 8; r++) pipe_i8_store(y, ldy, sums[r], m0 + r, b, N, xs, scale, bias);
        }
        for (; m0 + 4 <= M; m0 += 4) {
            pipe_i8_group_avx512(4, m0, P, xq, K4, xsum, b, sums);
            for (int r = 0; r < 4; r++) pipe_i8_store(y, ldy, sums[r], m0 + r, b, N, xs, scale, bias);
        }
        for (; m0 < M; m0++) {
            pipe_i8_group_avx512(1, m0, P, xq, K4, xsum, b, sums);
            pipe_i8_store(y, ldy, sums[0], m0, b, N, xs, scale, bias);
        }
    }
}

__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_i8_group_avx2(const int R, int64_t m0, const int8_t *P, const int8_t *xq, int64_t K4,
                        int64_t b, int32_t (*sums)[PIPE_I8_BLOCK]) {
    const int8_t *pb = P + b * PIPE_I8_BLOCK * 4 * K4;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lo[4], hi[4];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int64_t k4 = 0; k4 < K4; k4++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pb + k4 * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pb + k4 * 64 + 32));
        const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
        for (int r = 0; r < R; r++) {
            int32_t xv;
            memcpy(&xv, xq + (m0 + r) * K4 * 4 + k4 * 4, 4);
            const __m256i xb = _mm256_set1_epi32(xv);
            lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
            hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)sums[r], lo[r]);
        _mm256_storeu_si256((__m256i *)(sums[r] + 8), hi[r]);
    }
}

/* One row (decode at batch 1) over four blocks at once: four weight streams in flight (one
 * block's stream at a time left a DRAM-bound read short of the bandwidth, as for bf16). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_i8_quad_avx2(int64_t m0, const int8_t *P, const int8_t *xq, int64_t K4, int64_t b,
                       int32_t (*sums)[PIPE_I8_BLOCK]) {
    const int8_t *pb = P + b * PIPE_I8_BLOCK * 4 * K4;
    const int64_t bs = PIPE_I8_BLOCK * 4 * K4;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_si256();
    for (int64_t k4 = 0; k4 < K4; k4++) {
        int32_t xv;
        memcpy(&xv, xq + m0 * K4 * 4 + k4 * 4, 4);
        const __m256i xb = _mm256_set1_epi32(xv);
        for (int j = 0; j < 4; j++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pb + j * bs + k4 * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pb + j * bs + k4 * 64 + 32));
            lo[j] = _mm256_add_epi32(lo[j], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(xb, w0)), ones));
            hi[j] = _mm256_add_epi32(hi[j], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(xb, w1)), ones));
        }
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256((__m256i *)sums[j], lo[j]);
        _mm256_storeu_si256((__m256i *)(sums[j] + 8), hi[j]);
    }
}

__attribute__((target("avx2,fma")))
static void pipe_i8_blocks_avx2(float *y, int64_t ldy, const int8_t *P, const int8_t *xq,
                                const float *xs, const float *scale, const float *bias,
                                int64_t M, int64_t K4, int64_t N, int64_t b0, int64_t b1) {
    int32_t sums[4][PIPE_I8_BLOCK];
    int64_t b = b0;
    if (M == 1)
        for (; b + 4 <= b1; b += 4) {
            pipe_i8_quad_avx2(0, P, xq, K4, b, sums);
            for (int j = 0; j < 4; j++) pipe_i8_store(y, ldy, sums[j], 0, b + j, N, xs, scale, bias);
        }
    const int64_t mc = pipe_i8_panel_rows(M, K4 * 4);
    for (int64_t mp = 0; mp < M; mp += mc) {
        const int64_t me = mp + mc < M ? mp + mc : M;
        for (int64_t bb = b; bb < b1; bb++) {
            int64_t m0 = mp;
            for (; m0 + 4 <= me; m0 += 4) {
                pipe_i8_group_avx2(4, m0, P, xq, K4, bb, sums);
                for (int r = 0; r < 4; r++) pipe_i8_store(y, ldy, sums[r], m0 + r, bb, N, xs, scale, bias);
            }
            for (; m0 < me; m0++) {
                pipe_i8_group_avx2(1, m0, P, xq, K4, bb, sums);
                pipe_i8_store(y, ldy, sums[0], m0, bb, N, xs, scale, bias);
            }
        }
    }
}

static void pipe_i8_blocks_portable(float *y, int64_t ldy, const int8_t *P, const int8_t *xq,
                                    const float *xs, const float *scale, const float *bias,
                                    int64_t M, int64_t K4, int64_t N, int64_t b0, int64_t b1) {
    int32_t sums[PIPE_I8_BLOCK];
    for (int64_t b = b0; b < b1; b++) {
        const int8_t *pb = P + b * PIPE_I8_BLOCK * 4 * K4;
        for (int64_t m = 0; m < M; m++) {
            memset(sums, 0, sizeof sums);
            for (int64_t k4 = 0; k4 < K4; k4++)
                for (int j = 0; j < PIPE_I8_BLOCK; j++)
                    for (int t = 0; t < 4; t++)
                        sums[j] += (int32_t)pb[k4 * 64 + j * 4 + t] * xq[m * K4 * 4 + k4 * 4 + t];
            pipe_i8_store(y, ldy, sums, m, b, N, xs, scale, bias);
        }
    }
}

static int pipe_i8_level(int64_t K) {
    (void)K; /* the packed layout has no alignment needs */
    return pipe_lp_level(1);
}

/* P packed as above (N rounded up to 16, K to 4, padding zero), scale for NB * 16 rows.
 * Returns -1 without scratch memory. */
static int pipeline_cpu_gemv_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                                const int8_t *P, const float *scale, const float *bias, int64_t M, int64_t K, int64_t N) {
    if (M <= 0 || N <= 0) return 0;
    const int level = pipe_i8_level(K);
    const int64_t K4 = (K + 3) / 4, NB = (N + PIPE_I8_BLOCK - 1) / PIPE_I8_BLOCK;
    const size_t xbytes = ((size_t)(M * K4 * 4) + 63) / 64 * 64;
    char *buf = (char *)pipe_lp_buffer(xbytes + (size_t)M * 8);
    if (buf == NULL) return -1;
    int8_t *xq = (int8_t *)buf;
    float *xs = (float *)(buf + xbytes);
    int32_t *xsum = (int32_t *)(xs + M);
    for (int64_t m = 0; m < M; m++) {
        const int8_t *row = xq + m * K4 * 4;
        xs[m] = pipe_quantize_row(x + m * ldx, K, K4, xq + m * K4 * 4);
        int32_t t = 0;
        for (int64_t k = 0; k < K; k++) t += row[k];
        xsum[m] = t;
    }
    const int par = NB * PIPE_I8_BLOCK * K4 * 4 * (M > 8 ? 8 : 1) >= PIPE_LP_PAR_MIN_BYTES
                    && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = NB * t / nt, b1 = NB * (t + 1) / nt;
        if (level == PIPE_ISA_AVX512)
            pipe_i8_blocks_avx512(y, ldy, P, xq, xs, scale, xsum, bias, M, K4, N, b0, b1);
        else if (level == PIPE_ISA_AVX2)
            pipe_i8_blocks_avx2(y, ldy, P, xq, xs, scale, bias, M, K4, N, b0, b1);
        else
            pipe_i8_blocks_portable(y, ldy, P, xq, xs, scale, bias, M, K4, N, b0, b1);
    }
    return 0;
}

/* D [N, K] = scale[n] * Q[n, :] from the packed P, as bf16 (PIPE_BF16) or float32 (PIPE_F32). */
static void pipeline_cpu_dequant_i8(void *D, int dtype, const int8_t *P, const float *scale,
                                    int64_t N, int64_t K) {
    const int64_t K4 = (K + 3) / 4, NB = (N + PIPE_I8_BLOCK - 1) / PIPE_I8_BLOCK;
    #pragma omp parallel for if (N * K >= PIPE_GEMV_PAR_MIN_BYTES) schedule(static)
    for (int64_t b = 0; b < NB; b++) {
        const int8_t *pb = P + b * PIPE_I8_BLOCK * 4 * K4;
        int8_t row[K4 * 4]; /* one row gathered from the block, then widened in one pass */
        for (int j = 0; j < PIPE_I8_BLOCK && b * PIPE_I8_BLOCK + j < N; j++) {
            const int64_t n = b * PIPE_I8_BLOCK + j;
            for (int64_t k4 = 0; k4 < K4; k4++) memcpy(row + k4 * 4, pb + k4 * 64 + j * 4, 4);
            const float s = scale[n];
            if (dtype == PIPE_F32) {
                float *d = (float *)D + n * K;
                for (int64_t k = 0; k < K; k++) d[k] = s * (float)row[k];
            } else {
                uint16_t *d = (uint16_t *)D + n * K;
                for (int64_t k = 0; k < K; k++) d[k] = pipe_f32_to_bf16(s * (float)row[k]);
            }
        }
    }
}

#endif
