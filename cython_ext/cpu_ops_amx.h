/* Worker stage, CPU ops: the AMX tile engine under every product (cpu_ops_amx_gemm.h).
 *
 *   pipe_amx_run: y [M, N] = A [M, K] @ B^T with A already in tiles, through one epilogue:
 *                 + bias (bf16), the int8 scales, or SwiGLU of gate/up block pairs (into y,
 *                 or into the bf16 A tiles of the down product that follows)
 *
 * Both weight layouts are already AMX B tiles: a bf16 block [Kp/2][16][2] and an int8 block
 * [K/4][16][4] hold, for 32 (bf16) or 64 (int8) inputs, one 16-row x 64-byte tile, 1 KB
 * contiguous. A holds tiles too (pipe_amx_aoff), rows padded with zeros to a multiple of 16. The
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
#include "cpu_ops_fused.h"
#include "cpu_ops_gemv_i8.h"
#include "cpu_ops_gemv_lp.h"

#define PIPE_AMX_PERM 0x1023  /* ARCH_REQ_XCOMP_PERM */
#define PIPE_AMX_XTILEDATA 18 /* XFEATURE_XTILEDATA */
/* A rows per chunk: the chunk's A slice (at most this many bytes) stays in L2 while each
 * pair of B panels is multiplied over it. */
#ifndef PIPE_AMX_A_BYTES
#define PIPE_AMX_A_BYTES (768 << 10)
#endif
#ifndef PIPE_AMX_NT_BYTES
#define PIPE_AMX_NT_BYTES (8 << 20)
#endif
/* The first row block over a B panel fetches it this many depth steps (1 KB per column
 * block) ahead: the hardware prefetcher stops at 4 KB pages, and a batch-32 decode step,
 * whose every B tile comes from DRAM once, read its weights at 18-19 GB/s of the 26 GB/s
 * two cores read (22-23 GB/s with it; 8 steps: 19-20 GB/s). */
#ifndef PIPE_AMX_PF_STEPS
#define PIPE_AMX_PF_STEPS 16
#endif
#ifndef PIPE_AMX_KSTEPS
#define PIPE_AMX_KSTEPS 8
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

/* One row block pair (nm x 16 rows) by one column block pair (nn x 16 columns) over `steps`
 * depth steps: the 4 (or fewer) accumulators start from zero (first) or from c, and go back
 * to c (rows of 32 values, 128 bytes: the two column blocks side by side). a: the first row
 * block's A tiles (1 KB per depth step), the second's lda bytes further; b0/b1: the two
 * column blocks' B tiles (1 KB per depth step). */
#define PIPE_AMX_TILE_LOOP(DP)                                                                \
    if (first) {                                                                              \
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                           \
    } else {                                                                                  \
        _tile_loadd(0, c, 128);                                                               \
        if (nn == 2) _tile_loadd(1, c + 16, 128);                                             \
        if (nm == 2) { _tile_loadd(2, c + 512, 128); if (nn == 2) _tile_loadd(3, c + 528, 128); } \
    }                                                                                         \
    for (int64_t s = 0; s < steps; s++) {                                                     \
        if (pf) for (int l = 0; l < 1024; l += 64) {                                          \
            _mm_prefetch(b0 + (s + PIPE_AMX_PF_STEPS) * 1024 + l, _MM_HINT_T0);               \
            if (nn == 2) _mm_prefetch(b1 + (s + PIPE_AMX_PF_STEPS) * 1024 + l, _MM_HINT_T0);  \
        }                                                                                     \
        _tile_loadd(4, a + s * 1024, 64);                                                     \
        _tile_loadd(6, b0 + s * 1024, 64);                                                    \
        DP(0, 4, 6);                                                                          \
        if (nn == 2) { _tile_loadd(7, b1 + s * 1024, 64); DP(1, 4, 7); }                      \
        if (nm == 2) {                                                                        \
            _tile_loadd(5, a + lda + s * 1024, 64);                                           \
            DP(2, 5, 6);                                                                      \
            if (nn == 2) DP(3, 5, 7);                                                         \
        }                                                                                     \
    }                                                                                         \
    _tile_stored(0, c, 128);                                                                  \
    if (nn == 2) _tile_stored(1, c + 16, 128);                                                \
    if (nm == 2) { _tile_stored(2, c + 512, 128); if (nn == 2) _tile_stored(3, c + 528, 128); }

__attribute__((target("amx-tile,amx-bf16,avx512f"))) static inline __attribute__((always_inline))
void pipe_amx_bf16_tiles(const int nm, const int nn, const char *a, int64_t lda, const char *b0,
                         const char *b1, int64_t steps, int first, float *c, int pf) {
    PIPE_AMX_TILE_LOOP(_tile_dpbf16ps)
}

__attribute__((target("amx-tile,amx-int8,avx512f"))) static inline __attribute__((always_inline))
void pipe_amx_i8_tiles(const int nm, const int nn, const char *a, int64_t lda, const char *b0,
                       const char *b1, int64_t steps, int first, int32_t *c, int pf) {
    PIPE_AMX_TILE_LOOP(_tile_dpbssd)
}

/* The A buffer holds tiles, not rows: the 16 x 64-byte tile of row block m / 16 and depth
 * step s is 1 KB at (m / 16 * steps + s) KB, so every tile load reads one contiguous KB (as
 * B's do) that the hardware prefetcher follows. This is where row m's 64 bytes of step s go. */
static inline int64_t pipe_amx_aoff(int64_t m, int64_t s, int64_t steps) {
    return ((m / 16 * steps + s) * 16 + m % 16) * 64;
}

/* The arguments of one product, shared by the bf16 and int8 drivers. */
typedef struct {
    float *y;
    int64_t ldy, M, N, NB, steps, arow, panel; /* arow: A bytes per row, panel: per block of B */
    const char *A, *W;
    const float *bias, *xs, *scale;           /* xs, scale: int8 only */
    int64_t up; /* SwiGLU (gate_up): block b's partner b + up, y [M, N] = silu(gate) * up */
    char *at;   /* SwiGLU into bf16 A tiles of `asteps` depth steps (the down GEMM's A), not y */
    int64_t asteps;
} pipe_amx_args;

/* Row m of one SwiGLU pair: gate block b's 16 sums beside up block b + up's (as the plain
 * epilogue would write them, then silu_and_mul's operations: the same floats). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma"))) static inline
void pipe_amx_swiglu16(const pipe_amx_args *g, const float *c, int64_t m, int64_t b, int i8,
                       int nt) {
    __m512 gate = _mm512_load_ps(c), up = _mm512_load_ps(c + 16);
    if (i8) {
        const __m512 xs = _mm512_set1_ps(g->xs[m]);
        gate = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c)),
                               _mm512_mul_ps(xs, _mm512_loadu_ps(g->scale + b * 16)), _mm512_setzero_ps());
        up = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16)),
                             _mm512_mul_ps(xs, _mm512_loadu_ps(g->scale + (b + g->up) * 16)),
                             _mm512_setzero_ps());
    }
    const __m512 act = pipe_silu_mul16(gate, up);
    if (g->at) /* rounded as pipe_amx_round_rows rounds: the floats of the unfused path */
        _mm256_storeu_si256((__m256i *)(g->at + pipe_amx_aoff(m, b / 2, g->asteps) + b % 2 * 32),
                            (__m256i)_mm512_cvtneps_pbh(act));
    else
        pipe_store16(g->y + m * g->ldy + b * 16, (__mmask16)0xffff, act, nt);
}

/* Each thread's accumulators for one chunk of rows (PIPE_AMX_MAX_CHUNK x 32 values). */
#define PIPE_AMX_MAX_CHUNK 512
static __thread float *pipe_amx_cbuf = NULL;

__attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,fma")))
static int pipe_amx_run(const pipe_amx_args *g, int i8) {
    const int64_t pairs = g->up ? g->up : (g->NB + 1) / 2, Mp = (g->M + 15) / 16 * 16;
    const int64_t lda = 16 * g->arow;
    int64_t chunk = PIPE_AMX_A_BYTES / (g->arow > 0 ? g->arow : 1) / 32 * 32;
    chunk = chunk < 32 ? 32 : chunk > PIPE_AMX_MAX_CHUNK ? PIPE_AMX_MAX_CHUNK : chunk;
    /* An output far larger than L2 is written around the caches: no line is read for
     * ownership first (gate_up of a 512-token prefill: 20 MB, 841 -> 1114 GFLOP/s). */
    const int stream = (size_t)g->M * g->N * 4 >= PIPE_AMX_NT_BYTES && (uintptr_t)g->y % 64 == 0
                   && g->ldy % 16 == 0;
    /* One row block pair (a decode batch of up to 32): no B tile is reused, so the whole
     * depth goes in one pass and the accumulators never go out to memory and back. */
    const int64_t kslice = Mp <= 32 ? g->steps : PIPE_AMX_KSTEPS;
    int failed = 0;
    /* Pairs are dealt in runs of `run` as threads come free, not split up front: on a shared
     * machine a thread that lost its core for a while no longer holds the others at the end. */
    const int64_t team = omp_get_max_threads();
    const int64_t run = pairs / (8 * team) > 1 ? pairs / (8 * team) : 1;
    #pragma omp parallel if (pairs > 1 && team > 1) reduction(| : failed)
    {
        if (pipe_amx_cbuf == NULL)
            pipe_amx_cbuf = (float *)aligned_alloc(64, PIPE_AMX_MAX_CHUNK * 32 * sizeof(float));
        float *cbuf = pipe_amx_cbuf;
        failed = cbuf == NULL;
        if (cbuf) pipe_amx_config();
        for (int64_t mc = 0; mc < Mp; mc += chunk)
            #pragma omp for schedule(dynamic, run) nowait
            for (int64_t p = 0; p < pairs; p++) {
                if (cbuf == NULL) continue; /* every thread meets every loop; this call fails */
                const int64_t b = g->up ? p : 2 * p; /* and b + 1, or b + up (SwiGLU) */
                const int nn = g->up || b + 1 < g->NB ? 2 : 1;
                const char *b0 = g->W + b * g->panel, *b1 = b0 + (g->up ? g->up : 1) * g->panel;
                /* depth in slices whose B tiles (2 x PIPE_AMX_KSTEPS KB) stay in L1 while
                 * every row block of the chunk multiplies them */
                for (int64_t k0 = 0; k0 < g->steps; k0 += kslice) {
                    const int64_t ks = g->steps - k0 < kslice ? g->steps - k0 : kslice;
                    const int first = k0 == 0, last = k0 + ks == g->steps;
                    for (int64_t m = mc; m < Mp && m < mc + chunk; m += 32) {
                        const int nm = Mp - m >= 32 ? 2 : 1;
                        const char *a = g->A + m * g->arow + k0 * 1024;
                        const char *k0b0 = b0 + k0 * 1024, *k0b1 = b1 + k0 * 1024;
                        float *c = cbuf + (m - mc) * 32;
                        const int pf = m == mc; /* B's first pass over the chunk reads DRAM */
                        /* constant nm/nn per call: the branches of the tile loop fold away */
                        if (i8) {
                            int32_t *ci = (int32_t *)c;
                            if (nm == 2 && nn == 2) pipe_amx_i8_tiles(2, 2, a, lda, k0b0, k0b1, ks, first, ci, pf);
                            else if (nm == 2) pipe_amx_i8_tiles(2, 1, a, lda, k0b0, k0b1, ks, first, ci, pf);
                            else if (nn == 2) pipe_amx_i8_tiles(1, 2, a, lda, k0b0, k0b1, ks, first, ci, pf);
                            else pipe_amx_i8_tiles(1, 1, a, lda, k0b0, k0b1, ks, first, ci, pf);
                        } else if (nm == 2 && nn == 2) pipe_amx_bf16_tiles(2, 2, a, lda, k0b0, k0b1, ks, first, c, pf);
                        else if (nm == 2) pipe_amx_bf16_tiles(2, 1, a, lda, k0b0, k0b1, ks, first, c, pf);
                        else if (nn == 2) pipe_amx_bf16_tiles(1, 2, a, lda, k0b0, k0b1, ks, first, c, pf);
                        else pipe_amx_bf16_tiles(1, 1, a, lda, k0b0, k0b1, ks, first, c, pf);
                        if (!last) continue;
                        if (g->up) {
                            for (int64_t r = 0; r < 16 * nm && m + r < g->M; r++)
                                pipe_amx_swiglu16(g, c + r * 32, m + r, b, i8, stream);
                            continue;
                        }
                        for (int64_t r = 0; r < 16 * nm && m + r < g->M; r++)
                            for (int j = 0; j < nn; j++) {
                                const float *cr = c + r * 32 + 16 * j;
                                if (i8) pipe_i8_store16(g->y, g->ldy, (const int32_t *)cr, m + r,
                                                        b + j, g->N, g->xs, g->scale, g->bias, stream);
                                else pipe_bf16_store16(g->y, g->ldy, _mm512_load_ps(cr), m + r,
                                                       b + j, g->N, g->bias, stream);
                            }
                    }
                }
            }
        if (cbuf) _tile_release();
        if (stream) _mm_sfence(); /* the streamed lines visible before the caller reads y */
    }
    return failed ? -1 : 0;
}

#endif
