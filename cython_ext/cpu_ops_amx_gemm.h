/* Worker stage, CPU ops: the products on AMX tiles that the layers call (prefill, batches).
 *
 *   pipeline_cpu_amx_bf16 / _i8:       y = x @ W^T (+ bias), x float32 rounded / quantised here
 *   pipeline_cpu_linear_bf16 / _i8:    the GEMV or the AMX kernel, whichever is faster for M
 *   pipeline_cpu_swiglu:               act = silu(x @ gate^T) * (x @ up^T), gate_up never written
 *   pipeline_cpu_mlp_bf16:             down(swiglu(x)), the activation passed as bf16 A tiles
 *
 * Each converts x once into the A tiles (bf16 rounded, or int8 per token as the int8 GEMV
 * does) and runs pipe_amx_run (cpu_ops_amx.h) with its epilogue. No state besides each
 * thread's scratch for A and for the MLP's activation tiles.
 */
#ifndef PIPELINE_CPU_OPS_AMX_GEMM_H
#define PIPELINE_CPU_OPS_AMX_GEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_ops_amx.h"

/* Rows up to which the GEMVs run where AMX could: measured on the 0.5B model's projections
 * (docs/cpu.md), AMX ties the GEMVs at one row (both read the weights at DRAM speed) and wins
 * from two. Without AMX the GEMVs take any number of rows on AVX2 alone and the bf16 one with
 * AVX-512 BF16 (measured on an AVX2-only core, `pipeline bench gemm`: 1.0-1.1x BLAS on the
 * weights in float32 from 512 rows up, far ahead below; int8's VPMADDUBSW 1.3x ahead of float32
 * FMAs at every row count); elsewhere (AVX-512 without BF16/AMX: not measured since) up to
 * PIPE_GEMV_MAX_M (bf16) or PIPE_I8_NO_AMX_GEMV_MAX_M (int8) rows, then dequantise + BLAS. */
#define PIPE_BF16_GEMV_MAX_M 1
#define PIPE_I8_GEMV_MAX_M 1
#define PIPE_I8_NO_AMX_GEMV_MAX_M 32

/* x rounded to bf16 into the tiles of Mp rows of Kp (zeros past M and K): AVX-512 BF16 (every
 * AMX CPU has it), rounding to nearest even as pipe_f32_to_bf16 does. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void pipe_amx_round_rows(char *xb, const float *x, int64_t ldx, int64_t M,
                                int64_t Mp, int64_t K, int64_t Kp) {
    const int64_t steps = Kp / 32;
    /* in the buffer's order, one tile (1 KB) after the other: row-order writes 1 KB apart
     * ran 4x slower */
    #pragma omp parallel for if (M * K >= (1 << 16)) schedule(static)
    for (int64_t t = 0; t < Mp / 16 * steps; t++) {
        const int64_t m0 = t / steps * 16, k0 = t % steps * 32;
        uint16_t *d = (uint16_t *)(xb + t * 1024);
        for (int64_t r = 0; r < 16; r++, d += 32) {
            const int64_t m = m0 + r;
            if (m < M && k0 + 32 <= K) {
                const float *xr = x + m * ldx + k0;
                _mm512_storeu_si512(d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16),
                                                                     _mm512_loadu_ps(xr)));
                continue;
            }
            for (int64_t k = 0; k < 32; k++)
                d[k] = m < M && k0 + k < K ? pipe_f32_to_bf16(x[m * ldx + k0 + k]) : 0;
        }
    }
}

/* Returns -1 without AMX or scratch memory (the caller then takes another kernel). `up`:
 * 0, or SwiGLU: W holds 2 x N rows (gate, then up) and y gets silu(gate) * up, N columns
 * (N a multiple of 16, up = N / 16 blocks). */
static int pipe_amx_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                         const uint16_t *W, const float *bias, int64_t M, int64_t K,
                         int64_t N, int64_t up) {
    if (M <= 0 || N <= 0) return 0;
    if (!pipe_amx_ok()) return -1;
    const int64_t Kp = pipe_bf16_kp(K), Mp = (M + 15) / 16 * 16;
    char *xb = (char *)pipe_lp_buffer((size_t)(Mp * Kp) * 2);
    if (xb == NULL) return -1;
    pipe_amx_round_rows(xb, x, ldx, M, Mp, K, Kp);
    pipe_amx_args g = {y, ldy, M, N, up ? 2 * up : (N + 15) / 16, Kp / 32, Kp * 2, 16 * Kp * 2,
                       (const char *)xb, (const char *)W, bias, NULL, NULL, up, NULL, 0};
    return pipe_amx_run(&g, 0);
}

static int pipeline_cpu_amx_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                 const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                 int64_t N) {
    return pipe_amx_bf16(y, ldy, x, ldx, W, bias, M, K, N, 0);
}

/* Whether the int8 AMX kernel takes rows of K: the packed depth K4 = ceil(K/4) must fill
 * whole tiles (16 groups of 4). */
static int pipe_amx_i8_fits(int64_t K) { return (K + 3) / 4 % 16 == 0; }

/* Returns -1 without AMX, for a K it does not take, or without scratch memory. `up`: as
 * for pipe_amx_bf16. */
static int pipe_amx_i8(float *y, int64_t ldy, const float *x, int64_t ldx, const int8_t *P,
                       const float *scale, const float *bias, int64_t M, int64_t K, int64_t N,
                       int64_t up) {
    if (M <= 0 || N <= 0) return 0;
    if (!pipe_amx_ok() || !pipe_amx_i8_fits(K)) return -1;
    const int64_t K4 = (K + 3) / 4, Mp = (M + 15) / 16 * 16, lda = K4 * 4;
    const size_t abytes = ((size_t)(Mp * lda) + 63) / 64 * 64;
    char *buf = (char *)pipe_lp_buffer(abytes + (size_t)Mp * 4);
    if (buf == NULL) return -1;
    int8_t *xq = (int8_t *)buf;
    float *xs = (float *)(buf + abytes);
    const int64_t steps = K4 / 16;
    #pragma omp parallel for if (M * K >= (1 << 16)) schedule(static)
    for (int64_t m = 0; m < Mp; m++) {
        int8_t row[lda]; /* quantised as by the GEMV, then cut into the tiles */
        if (m < M) xs[m] = pipe_quantize_row(x + m * ldx, K, K4, row);
        else memset(row, 0, (size_t)lda);
        for (int64_t s = 0; s < steps; s++) memcpy(xq + pipe_amx_aoff(m, s, steps), row + s * 64, 64);
    }
    pipe_amx_args g = {y, ldy, M, N, up ? 2 * up : (N + 15) / 16, steps, lda, 16 * lda,
                       (const char *)xq, (const char *)P, bias, xs, scale, up, NULL, 0};
    return pipe_amx_run(&g, 1);
}

static int pipeline_cpu_amx_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                               const int8_t *P, const float *scale, const float *bias,
                               int64_t M, int64_t K, int64_t N) {
    return pipe_amx_i8(y, ldy, x, ldx, P, scale, bias, M, K, N, 0);
}

/* Which kernel pipeline_cpu_linear_bf16 / _i8 run for M rows of K: 2 AMX tiles, 1 the
 * GEMV, 0 neither (they answer 1: the caller dequantises for BLAS). The one-call decoder asks
 * the same question before a step (pipe_decoder_takes). */
static int pipe_linear_bf16_route(int64_t M, int64_t K) {
    if (M > PIPE_BF16_GEMV_MAX_M && pipe_amx_ok()) return 2;
    return M <= PIPE_GEMV_MAX_M || pipe_bf16_level(K) != PIPE_ISA_PORTABLE;
}

static int pipe_linear_i8_route(int64_t M, int64_t K) {
    if (M > PIPE_I8_GEMV_MAX_M && pipe_amx_ok() && pipe_amx_i8_fits(K)) return 2;
    return M <= PIPE_I8_NO_AMX_GEMV_MAX_M || pipe_i8_level(K) == PIPE_ISA_AVX2;
}

/* y = x @ W^T (+ bias) with bf16 W packed: 0 done, -1 out of scratch memory, 1 not taken
 * (no AMX, no vector body, M > PIPE_GEMV_MAX_M: the caller dequantises for BLAS). AMX
 * without scratch falls back to the GEMV, which takes any rows. */
static int pipeline_cpu_linear_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                    const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                    int64_t N) {
    const int route = pipe_linear_bf16_route(M, K);
    if (route == 2 && pipeline_cpu_amx_bf16(y, ldy, x, ldx, W, bias, M, K, N) == 0) return 0;
    return route ? pipeline_cpu_gemv_bf16(y, ldy, x, ldx, W, bias, M, K, N) : 1;
}

/* The same for int8 P (packed, per-channel scale). */
static int pipeline_cpu_linear_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                                  const int8_t *P, const float *scale, const float *bias,
                                  int64_t M, int64_t K, int64_t N) {
    const int route = pipe_linear_i8_route(M, K);
    if (route == 2 && pipeline_cpu_amx_i8(y, ldy, x, ldx, P, scale, bias, M, K, N) == 0) return 0;
    return route ? pipeline_cpu_gemv_i8(y, ldy, x, ldx, P, scale, bias, M, K, N) : 1;
}

/* SwiGLU of a gate_up projection on AMX tiles, fused: act [M, inter] (rows ldact floats
 * apart) = silu(x @ gate^T) * (x @ up^T), W (bf16) or P (int8, with scale) packed from the
 * [2 * inter, K] gate_up weight, no bias. gate_up itself is never written: at a 2048-token
 * prefill of the 0.5B model it was 80 MB a layer written, read back and halved. 0: done;
 * 1: not taken (M within the GEMV's rows, no AMX, inter not a multiple of 16, a K the int8
 * tiles do not take): the caller runs the projection and silu_and_mul; -1: no scratch. */
static int pipeline_cpu_swiglu(float *act, int64_t ldact, const float *x, int64_t ldx,
                               const void *W, const float *scale, int64_t M, int64_t K,
                               int64_t inter) {
    const int i8 = scale != NULL;
    if (M <= (i8 ? PIPE_I8_GEMV_MAX_M : PIPE_BF16_GEMV_MAX_M) || inter % 16 || !pipe_amx_ok()
        || (i8 && !pipe_amx_i8_fits(K)))
        return 1;
    return i8 ? pipe_amx_i8(act, ldact, x, ldx, (const int8_t *)W, scale, NULL, M, K, inter, inter / 16)
              : pipe_amx_bf16(act, ldact, x, ldx, (const uint16_t *)W, NULL, M, K, inter, inter / 16);
}

/* The bf16 MLP of `M` rows on AMX tiles: y [M, K] = down(silu(x @ gate^T) * (x @ up^T)),
 * Wgu packed from the [2 * inter, K] gate_up weight, Wd from the [K, inter] down weight, no
 * biases. The SwiGLU epilogue writes its products as the down GEMM's bf16 A tiles, so the
 * activation never exists in float32: at a 2048-token prefill of the 0.5B model that was 40
 * MB a layer written, read back and rounded (2.1 ms of the 12.5 ms down GEMM). The same
 * floats as the projection, silu_and_mul and the down projection one after the other. 0:
 * done; 1: not taken (as pipeline_cpu_swiglu); -1: no scratch. */
static __thread void *pipe_mlp_scratch = NULL;
static __thread size_t pipe_mlp_scratch_bytes = 0;

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,fma")))
static int pipeline_cpu_mlp_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                 const uint16_t *Wgu, const uint16_t *Wd, int64_t M, int64_t K,
                                 int64_t inter) {
    if (M <= PIPE_BF16_GEMV_MAX_M || inter % 16 || !pipe_amx_ok()) return 1;
    const int64_t Kp = pipe_bf16_kp(K), Ip = pipe_bf16_kp(inter), Mp = (M + 15) / 16 * 16;
    const int64_t asteps = Ip / 32;
    const size_t abytes = (size_t)(Mp * Ip) * 2;
    if (abytes > pipe_mlp_scratch_bytes) {
        free(pipe_mlp_scratch);
        pipe_mlp_scratch = aligned_alloc(64, (abytes + 63) / 64 * 64);
        pipe_mlp_scratch_bytes = pipe_mlp_scratch ? abytes : 0;
    }
    char *at = (char *)pipe_mlp_scratch;
    char *xb = (char *)pipe_lp_buffer((size_t)(Mp * Kp) * 2);
    if (at == NULL || xb == NULL) return -1;
    /* What no epilogue writes: the padding rows, and the depth past inter of the last step */
    for (int64_t m = M; m < Mp; m++)
        for (int64_t s = 0; s < asteps; s++) memset(at + pipe_amx_aoff(m, s, asteps), 0, 64);
    if (Ip != inter)
        for (int64_t m = 0; m < M; m++) memset(at + pipe_amx_aoff(m, asteps - 1, asteps) + 32, 0, 32);
    pipe_amx_round_rows(xb, x, ldx, M, Mp, K, Kp);
    const int64_t up = inter / 16;
    pipe_amx_args g = {NULL, 0, M, inter, 2 * up, Kp / 32, Kp * 2, 16 * Kp * 2,
                       (const char *)xb, (const char *)Wgu, NULL, NULL, NULL, up, at, asteps};
    if (pipe_amx_run(&g, 0) != 0) return -1;
    pipe_amx_args d = {y, ldy, M, K, (K + 15) / 16, asteps, Ip * 2, 16 * Ip * 2,
                       (const char *)at, (const char *)Wd, NULL, NULL, NULL, 0, NULL, 0};
    return pipe_amx_run(&d, 0);
}

#endif
