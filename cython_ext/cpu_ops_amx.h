/* Worker stage, CPU ops: bf16 and int8 matrix products on AMX tiles (prefill, batches).
 *
 *   pipeline_cpu_amx_bf16: y [M, N] = x [M, K] @ W^T (+ bias), W packed as for the bf16 GEMV
 *   pipeline_cpu_amx_i8:   y [M, N] = x [M, K] @ (scale * Q)^T (+ bias), Q packed as for gemv_i8
 *   pipe_amx_peak:         FLOP/s of TDPBF16PS / TDPBSSD on tiles in registers (no memory)
 *
 * Both weight layouts are already AMX B tiles: a bf16 block [Kp/2][16][2] and an int8 block
 * [K/4][16][4] hold, for 32 (bf16) or 64 (int8) inputs, one 16-row x 64-byte tile, 1 KB
 * contiguous. x is converted once per call into an A buffer (bf16 rounded, or int8 quantised
 * per token exactly as the int8 GEMV does), rows padded with zeros to a multiple of 16. The
 * eight tiles are 4 accumulators (2 row blocks x 2 column blocks of 16), 2 A and 2 B, so each
 * A and B tile loaded feeds two products. Threads split the pairs of column blocks; each goes
 * over the rows in chunks whose A slice stays in L2 while its B panels are reused.
 * int8 sums are exact int32 (TDPBSSD: signed x signed), scaled by the same code as the GEMV's
 * (pipe_i8_store), so both give the same floats.
 *
 * The kernel needs the tile data state, which Linux grants per process on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM); pipe_amx_ok() asks once and says no when the CPU, the
 * kernel or the ISA cap (pipeline_cpu_set_isa) refuses, and the callers then take the vector
 * kernels. State: that answer; each thread configures its tiles per call and releases them.
 */
#ifndef PIPELINE_CPU_OPS_AMX_H
#define PIPELINE_CPU_OPS_AMX_H

#include <cpuid.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#include <immintrin.h>
#include "cpu_ops_gemv_i8.h"
#include "cpu_ops_gemv_lp.h"

#define PIPE_AMX_PERM 0x1023  /* ARCH_REQ_XCOMP_PERM */
#define PIPE_AMX_XTILEDATA 18 /* XFEATURE_XTILEDATA */
/* A rows per chunk: the chunk's A slice (at most this many bytes) stays in L2 while each
 * pair of B panels is multiplied over it. */
#ifndef PIPE_AMX_A_BYTES
#define PIPE_AMX_A_BYTES (768 << 10)
#endif

static int pipe_amx_granted = -1; /* -1: not asked yet */

/* CPU has AMX-TILE/BF16/INT8 (CPUID 7.0 EDX 24, 22, 25) and the kernel granted the tile data. */
static int pipe_amx_ok(void) {
    if (pipe_amx_granted < 0) {
        unsigned a, b, c, d;
        int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1)
                 && (d >> 25 & 1);
        if (ok) ok = syscall(SYS_arch_prctl, PIPE_AMX_PERM, PIPE_AMX_XTILEDATA) == 0;
        pipe_amx_granted = ok;
    }
    return pipe_amx_granted && pipe_isa_cap >= PIPE_ISA_AMX;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} pipe_tilecfg;

/* Tiles 0-3: C (16 x 16 float32 / int32), 4-5: A, 6-7: B, all 16 rows x 64 bytes. */
__attribute__((target("amx-tile")))
static void pipe_amx_config(void) {
    pipe_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* One row block pair (nm x 16 rows) by one column block pair (nn x 16 columns) over all of
 * K: the 4 (or fewer) accumulators into c[i][16][16]. a: A rows, lda bytes apart; b0/b1:
 * the two blocks' B panels (1 KB per depth step); steps: K / tile depth. */
#define PIPE_AMX_TILE_LOOP(DP)                                                                \
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                               \
    for (int64_t s = 0; s < steps; s++) {                                                     \
        _tile_loadd(4, a + s * 64, lda);                                                      \
        _tile_loadd(6, b0 + s * 1024, 64);                                                    \
        DP(0, 4, 6);                                                                          \
        if (nn == 2) { _tile_loadd(7, b1 + s * 1024, 64); DP(1, 4, 7); }                      \
        if (nm == 2) {                                                                        \
            _tile_loadd(5, a + 16 * lda + s * 64, lda);                                       \
            DP(2, 5, 6);                                                                      \
            if (nn == 2) DP(3, 5, 7);                                                         \
        }                                                                                     \
    }                                                                                         \
    _tile_stored(0, c[0], 64);                                                                \
    if (nn == 2) _tile_stored(1, c[1], 64);                                                   \
    if (nm == 2) { _tile_stored(2, c[2], 64); if (nn == 2) _tile_stored(3, c[3], 64); }

__attribute__((target("amx-tile,amx-bf16"))) static inline __attribute__((always_inline))
void pipe_amx_bf16_tiles(const int nm, const int nn, const char *a, int64_t lda, const char *b0,
                         const char *b1, int64_t steps, float (*c)[16][16]) {
    PIPE_AMX_TILE_LOOP(_tile_dpbf16ps)
}

__attribute__((target("amx-tile,amx-int8"))) static inline __attribute__((always_inline))
void pipe_amx_i8_tiles(const int nm, const int nn, const char *a, int64_t lda, const char *b0,
                       const char *b1, int64_t steps, int32_t (*c)[16][16]) {
    PIPE_AMX_TILE_LOOP(_tile_dpbssd)
}

/* The arguments of one product, shared by the bf16 and int8 drivers. */
typedef struct {
    float *y;
    int64_t ldy, M, N, NB, steps, lda, panel; /* panel: bytes of one block's B */
    const char *A, *W;
    const float *bias, *xs, *scale;           /* xs, scale: int8 only */
} pipe_amx_args;

__attribute__((target("amx-tile,amx-bf16,amx-int8")))
static void pipe_amx_run(const pipe_amx_args *g, int i8) {
    const int64_t pairs = (g->NB + 1) / 2, Mp = (g->M + 15) / 16 * 16;
    int64_t chunk = PIPE_AMX_A_BYTES / (g->lda > 0 ? g->lda : 1) / 32 * 32;
    if (chunk < 32) chunk = 32;
    #pragma omp parallel if (pairs > 1 && omp_get_max_threads() > 1)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;
        float c[4][16][16] __attribute__((aligned(64)));
        pipe_amx_config();
        for (int64_t mc = 0; mc < Mp; mc += chunk)
            for (int64_t p = p0; p < p1; p++) {
                const int64_t b = 2 * p;
                const int nn = b + 1 < g->NB ? 2 : 1;
                const char *b0 = g->W + b * g->panel, *b1 = b0 + g->panel;
                for (int64_t m = mc; m < Mp && m < mc + chunk; m += 32) {
                    const int nm = Mp - m >= 32 ? 2 : 1;
                    const char *a = g->A + m * g->lda;
                    /* constant nm/nn per call: the branches of the tile loop fold away */
                    if (i8) {
                        int32_t (*ci)[16][16] = (int32_t (*)[16][16])c;
                        if (nm == 2 && nn == 2) pipe_amx_i8_tiles(2, 2, a, g->lda, b0, b1, g->steps, ci);
                        else if (nm == 2) pipe_amx_i8_tiles(2, 1, a, g->lda, b0, b1, g->steps, ci);
                        else if (nn == 2) pipe_amx_i8_tiles(1, 2, a, g->lda, b0, b1, g->steps, ci);
                        else pipe_amx_i8_tiles(1, 1, a, g->lda, b0, b1, g->steps, ci);
                    } else if (nm == 2 && nn == 2) pipe_amx_bf16_tiles(2, 2, a, g->lda, b0, b1, g->steps, c);
                    else if (nm == 2) pipe_amx_bf16_tiles(2, 1, a, g->lda, b0, b1, g->steps, c);
                    else if (nn == 2) pipe_amx_bf16_tiles(1, 2, a, g->lda, b0, b1, g->steps, c);
                    else pipe_amx_bf16_tiles(1, 1, a, g->lda, b0, b1, g->steps, c);
                    for (int i = 0; i < 2 * nm; i++) {
                        if ((i & 1) >= nn) continue;
                        const int64_t bb = b + (i & 1), m0 = m + 16 * (i >> 1);
                        for (int64_t r = 0; r < 16 && m0 + r < g->M; r++) {
                            if (i8) {
                                pipe_i8_store(g->y, g->ldy, (const int32_t *)c[i][r], m0 + r, bb,
                                              g->N, g->xs, g->scale, g->bias);
                                continue;
                            }
                            float *yr = g->y + (m0 + r) * g->ldy + bb * 16;
                            for (int64_t j = 0; j < 16 && bb * 16 + j < g->N; j++)
                                yr[j] = c[i][r][j] + (g->bias ? g->bias[bb * 16 + j] : 0.0f);
                        }
                    }
                }
            }
        _tile_release();
    }
}

/* x rounded to bf16 into Mp rows of Kp (zeros past M and K): AVX-512 BF16 (every AMX CPU has
 * it), rounding to nearest even as pipe_f32_to_bf16 does. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void pipe_amx_round_rows(uint16_t *xb, const float *x, int64_t ldx, int64_t M,
                                int64_t Mp, int64_t K, int64_t Kp) {
    #pragma omp parallel for if (M * K >= (1 << 16)) schedule(static)
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *d = xb + m * Kp;
        int64_t k = 0;
        if (m < M)
            for (; k + 16 <= K; k += 16)
                _mm256_storeu_si256((__m256i *)(d + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * ldx + k)));
        for (; k < Kp; k++) d[k] = m < M && k < K ? pipe_f32_to_bf16(x[m * ldx + k]) : 0;
    }
}

/* Returns -1 without AMX or scratch memory (the caller then takes another kernel). */
static int pipeline_cpu_amx_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                 const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                 int64_t N) {
    if (M <= 0 || N <= 0) return 0;
    if (!pipe_amx_ok()) return -1;
    const int64_t Kp = pipe_bf16_kp(K), Mp = (M + 15) / 16 * 16;
    uint16_t *xb = (uint16_t *)pipe_lp_buffer((size_t)(Mp * Kp) * 2);
    if (xb == NULL) return -1;
    pipe_amx_round_rows(xb, x, ldx, M, Mp, K, Kp);
    pipe_amx_args g = {y, ldy, M, N, (N + 15) / 16, Kp / 32, Kp * 2, 16 * Kp * 2,
                       (const char *)xb, (const char *)W, bias, NULL, NULL};
    pipe_amx_run(&g, 0);
    return 0;
}

/* Whether the int8 AMX kernel takes rows of K: the packed depth K4 = ceil(K/4) must fill
 * whole tiles (16 groups of 4). */
static int pipe_amx_i8_fits(int64_t K) { return (K + 3) / 4 % 16 == 0; }

/* Returns -1 without AMX, for a K it does not take, or without scratch memory. */
static int pipeline_cpu_amx_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                               const int8_t *P, const float *scale, const float *bias,
                               int64_t M, int64_t K, int64_t N) {
    if (M <= 0 || N <= 0) return 0;
    if (!pipe_amx_ok() || !pipe_amx_i8_fits(K)) return -1;
    const int64_t K4 = (K + 3) / 4, Mp = (M + 15) / 16 * 16, lda = K4 * 4;
    const size_t abytes = ((size_t)(Mp * lda) + 63) / 64 * 64;
    char *buf = (char *)pipe_lp_buffer(abytes + (size_t)Mp * 4);
    if (buf == NULL) return -1;
    int8_t *xq = (int8_t *)buf;
    float *xs = (float *)(buf + abytes);
    #pragma omp parallel for if (M * K >= (1 << 16)) schedule(static)
    for (int64_t m = 0; m < Mp; m++) {
        if (m < M) xs[m] = pipe_quantize_row(x + m * ldx, K, K4, xq + m * lda);
        else memset(xq + m * lda, 0, (size_t)lda);
    }
    pipe_amx_args g = {y, ldy, M, N, (N + 15) / 16, K4 / 16, lda, 16 * lda,
                       (const char *)xq, (const char *)P, bias, xs, scale};
    pipe_amx_run(&g, 1);
    return 0;
}

/* FLOP/s of `threads` threads each issuing `iters` x 4 independent tile products (bf16:
 * kind 0, TDPBF16PS; int8: kind 1, TDPBSSD, ops counted as FLOP) on tiles loaded once: the
 * instructions' peak, no memory traffic. 0 without AMX. */
__attribute__((target("amx-tile,amx-bf16,amx-int8")))
static double pipe_amx_peak(int kind, int64_t iters, int threads) {
    if (!pipe_amx_ok()) return 0.0;
    static const char zeros[1024] __attribute__((aligned(64))) = {0};
    double t0 = 0.0, t1 = 0.0;
    #pragma omp parallel num_threads(threads)
    {
        pipe_amx_config();
        _tile_loadd(4, zeros, 64);
        _tile_loadd(5, zeros, 64);
        _tile_loadd(6, zeros, 64);
        _tile_loadd(7, zeros, 64);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        #pragma omp barrier
        #pragma omp master
        t0 = omp_get_wtime();
        if (kind == 0)
            for (int64_t i = 0; i < iters; i++) {
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
        else
            for (int64_t i = 0; i < iters; i++) {
                _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
            }
        _tile_release();
        #pragma omp barrier
        #pragma omp master
        t1 = omp_get_wtime();
    }
    const double per_tile = 16.0 * 16.0 * (kind == 0 ? 32.0 : 64.0) * 2.0;
    return (double)threads * (double)iters * 4.0 * per_tile / (t1 - t0);
}

#endif
