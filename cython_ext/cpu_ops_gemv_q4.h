/* Worker stage, CPU ops: products with group-wise 4-bit weights, float32 activations.
 *
 *   pipeline_cpu_gemv_q4:    y [M, N] = x [M, K] @ W^T (+ bias),
 *                            W[n, k] = s[n, g] * (q[n, k] - z[n, g]), g = k / group size
 *   pipeline_cpu_dequant_q4: D [N, K] = W (or some of its rows) as bfloat16 or float32
 *
 * q (0..15) is packed in blocks of 16 output channels, 8 inputs deep: P[N/16][K8][64] bytes,
 * byte j*4 + t of a 64-byte row holding q[16b + j, 8i + t] in its low nibble and
 * q[16b + j, 8i + 4 + t] in its high one. So one 64-byte load gives 8 inputs of 16 outputs,
 * and an AND (low) and a shift + AND (high) turn it into two VPDPBUSD operands whose 16 int32
 * lanes are the 16 outputs (no horizontal sums), with the nibbles as the unsigned operand and
 * x, quantised per token to int8 as for int8 weights, broadcast as the signed one. Scales are
 * fp16, S[N/16][G][16] (G groups of `gs` inputs, K padded with zeros to G * gs); zero points
 * uint8 Z[N/16][G][16], or none (symmetric: 8). Per group the exact int32 sum
 * sum_k q x is corrected by z * sum_k x (the row's per-group sums of x, computed once) and
 * added into a float accumulator with one FMA by the group's scale, in group order on every
 * path (AVX-512 VNNI, AVX2 VPMADDUBSW, portable C with fmaf): bit-identical floats. An
 * optional permutation (GPTQ act-order) gathers x[perm[k]] while quantising it, so groups
 * stay contiguous in K. Rows of x go in groups of 8 (AVX-512) or 4 (AVX2) that reuse each
 * block from L1 (on AVX2 a prefill's rows in panels whose quantised x stays in L2,
 * pipe_i8_panel_rows); batch 1 keeps four independent integer sums (VPDPBUSD latency). Threads
 * split the blocks. Dispatch and scratch: cpu_ops_gemv_lp.h. No state of its own.
 */
#ifndef PIPELINE_CPU_OPS_GEMV_Q4_H
#define PIPELINE_CPU_OPS_GEMV_Q4_H

#include "cpu_ops_gemv_i8.h"

#define PIPE_Q4_BLOCK 16
/* Batch 1: bytes ahead of the loads that each 64-byte line is prefetched into L2 (0: none). The
 * hardware prefetcher alone kept one core at ~9 GB/s on this kernel, where the int8 one (half
 * the instructions per byte) reached ~12; 1-2 KB ahead closes most of that (docs/cpu.md). On
 * Zen 3 (AVX2) a whole 0.5B int4 token of GEMVs took 8.2 -> 6.8 ms (docs/benchmarks.md). */
#ifndef PIPE_Q4_NEXT_BLOCK
#define PIPE_Q4_NEXT_BLOCK 1
#endif
#ifndef PIPE_Q4_PREFETCH
#define PIPE_Q4_PREFETCH 2048
#endif

typedef struct {
    const uint8_t *P;   /* packed nibbles */
    const uint16_t *S;  /* fp16 scales */
    const uint8_t *Z;   /* zero points, NULL: 8 */
    const int8_t *xq;   /* [M][Kp] quantised rows of x */
    const float *xs;    /* [M] their scales */
    const int32_t *xsum; /* [M][G] their per-group sums */
    const float *bias;
    float *y;
    int64_t ldy, M, N, G, gs;
} pipe_q4_args;

static inline int32_t pipe_q4_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* y[m, 16b + j] from the block's 16 float sums. Not inlined: one compiled copy for every
 * path, so the final scaling is the same floats everywhere. */
static __attribute__((noinline)) void pipe_q4_store(const pipe_q4_args *a, const float *acc,
                                                    int64_t m, int64_t b) {
    const int64_t n0 = b * PIPE_Q4_BLOCK;
    const int64_t n1 = n0 + PIPE_Q4_BLOCK < a->N ? n0 + PIPE_Q4_BLOCK : a->N;
    for (int64_t n = n0; n < n1; n++)
        a->y[m * a->ldy + n] = acc[n - n0] * a->xs[m] + (a->bias ? a->bias[n] : 0.0f);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) static inline
__attribute__((always_inline))
void pipe_q4_group_avx512(const int R, int64_t m0, int64_t b, const pipe_q4_args *a,
                          float (*out)[PIPE_Q4_BLOCK]) {
    const int64_t steps = a->gs / 8, Kp = a->G * a->gs;
    const uint8_t *pb = a->P + b * a->G * steps * 64;
    const uint16_t *sb = a->S + b * a->G * PIPE_Q4_BLOCK;
    const uint8_t *zb = a->Z ? a->Z + b * a->G * PIPE_Q4_BLOCK : NULL;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 facc[8];
    for (int r = 0; r < R; r++) facc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t *pg = pb + g * steps * 64;
        const __m512i z = zb ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zb + g * 16)))
                             : _mm512_set1_epi32(8);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + g * 16)));
        if (R == 1) {
            /* Four independent sums, or each load waits for the previous VPDPBUSD. */
            const int8_t *xr = a->xq + m0 * Kp + g * a->gs;
            /* The high nibbles are multiplied in place (w & 0xF0 = 16 q) into their own
             * sums, divided by 16 (exactly) at the group's end: one shift per group instead
             * of one per line. Each product is at most 240 * 127, so 4 per lane per line and
             * gs / 8 lines stay far inside int32. */
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#define PIPE_Q4_STEP(acc_lo, acc_hi, i)                                                       \
            do {                                                                               \
                const __m512i w_ = _mm512_loadu_si512(pg + (i) * 64);                           \
                acc_lo = _mm512_dpbusd_epi32(acc_lo, _mm512_and_si512(w_, mask),                \
                                             _mm512_set1_epi32(pipe_q4_x4(xr + (i) * 8)));      \
                acc_hi = _mm512_dpbusd_epi32(acc_hi, _mm512_andnot_si512(mask, w_),             \
                                             _mm512_set1_epi32(pipe_q4_x4(xr + (i) * 8 + 4)));  \
            } while (0)
            int64_t i = 0;
            for (; i + 4 <= steps; i += 4) {
#if PIPE_Q4_PREFETCH
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char *)(pg + (i + l) * 64 + PIPE_Q4_PREFETCH), _MM_HINT_T1);
#endif
                PIPE_Q4_STEP(a0, a1, i);
                PIPE_Q4_STEP(a2, a3, i + 1);
                PIPE_Q4_STEP(a0, a1, i + 2);
                PIPE_Q4_STEP(a2, a3, i + 3);
            }
            for (; i < steps; i++) PIPE_Q4_STEP(a0, a1, i);
#undef PIPE_Q4_STEP
            __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a0, a2),
                                           _mm512_srai_epi32(_mm512_add_epi32(a1, a3), 4));
            sum = _mm512_sub_epi32(sum, _mm512_mullo_epi32(z, _mm512_set1_epi32(a->xsum[m0 * a->G + g])));
            facc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, facc[0]);
            continue;
        }
        __m512i acc[8];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int64_t i = 0; i < steps; i++) {
            const __m512i w = _mm512_loadu_si512(pg + i * 64);
            const __m512i lo = _mm512_and_si512(w, mask);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = a->xq + (m0 + r) * Kp + g * a->gs + i * 8;
                acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(pipe_q4_x4(xr)));
                acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(pipe_q4_x4(xr + 4)));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512i sum = _mm512_sub_epi32(acc[r], _mm512_mullo_epi32(
                z, _mm512_set1_epi32(a->xsum[(m0 + r) * a->G + g])));
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, facc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], facc[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
static void pipe_q4_blocks_avx512(const pipe_q4_args *a, int64_t b0, int64_t b1) {
    float out[8][PIPE_Q4_BLOCK];
    const int64_t bbytes = a->G * a->gs / 8 * 64;
    for (int64_t b = b0; b < b1; b++) {
        /* Many rows reuse each block from L1 long enough to fetch the next one meanwhile (as
         * the int8 kernel does; batch 1 prefetches within its loop instead). */
        if (PIPE_Q4_NEXT_BLOCK && a->M >= 8 && b + 1 < b1)
            for (int64_t off = 0; off < bbytes; off += 64)
                _mm_prefetch((const char *)(a->P + (b + 1) * bbytes + off), _MM_HINT_T1);
        int64_t m0 = 0;
        for (; m0 + 8 <= a->M; m0 += 8) {
            pipe_q4_group_avx512(8, m0, b, a, out);
            for (int r = 0; r < 8; r++) pipe_q4_store(a, out[r], m0 + r, b);
        }
        for (; m0 + 4 <= a->M; m0 += 4) {
            pipe_q4_group_avx512(4, m0, b, a, out);
            for (int r = 0; r < 4; r++) pipe_q4_store(a, out[r], m0 + r, b);
        }
        for (; m0 < a->M; m0++) {
            pipe_q4_group_avx512(1, m0, b, a, out);
            pipe_q4_store(a, out[0], m0, b);
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline))
void pipe_q4_group_avx2(const int R, int64_t m0, int64_t b, const pipe_q4_args *a,
                        float (*out)[PIPE_Q4_BLOCK]) {
    /* VPMADDUBSW: nibble (unsigned) times x (signed) pairs into int16, at most 2 * 15 * 127,
     * then VPMADDWD by ones into int32: no saturation, the same sums as VPDPBUSD. */
    const int64_t steps = a->gs / 8, Kp = a->G * a->gs;
    const uint8_t *pb = a->P + b * a->G * steps * 64;
    const uint16_t *sb = a->S + b * a->G * PIPE_Q4_BLOCK;
    const uint8_t *zb = a->Z ? a->Z + b * a->G * PIPE_Q4_BLOCK : NULL;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 flo[4], fhi[4];
    for (int r = 0; r < R; r++) flo[r] = fhi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->G; g++) {
        const uint8_t *pg = pb + g * steps * 64;
        __m256i zlo = _mm256_set1_epi32(8), zhi = zlo;
        if (zb) {
            zlo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zb + g * 16)));
            zhi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zb + g * 16 + 8)));
        }
        const __m256 slo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + g * 16)));
        const __m256 shi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + g * 16 + 8)));
        __m256i lo[4], hi[4];
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int64_t i = 0; i < steps; i++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pg + i * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pg + i * 64 + 32));
            const __m256i l0 = _mm256_and_si256(w0, mask), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), mask);
            const __m256i l1 = _mm256_and_si256(w1, mask), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), mask);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = a->xq + (m0 + r) * Kp + g * a->gs + i * 8;
                const __m256i xl = _mm256_set1_epi32(pipe_q4_x4(xr)), xh = _mm256_set1_epi32(pipe_q4_x4(xr + 4));
                lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh)), ones));
                hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh)), ones));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i xs = _mm256_set1_epi32(a->xsum[(m0 + r) * a->G + g]);
            const __m256i sl = _mm256_sub_epi32(lo[r], _mm256_mullo_epi32(zlo, xs));
            const __m256i sh = _mm256_sub_epi32(hi[r], _mm256_mullo_epi32(zhi, xs));
            flo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), slo, flo[r]);
            fhi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), shi, fhi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], flo[r]);
        _mm256_storeu_ps(out[r] + 8, fhi[r]);
    }
}

/* One row (decode at batch 1) over four blocks at once: four weight streams in flight and
 * four independent integer sums (one block at a time read a 151936 x 896 lm_head at 8.3 GB/s
 * on one Zen 3 core, four at 10.4). Each block's sums and scaling as in the group above. */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline))
void pipe_q4_quad_avx2(int64_t b, const pipe_q4_args *a, float (*out)[PIPE_Q4_BLOCK]) {
    const int64_t steps = a->gs / 8, bs = a->G * steps * 64;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 flo[4], fhi[4];
    for (int j = 0; j < 4; j++) flo[j] = fhi[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->G; g++) {
        __m256i lo[4], hi[4];
        for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_si256();
        for (int64_t i = 0; i < steps; i++) {
            const int8_t *xr = a->xq + g * a->gs + i * 8; /* row 0 */
            const __m256i xl = _mm256_set1_epi32(pipe_q4_x4(xr)), xh = _mm256_set1_epi32(pipe_q4_x4(xr + 4));
#if PIPE_Q4_PREFETCH
            /* Each block is a few KB: the hardware prefetcher retrains at every block and
             * page, so each stream's line PIPE_Q4_PREFETCH ahead is asked for by hand (past
             * a block's end: the same place in the next quad's block). */
            const int64_t ahead = (g * steps + i) * 64 + PIPE_Q4_PREFETCH;
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(a->P + (ahead < bs ? (b + j) * bs + ahead
                                                                : (b + j + 4) * bs + ahead - bs)),
                             _MM_HINT_T1);
#endif
            for (int j = 0; j < 4; j++) {
                const uint8_t *pg = a->P + (b + j) * bs + (g * steps + i) * 64;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)pg);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pg + 32));
                lo[j] = _mm256_add_epi32(lo[j], _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(w0, mask), xl),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w0, 4), mask), xh)), ones));
                hi[j] = _mm256_add_epi32(hi[j], _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(w1, mask), xl),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w1, 4), mask), xh)), ones));
            }
        }
        const __m256i xs = _mm256_set1_epi32(a->xsum[g]);
        for (int j = 0; j < 4; j++) {
            const uint16_t *sb = a->S + ((b + j) * a->G + g) * PIPE_Q4_BLOCK;
            __m256i zlo = _mm256_set1_epi32(8), zhi = zlo;
            if (a->Z) {
                const uint8_t *zb = a->Z + ((b + j) * a->G + g) * PIPE_Q4_BLOCK;
                zlo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)zb));
                zhi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zb + 8)));
            }
            const __m256i sl = _mm256_sub_epi32(lo[j], _mm256_mullo_epi32(zlo, xs));
            const __m256i sh = _mm256_sub_epi32(hi[j], _mm256_mullo_epi32(zhi, xs));
            flo[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb)), flo[j]);
            fhi[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 8))), fhi[j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(out[j], flo[j]);
        _mm256_storeu_ps(out[j] + 8, fhi[j]);
    }
}

__attribute__((target("avx2,fma,f16c")))
static void pipe_q4_blocks_avx2(const pipe_q4_args *a, int64_t b0, int64_t b1) {
    float out[4][PIPE_Q4_BLOCK];
    int64_t b = b0;
    if (a->M == 1)
        for (; b + 4 <= b1; b += 4) {
            pipe_q4_quad_avx2(b, a, out);
            for (int j = 0; j < 4; j++) pipe_q4_store(a, out[j], 0, b + j);
        }
    const int64_t mc = pipe_i8_panel_rows(a->M, a->G * a->gs);
    for (int64_t mp = 0; mp < a->M; mp += mc) {
        const int64_t me = mp + mc < a->M ? mp + mc : a->M;
        for (int64_t bb = b; bb < b1; bb++) {
            int64_t m0 = mp;
            for (; m0 + 4 <= me; m0 += 4) {
                pipe_q4_group_avx2(4, m0, bb, a, out);
                for (int r = 0; r < 4; r++) pipe_q4_store(a, out[r], m0 + r, bb);
            }
            for (; m0 < me; m0++) {
                pipe_q4_group_avx2(1, m0, bb, a, out);
                pipe_q4_store(a, out[0], m0, bb);
            }
        }
    }
}

static void pipe_q4_blocks_portable(const pipe_q4_args *a, int64_t b0, int64_t b1) {
    const int64_t steps = a->gs / 8, Kp = a->G * a->gs;
    float acc[PIPE_Q4_BLOCK];
    int32_t sums[PIPE_Q4_BLOCK];
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *pb = a->P + b * a->G * steps * 64;
        const uint16_t *sb = a->S + b * a->G * PIPE_Q4_BLOCK;
        const uint8_t *zb = a->Z ? a->Z + b * a->G * PIPE_Q4_BLOCK : NULL;
        for (int64_t m = 0; m < a->M; m++) {
            for (int j = 0; j < PIPE_Q4_BLOCK; j++) acc[j] = 0.0f;
            for (int64_t g = 0; g < a->G; g++) {
                const int8_t *xr = a->xq + m * Kp + g * a->gs;
                memset(sums, 0, sizeof sums);
                for (int64_t i = 0; i < steps; i++)
                    for (int j = 0; j < PIPE_Q4_BLOCK; j++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t v = pb[(g * steps + i) * 64 + j * 4 + t];
                            sums[j] += (int32_t)(v & 15) * xr[i * 8 + t]
                                       + (int32_t)(v >> 4) * xr[i * 8 + 4 + t];
                        }
                const int32_t xg = a->xsum[m * a->G + g];
                for (int j = 0; j < PIPE_Q4_BLOCK; j++) {
                    const int32_t z = zb ? zb[g * 16 + j] : 8;
                    acc[j] = fmaf((float)(sums[j] - z * xg), pipe_f16_to_f32(sb[g * 16 + j]), acc[j]);
                }
            }
            pipe_q4_store(a, acc, m, b);
        }
    }
}

static int pipe_q4_level(void) { return pipe_lp_level(1); }

/* Rows up to which this GEMV runs where the caller has a better GEMM for a dequantised copy
 * (AMX, or BLAS beside VNNI); on a core with AVX2 alone it runs any number: there a float32
 * copy for BLAS at every call took 1.5x (512-2048 rows) to 5x (33 rows) the GEMV's time for
 * one 0.5B layer (docs/cpu.md "AVX2 only"). 1: the GEMV, 0: the caller's dequantised GEMM. */
#define PIPE_Q4_GEMV_MAX_M 32
static int pipe_linear_q4_route(int64_t M) {
    return M <= PIPE_Q4_GEMV_MAX_M || pipe_q4_level() == PIPE_ISA_AVX2;
}

/* P, S, Z as above for NB = ceil(N / 16) blocks and G = ceil(K / gs) groups (gs a multiple
 * of 8); perm: NULL, or K input indices (row k of the packed weight multiplies x[perm[k]]).
 * Returns -1 without scratch memory. */
static int pipeline_cpu_gemv_q4(float *y, int64_t ldy, const float *x, int64_t ldx,
                                const uint8_t *P, const uint16_t *S, const uint8_t *Z,
                                const int32_t *perm, const float *bias, int64_t M, int64_t K,
                                int64_t N, int64_t gs) {
    if (M <= 0 || N <= 0) return 0;
    const int level = pipe_q4_level();
    const int64_t G = (K + gs - 1) / gs, Kp = G * gs, NB = (N + PIPE_Q4_BLOCK - 1) / PIPE_Q4_BLOCK;
    const size_t xbytes = ((size_t)(M * Kp) + 63) / 64 * 64;
    const size_t gbytes = perm ? (size_t)K * 4 : 0;
    char *buf = (char *)pipe_lp_buffer(xbytes + (size_t)M * (4 + 4 * G) + gbytes);
    if (buf == NULL) return -1;
    int8_t *xq = (int8_t *)buf;
    float *xs = (float *)(buf + xbytes);
    int32_t *xsum = (int32_t *)(xs + M);
    float *gather = (float *)(xsum + M * G);
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        if (perm) {
            for (int64_t k = 0; k < K; k++) gather[k] = row[perm[k]];
            row = gather;
        }
        int8_t *q = xq + m * Kp;
        xs[m] = pipe_quantize_row(row, K, Kp / 4, q);
        for (int64_t g = 0; g < G; g++) {
            int32_t t = 0;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) t += q[k];
            xsum[m * G + g] = t;
        }
    }
    const pipe_q4_args a = {P, S, Z, xq, xs, xsum, bias, y, ldy, M, N, G, gs};
    const int par = NB * PIPE_Q4_BLOCK * Kp / 2 * (M > 8 ? 8 : 1) >= PIPE_LP_PAR_MIN_BYTES
                    && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = NB * t / nt, b1 = NB * (t + 1) / nt;
        if (level == PIPE_ISA_AVX512)
            pipe_q4_blocks_avx512(&a, b0, b1);
        else if (level == PIPE_ISA_AVX2)
            pipe_q4_blocks_avx2(&a, b0, b1);
        else
            pipe_q4_blocks_portable(&a, b0, b1);
    }
    return 0;
}

/* Output channel n of P, S, Z as float32 in packed input order (row [G * gs]). */
static void pipe_q4_channel(float *row, const uint8_t *P, const uint16_t *S, const uint8_t *Z,
                            int64_t n, int64_t G, int64_t gs) {
    const int64_t steps = gs / 8, b = n / PIPE_Q4_BLOCK, j = n % PIPE_Q4_BLOCK;
    const uint8_t *pb = P + b * G * steps * 64;
    for (int64_t g = 0; g < G; g++) {
        const float s = pipe_f16_to_f32(S[(b * G + g) * 16 + j]);
        const float z = Z ? (float)Z[(b * G + g) * 16 + j] : 8.0f;
        for (int64_t i = 0; i < steps; i++)
            for (int t = 0; t < 4; t++) {
                const uint8_t v = pb[(g * steps + i) * 64 + j * 4 + t];
                row[g * gs + i * 8 + t] = ((float)(v & 15) - z) * s;
                row[g * gs + i * 8 + 4 + t] = ((float)(v >> 4) - z) * s;
            }
    }
}

/* D [R, K] = channels rows[0..R) of W = s * (q - z) (P, S, Z as above, N output channels),
 * as bf16 (PIPE_BF16) or float32 (PIPE_F32); rows NULL: all N in order (R = N). With perm,
 * packed input k goes to column perm[k] (the checkpoint's order). The embedding lookup of
 * an int4 table takes the rows of its token ids. Returns the index of a row outside
 * [0, N), or -1. */
static int64_t pipeline_cpu_dequant_q4(void *D, int dtype, const uint8_t *P, const uint16_t *S,
                                       const uint8_t *Z, const int32_t *perm, int64_t N,
                                       int64_t K, int64_t gs, const int64_t *rows, int64_t R) {
    if (rows == NULL) R = N;
    for (int64_t r = 0; rows != NULL && r < R; r++)
        if (rows[r] < 0 || rows[r] >= N) return r;
    const int64_t G = (K + gs - 1) / gs;
    #pragma omp parallel if (R * K / 2 >= PIPE_GEMV_PAR_MIN_BYTES)
    {
        float row[G * gs]; /* one output channel, widened, in packed order */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            pipe_q4_channel(row, P, S, Z, rows ? rows[r] : r, G, gs);
            if (dtype == PIPE_F32) {
                float *d = (float *)D + r * K;
                if (perm) for (int64_t k = 0; k < K; k++) d[perm[k]] = row[k];
                else memcpy(d, row, (size_t)K * 4);
            } else {
                uint16_t *d = (uint16_t *)D + r * K;
                if (perm) for (int64_t k = 0; k < K; k++) d[perm[k]] = pipe_f32_to_bf16(row[k]);
                else for (int64_t k = 0; k < K; k++) d[k] = pipe_f32_to_bf16(row[k]);
            }
        }
    }
    return -1;
}

#endif
