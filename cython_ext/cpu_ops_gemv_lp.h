/* Worker stage, CPU ops: matrix products with bfloat16 weights, float32 activations, and the
 * run-time instruction-set dispatch they share with the int8 and AMX ones (cpu_ops_gemv_i8.h,
 * cpu_ops_amx.h).
 *
 *   pipeline_cpu_gemv_bf16: y [M, N] = x [M, K] @ W^T (+ bias), W bfloat16 packed
 *
 * W is packed in blocks of 16 outputs x 2 inputs per 64 bytes, P[N/16][Kp/2][16][2] (Kp = K
 * rounded up to 32, N to 16, padding zero): the VNNI layout of an AMX B tile, so the AMX GEMM,
 * this kernel and the embedding lookup read the one copy. One block is one contiguous stream
 * and its 16 sums stay in the 16 lanes of a register (no horizontal reduction). At small M a
 * step is bound by reading W, which this streams once: with AVX-512 BF16 the rows of x are
 * rounded to bf16 once and each 64-byte line takes one VDPBF16PS per row (rows in groups of up
 * to 8 reuse the line from L1, so it also serves any M where AMX is absent); on AVX2 a line is
 * widened in registers (a shift and a mask) and multiplied with float32 x, and a prefill's rows
 * go in panels of x kept in L2 with the weights widened once per panel (pipe_bf16_panels_avx2).
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

enum { PIPE_ISA_PORTABLE = 0, PIPE_ISA_AVX2 = 1, PIPE_ISA_AVX512 = 2, PIPE_ISA_AMX = 3 };
/* Weight bytes from which the bf16/int8 GEMVs use every thread; lower than the float32
 * GEMV's since a 2- or 1-byte weight is read in a half or a quarter of the time. Tunable
 * (PIPE_LP_PAR_MIN_BYTES) for the measurement in docs/cpu.md. */
#ifndef PIPE_LP_PAR_MIN_BYTES
#define PIPE_LP_PAR_MIN_BYTES (1 << 17)
#endif
static int pipe_isa_cap = PIPE_ISA_AMX;

/* The best vector level (not AMX: cpu_ops_amx.h) the CPU has for kernel `kind` (0: bf16,
 * 1: int8), capped. */
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

#define PIPE_BF16_KALIGN 32 /* Kp: K rounded up to this (an AMX tile's depth in bf16) */
#ifndef PIPE_BF16_PF
#define PIPE_BF16_PF 1024 /* bytes ahead the one-row GEMV prefetches its block */
#endif

static inline int64_t pipe_bf16_kp(int64_t K) {
    return (K + PIPE_BF16_KALIGN - 1) / PIPE_BF16_KALIGN * PIPE_BF16_KALIGN;
}

/* 16 floats to y (lanes in mask k); nt: a whole aligned line (k full, y 64-byte aligned),
 * written around the caches (a product's output larger than they are, cpu_ops_amx.h). */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline void pipe_store16(float *y, __mmask16 k, __m512 v, int nt) {
    if (nt && k == (__mmask16)0xffff) _mm512_stream_ps(y, v);
    else _mm512_mask_storeu_ps(y, k, v);
}

/* Block b's 16 sums (lanes) of row m into y, plus bias, the lanes < N only. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline void pipe_bf16_store16(float *y, int64_t ldy, __m512 acc, int64_t m, int64_t b,
                                     int64_t N, const float *bias, int nt) {
    const int64_t n0 = b * 16;
    const __mmask16 k = N - n0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
    if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(k, bias + n0));
    pipe_store16(y + m * ldy + n0, k, acc, nt);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline __attribute__((always_inline))
void pipe_bf16_group_avx512(const int R, int64_t m0, const uint16_t *pb, const uint16_t *xb,
                            int64_t Kp, __m512 *acc) {
    /* pb: one block, Kp/2 lines of 64 bytes (16 outputs x 2 inputs); xb: rows of Kp bf16, a
     * pair of inputs broadcast per line. */
    const int64_t K2 = Kp / 2;
    if (R == 1) { /* four chains, or each line waits for the previous VDPBF16PS */
        const uint32_t *xr = (const uint32_t *)(xb + m0 * Kp);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k2 = 0; k2 < K2; k2 += 4) { /* K2 is a multiple of 16 */
            /* the 256 bytes PIPE_BF16_PF ahead, past the ends of 4 KB pages where the
             * hardware prefetcher stops (into the next block at the end: it comes next) */
            const char *pf = (const char *)(pb + k2 * 32) + PIPE_BF16_PF;
            _mm_prefetch(pf, _MM_HINT_T0);
            _mm_prefetch(pf + 64, _MM_HINT_T0);
            _mm_prefetch(pf + 128, _MM_HINT_T0);
            _mm_prefetch(pf + 192, _MM_HINT_T0);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(pb + k2 * 32), (__m512bh)_mm512_set1_epi32((int)xr[k2]));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(pb + k2 * 32 + 32), (__m512bh)_mm512_set1_epi32((int)xr[k2 + 1]));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(pb + k2 * 32 + 64), (__m512bh)_mm512_set1_epi32((int)xr[k2 + 2]));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(pb + k2 * 32 + 96), (__m512bh)_mm512_set1_epi32((int)xr[k2 + 3]));
        }
        acc[0] = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        return;
    }
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; k2++) {
        if (R < 8) _mm_prefetch((const char *)(pb + k2 * 32) + PIPE_BF16_PF, _MM_HINT_T0);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(pb + k2 * 32);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32(
                (int)((const uint32_t *)(xb + (m0 + r) * Kp))[k2]));
    }
}

/* One or two rows (decode at batch 1-2) over four blocks at once: four streams, each line
 * taking one VDPBF16PS per row with x's pair broadcast once for the four, and the next four
 * blocks' lines prefetched at the same depth (8 streams in flight: one stream with prefetch
 * ahead read its weights ~15 % slower from DRAM). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline __attribute__((always_inline))
void pipe_bf16_quad_avx512(const int R, float *y, int64_t ldy, const uint16_t *pb,
                           const uint16_t *xb, const float *bias, int64_t Kp, int64_t N,
                           int64_t b, int prefetch) {
    const int64_t K2 = Kp / 2, bs = 16 * Kp; /* bs: elements per block */
    __m512 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; k2++) {
        if (prefetch)
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(pb + (4 + j) * bs + k2 * 32), _MM_HINT_T0);
        __m512bh xv[2];
        for (int r = 0; r < R; r++)
            xv[r] = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(xb + r * Kp))[k2]);
        for (int j = 0; j < 4; j++) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(pb + j * bs + k2 * 32);
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w, xv[r]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) pipe_bf16_store16(y, ldy, acc[r][j], r, b + j, N, bias, 0);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void pipe_bf16_blocks_avx512(float *y, int64_t ldy, const uint16_t *xb, const uint16_t *W,
                                    const float *bias, int64_t M, int64_t Kp, int64_t N,
                                    int64_t b0, int64_t b1) {
    __m512 acc[8];
    if (M <= 2) { /* four blocks at a time, then the rest one by one */
        for (; b0 + 4 <= b1; b0 += 4) {
            const int pf = b0 + 8 <= b1;
            if (M == 1) pipe_bf16_quad_avx512(1, y, ldy, W + b0 * 16 * Kp, xb, bias, Kp, N, b0, pf);
            else pipe_bf16_quad_avx512(2, y, ldy, W + b0 * 16 * Kp, xb, bias, Kp, N, b0, pf);
        }
    }
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *pb = W + b * 16 * Kp;
        if (M >= 8 && b + 1 < b1) /* many rows: fetch the next block while this one is reused */
            for (int64_t off = 0; off < 16 * Kp; off += 32)
                _mm_prefetch((const char *)(pb + 16 * Kp + off), _MM_HINT_T1);
        int64_t m0 = 0;
        for (; m0 + 8 <= M; m0 += 8) {
            pipe_bf16_group_avx512(8, m0, pb, xb, Kp, acc);
            for (int r = 0; r < 8; r++) pipe_bf16_store16(y, ldy, acc[r], m0 + r, b, N, bias, 0);
        }
        for (; m0 + 4 <= M; m0 += 4) {
            pipe_bf16_group_avx512(4, m0, pb, xb, Kp, acc);
            for (int r = 0; r < 4; r++) pipe_bf16_store16(y, ldy, acc[r], m0 + r, b, N, bias, 0);
        }
        for (; m0 + 2 <= M; m0 += 2) {
            pipe_bf16_group_avx512(2, m0, pb, xb, Kp, acc);
            for (int r = 0; r < 2; r++) pipe_bf16_store16(y, ldy, acc[r], m0 + r, b, N, bias, 0);
        }
        for (; m0 < M; m0++) {
            pipe_bf16_group_avx512(1, m0, pb, xb, Kp, acc);
            pipe_bf16_store16(y, ldy, acc[0], m0, b, N, bias, 0);
        }
    }
}

__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_bf16_group_avx2(const int R, int64_t m0, const uint16_t *pb, const float *x, int64_t ldx,
                          int64_t K, __m256 (*acc)[2]) {
    /* A line's 32-bit lane j holds outputs j's inputs k (low half) and k + 1 (high half):
     * masking the low half off makes 8 float32 of the odd inputs; the even ones come from
     * the same mask over a load 2 bytes earlier, which puts each lane's low half on top
     * (a shift would take a slot of the FMA ports: 1 thread, 32 x 2048 x 896 from L1, 0.84
     * -> 0.88 of the FMA peak). The first pair of a block, with nothing before it, shifts. */
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[4][2]; /* locals: a loop over acc itself kept it in memory */
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
#define PIPE_BF16_GROUP_STEP(E0, E1)                                                        \
        for (int r = 0; r < R; r++) {                                                       \
            const float *xr = x + (m0 + r) * ldx;                                           \
            const __m256 xe = _mm256_broadcast_ss(xr + k);                                  \
            const __m256 xo = k + 1 < K ? _mm256_broadcast_ss(xr + k + 1) : _mm256_setzero_ps(); \
            a[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(E0, xe, a[r][0]));            \
            a[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(E1, xe, a[r][1]));            \
        }
    {
        const int64_t k = 0;
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)pb);
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pb + 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        PIPE_BF16_GROUP_STEP(e0, e1)
    }
    for (int64_t k = 2; k < K; k += 2) {
        const uint16_t *p = pb + k * 16;
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), hi));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16)), hi));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p - 1)), hi));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 15)), hi));
        PIPE_BF16_GROUP_STEP(e0, e1)
    }
#undef PIPE_BF16_GROUP_STEP
    for (int r = 0; r < R; r++) acc[r][0] = a[r][0], acc[r][1] = a[r][1];
}

/* One row (decode at batch 1) over four blocks at once: 8 accumulators, so the two FMAs per
 * line and accumulator do not wait on each other (one block's 2 chains of 2 FMAs held a
 * 1-thread 9728 x 896 product at 12 GFLOP/s, four at 17), and four streams in flight. Each
 * output's products add in the same order as in the group above (evens, then odds of a pair),
 * so a row gives the same floats alone as in a batch. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_bf16_quad_avx2(const uint16_t *pb, int64_t bs, const float *x, int64_t K,
                         __m256 (*acc)[2]) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[4][2]; /* locals: a loop over acc itself kept it in memory */
    for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const __m256 xe = _mm256_broadcast_ss(x + k);
        const __m256 xo = k + 1 < K ? _mm256_broadcast_ss(x + k + 1) : _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pb + j * bs + k * 16));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pb + j * bs + k * 16 + 16));
            a[j][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), xe, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), xe, a[j][1]);
        }
        for (int j = 0; j < 4; j++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pb + j * bs + k * 16));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pb + j * bs + k * 16 + 16));
            a[j][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, hi)), xo, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, hi)), xo, a[j][1]);
        }
    }
    for (int j = 0; j < 4; j++) acc[j][0] = a[j][0], acc[j][1] = a[j][1];
}

/* y rows [m0, m0 + R) of block b from the group's sums, plus the bias. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_bf16_store_avx2(float *y, int64_t ldy, __m256 (*acc)[2], int R, int64_t m0, int64_t b,
                          int64_t N, const float *bias) {
    float out[16];
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        for (int64_t j = 0; j < 16 && b * 16 + j < N; j++)
            y[(m0 + r) * ldy + b * 16 + j] = out[j] + (bias ? bias[b * 16 + j] : 0.0f);
    }
}

/* The last 1-3 rows of a batch as one group: each accumulator's FMAs wait on each other, so
 * a group of r rows keeps r/4 of the FMA ports busy (a row at a time, 1/4: a batch of 31 cost
 * as much as 40). Not inlined: a copy of the group for every r beside the 4-row loop slowed
 * that loop (code placement; 1 thread, 32 rows: 0.96 -> 0.88 of the FMA peak). */
__attribute__((target("avx2,fma"), noinline))
static void pipe_bf16_rest_avx2(float *y, int64_t ldy, const float *x, int64_t ldx,
                                const uint16_t *pb, const float *bias, int R, int64_t m0,
                                int64_t K, int64_t N, int64_t b) {
    __m256 acc[4][2];
    if (R == 3) pipe_bf16_group_avx2(3, m0, pb, x, ldx, K, acc);
    else if (R == 2) pipe_bf16_group_avx2(2, m0, pb, x, ldx, K, acc);
    else pipe_bf16_group_avx2(1, m0, pb, x, ldx, K, acc);
    pipe_bf16_store_avx2(y, ldy, acc, R, m0, b, N, bias);
}

/* A prefill's rows in panels of x that stay in L2, each panel in chunks of K (its x is
 * megabytes: read again for every block of 16 outputs it came from L3 or DRAM, 0.8x BLAS at
 * 2048 rows). A chunk of a block's weights is widened to float32 once for the panel's rows
 * (16 x KC x 4 bytes, in L1), so the product is FMAs and loads alone: 6 rows x 16 outputs, 12
 * sums in registers. 2 threads, 2048 x 896 -> 4864: 55-57 -> 66-68 GFLOP/s (FMA peak 80);
 * below PANEL_ROWS the widening costs more than it saves (16 x 4864 -> 896: 67 -> 51). */
#ifndef PIPE_BF16_MC
#define PIPE_BF16_MC 120 /* rows per panel */
#endif
#ifndef PIPE_BF16_KC
#define PIPE_BF16_KC 256 /* inputs per chunk (even) */
#endif
#ifndef PIPE_BF16_PANEL_ROWS
#define PIPE_BF16_PANEL_ROWS 64 /* rows from which x ... */
#endif
#ifndef PIPE_BF16_PANEL_BYTES
#define PIPE_BF16_PANEL_BYTES (1 << 20) /* ... of more bytes than this goes in panels */
#endif

/* Inputs [k0, k1) of block pb (k1 even) widened: wf[(k - k0) * 16 + j] = output j's input k. */
__attribute__((target("avx2,fma"))) static inline
void pipe_bf16_widen_avx2(float *wf, const uint16_t *pb, int64_t k0, int64_t k1) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t k = k0; k < k1; k += 2) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pb + k * 16));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pb + k * 16 + 16));
        float *w = wf + (k - k0) * 16;
        _mm256_store_ps(w, _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)));
        _mm256_store_ps(w + 8, _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)));
        _mm256_store_ps(w + 16, _mm256_castsi256_ps(_mm256_and_si256(v0, hi)));
        _mm256_store_ps(w + 24, _mm256_castsi256_ps(_mm256_and_si256(v1, hi)));
    }
}

/* Rows [m0, m0 + R) of block b over inputs [k0, k1) with the widened chunk wf. The sums add
 * in the group's order (input by input), and an odd K's padding input adds its 0 x 0 as the
 * group does: the floats of the unchunked product. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_bf16_panel_rows_avx2(const int R, float *y, int64_t ldy, const float *x, int64_t ldx,
                               const float *wf, const float *bias, int64_t m0, int64_t K,
                               int64_t k0, int64_t k1, int64_t N, int64_t b, float *carry) {
    __m256 a[6][2];
    float *c = b * 16 + 16 <= N ? y + m0 * ldy + b * 16 : carry;
    const int64_t ldc = c == carry ? 16 : ldy;
    for (int r = 0; r < R; r++) {
        a[r][0] = k0 ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
        a[r][1] = k0 ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
    }
    const float *xr = x + m0 * ldx;
    const int64_t ke = k1 < K ? k1 : K;
    for (int64_t k = k0; k < ke; k++) {
        const __m256 w0 = _mm256_load_ps(wf + (k - k0) * 16), w1 = _mm256_load_ps(wf + (k - k0) * 16 + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);
        }
    }
    if (ke < k1) { /* odd K */
        const __m256 w0 = _mm256_load_ps(wf + (ke - k0) * 16), w1 = _mm256_load_ps(wf + (ke - k0) * 16 + 8);
        for (int r = 0; r < R; r++) {
            a[r][0] = _mm256_fmadd_ps(w0, _mm256_setzero_ps(), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, _mm256_setzero_ps(), a[r][1]);
        }
    }
    if (k1 >= K) {
        __m256 acc[6][2]; /* a's address unused: kept in registers through the loop */
        for (int r = 0; r < R; r++) acc[r][0] = a[r][0], acc[r][1] = a[r][1];
        pipe_bf16_store_avx2(y, ldy, acc, R, m0, b, N, bias);
        return;
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(c + r * ldc, a[r][0]);
        _mm256_storeu_ps(c + r * ldc + 8, a[r][1]);
    }
}

__attribute__((target("avx2,fma"), noinline))
static void pipe_bf16_panel_rest_avx2(int R, float *y, int64_t ldy, const float *x, int64_t ldx,
                                      const float *wf, const float *bias, int64_t m0, int64_t K,
                                      int64_t k0, int64_t k1, int64_t N, int64_t b, float *carry) {
    switch (R) {
    case 5: pipe_bf16_panel_rows_avx2(5, y, ldy, x, ldx, wf, bias, m0, K, k0, k1, N, b, carry); break;
    case 4: pipe_bf16_panel_rows_avx2(4, y, ldy, x, ldx, wf, bias, m0, K, k0, k1, N, b, carry); break;
    case 3: pipe_bf16_panel_rows_avx2(3, y, ldy, x, ldx, wf, bias, m0, K, k0, k1, N, b, carry); break;
    case 2: pipe_bf16_panel_rows_avx2(2, y, ldy, x, ldx, wf, bias, m0, K, k0, k1, N, b, carry); break;
    default: pipe_bf16_panel_rows_avx2(1, y, ldy, x, ldx, wf, bias, m0, K, k0, k1, N, b, carry);
    }
}

/* Blocks [b0, b1) of a prefill. */
__attribute__((target("avx2,fma")))
static void pipe_bf16_panels_avx2(float *y, int64_t ldy, const float *x, int64_t ldx,
                                  const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                  int64_t Kp, int64_t N, int64_t b0, int64_t b1) {
    float wf[PIPE_BF16_KC * 16] __attribute__((aligned(32)));
    float carry[PIPE_BF16_MC][16]; /* the sums of a block cut by N between chunks */
    for (int64_t mp = 0; mp < M; mp += PIPE_BF16_MC) {
        const int64_t me = mp + PIPE_BF16_MC < M ? mp + PIPE_BF16_MC : M;
        for (int64_t k0 = 0; k0 < K; k0 += PIPE_BF16_KC) {
            /* k1: even (an odd K's padding input is the last of its pair) */
            const int64_t k1 = k0 + PIPE_BF16_KC < K ? k0 + PIPE_BF16_KC : (K + 1) / 2 * 2;
            for (int64_t b = b0; b < b1; b++) {
                pipe_bf16_widen_avx2(wf, W + b * 16 * Kp, k0, k1);
                int64_t m0 = mp;
                for (; me - m0 >= 6; m0 += 6)
                    pipe_bf16_panel_rows_avx2(6, y, ldy, x, ldx, wf, bias, m0, K, k0, k1, N, b, carry[m0 - mp]);
                if (m0 < me)
                    pipe_bf16_panel_rest_avx2((int)(me - m0), y, ldy, x, ldx, wf, bias, m0, K, k0,
                                              k1, N, b, carry[m0 - mp]);
            }
        }
    }
}

__attribute__((target("avx2,fma")))
static void pipe_bf16_blocks_avx2(float *y, int64_t ldy, const float *x, int64_t ldx,
                                  const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                  int64_t Kp, int64_t N, int64_t b0, int64_t b1) {
    if (M >= PIPE_BF16_PANEL_ROWS && M * K * 4 > PIPE_BF16_PANEL_BYTES) {
        pipe_bf16_panels_avx2(y, ldy, x, ldx, W, bias, M, K, Kp, N, b0, b1);
        return;
    }
    __m256 acc[4][2];
    int64_t b = b0;
    if (M == 1)
        for (; b + 4 <= b1; b += 4) {
            pipe_bf16_quad_avx2(W + b * 16 * Kp, 16 * Kp, x, K, acc);
            for (int j = 0; j < 4; j++) pipe_bf16_store_avx2(y, ldy, &acc[j], 1, 0, b + j, N, bias);
        }
    for (; b < b1; b++) {
        const uint16_t *pb = W + b * 16 * Kp;
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) {
            pipe_bf16_group_avx2(4, m0, pb, x, ldx, K, acc);
            pipe_bf16_store_avx2(y, ldy, acc, 4, m0, b, N, bias);
        }
        if (m0 < M) pipe_bf16_rest_avx2(y, ldy, x, ldx, pb, bias, (int)(M - m0), m0, K, N, b);
    }
}

static void pipe_bf16_blocks_portable(float *y, int64_t ldy, const float *x, int64_t ldx,
                                      const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                      int64_t Kp, int64_t N, int64_t b0, int64_t b1) {
    float s[16];
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *pb = W + b * 16 * Kp;
        for (int64_t m = 0; m < M; m++) {
            memset(s, 0, sizeof s);
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < 16; j++)
                    s[j] += x[m * ldx + k] * pipe_bf16_to_f32(pb[(k / 2) * 32 + j * 2 + (k & 1)]);
            for (int64_t j = 0; j < 16 && b * 16 + j < N; j++)
                y[m * ldy + b * 16 + j] = s[j] + (bias ? bias[b * 16 + j] : 0.0f);
        }
    }
}

/* The level the bf16 kernel uses (the packed layout has no alignment needs; K is kept for
 * the interface). */
static int pipe_bf16_level(int64_t K) {
    (void)K;
    return pipe_lp_level(0);
}

/* x rounded to bf16 into rows of Kp (zero past K), M*Kp*2 bytes. */
static void pipe_bf16_round_rows(uint16_t *xb, const float *x, int64_t ldx, int64_t M,
                                 int64_t K, int64_t Kp) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) xb[m * Kp + k] = pipe_f32_to_bf16(x[m * ldx + k]);
        for (int64_t k = K; k < Kp; k++) xb[m * Kp + k] = 0;
    }
}

/* W packed as above. Returns -1 without scratch memory. */
static int pipeline_cpu_gemv_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                  const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                  int64_t N) {
    if (M <= 0 || N <= 0) return 0;
    const int level = pipe_bf16_level(K);
    const int64_t Kp = pipe_bf16_kp(K), NB = (N + 15) / 16;
    uint16_t *xb = NULL;
    if (level == PIPE_ISA_AVX512) { /* x rounded to bf16 once */
        xb = (uint16_t *)pipe_lp_buffer((size_t)(M * Kp) * 2);
        if (xb == NULL) return -1;
        pipe_bf16_round_rows(xb, x, ldx, M, K, Kp);
    }
    const int par = NB * 16 * Kp * 2 * (M > 8 ? 8 : 1) >= PIPE_LP_PAR_MIN_BYTES
                    && omp_get_max_threads() > 1;
    #pragma omp parallel if (par)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t b0 = NB * t / nt, b1 = NB * (t + 1) / nt;
        if (level == PIPE_ISA_AVX512) pipe_bf16_blocks_avx512(y, ldy, xb, W, bias, M, Kp, N, b0, b1);
        else if (level == PIPE_ISA_AVX2) pipe_bf16_blocks_avx2(y, ldy, x, ldx, W, bias, M, K, Kp, N, b0, b1);
        else pipe_bf16_blocks_portable(y, ldy, x, ldx, W, bias, M, K, Kp, N, b0, b1);
    }
    return 0;
}

#endif
