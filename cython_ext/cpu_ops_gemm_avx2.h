/* Worker stage, CPU ops: bf16 and int8 weights at batch on a core with AVX2 only (no
 * AVX-512 BF16, no AMX: AMD Zen 2/3, older Xeons).
 *
 *   pipe_g2_gemm: y [M, N] = x [M, K] @ W^T (+ bias), float32 x and y, W packed bf16
 *                 (cpu_ops_gemv_lp.h) or int8 with per-channel scales (cpu_ops_gemv_i8.h)
 *
 * Such a core has no instruction that multiplies bf16 or int8 into float sums at batch, so
 * the products run as float32 FMAs, the only fast arithmetic it has. Before, a batch step
 * widened every weight to float32 in a scratch matrix and handed it to BLAS: each step wrote
 * and read back 4 bytes per parameter (2 GB on the 0.5B model, about as long as the FMAs
 * themselves). Here a thread widens a panel of PIPE_G2_NB column blocks x PIPE_G2_KC inputs
 * (128 KB, in L2) and runs the FMAs over it at once; the widened weights never reach memory.
 *
 * Micro-kernel: 6 rows x 16 columns in 12 ymm accumulators; per input 2 panel loads, 6
 * broadcasts of x, 12 FMAs (FMA-bound: two FMA ports, three load ports). The 6 rows' slice of
 * x (6 x KC floats, 6 KB) stays in L1 across the panel's column blocks; PIPE_G2_MC rows go
 * over all the thread's panels before the next ones. Threads split the column blocks. Sums run in a different order than the GEMV's, so the floats differ from it
 * in the last bits, as BLAS's did.
 * State: one 128 KB panel buffer per OpenMP thread, kept for the thread's life.
 */
#ifndef PIPELINE_CPU_OPS_GEMM_AVX2_H
#define PIPELINE_CPU_OPS_GEMM_AVX2_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>
#include "cpu_ops_gemv_i8.h"
#include "cpu_ops_gemv_lp.h"

#ifndef PIPE_G2_KC
#define PIPE_G2_KC 256 /* inputs per panel (a multiple of 4) */
#endif
#ifndef PIPE_G2_NB
#define PIPE_G2_NB 8 /* 16-column blocks per panel */
#endif
#define PIPE_G2_MR 6
/* Rows per pass over the weights: their x slice (MC x KC floats, 144 KB) stays in L2 beside
 * the panel while every panel of the thread's columns is widened again for them (at 2048
 * rows x re-read from L3 for each panel ran the GEMM ~20 % slower than BLAS on float32). */
#ifndef PIPE_G2_MC
#define PIPE_G2_MC 144
#endif

static __thread float *pipe_g2_panel = NULL;

typedef struct {
    const uint16_t *W;   /* bf16 blocks [Kp/2][16][2], or NULL */
    const int8_t *P;     /* int8 blocks [K4][16][4], or NULL */
    const float *scale;  /* int8: per output channel */
    int64_t K, N, stride; /* stride: elements (bf16) or bytes (int8) per block */
} pipe_g2_weights;

/* Column blocks [b0, b0 + nb), inputs [k0, k0 + kc) widened to float32 into B [nb][kc][16]
 * (int8: times the channel's scale). k0 and kc are multiples of 4; inputs past K read the
 * packing's zero padding. */
__attribute__((target("avx2,fma")))
static void pipe_g2_widen(float *B, const pipe_g2_weights *w, int64_t b0, int nb, int64_t k0, int64_t kc) {
    for (int j = 0; j < nb; j++) {
        float *d = B + (int64_t)j * kc * 16;
        if (w->W) {
            const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
            const uint16_t *pb = w->W + (b0 + j) * w->stride;
            for (int64_t k = 0; k < kc; k += 2) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pb + (k0 + k) * 16));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pb + (k0 + k) * 16 + 16));
                _mm256_storeu_ps(d + k * 16, _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)));
                _mm256_storeu_ps(d + k * 16 + 8, _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)));
                _mm256_storeu_ps(d + k * 16 + 16, _mm256_castsi256_ps(_mm256_and_si256(v0, hi)));
                _mm256_storeu_ps(d + k * 16 + 24, _mm256_castsi256_ps(_mm256_and_si256(v1, hi)));
            }
        } else {
            const int8_t *pb = w->P + (b0 + j) * w->stride;
            const __m256 s0 = _mm256_loadu_ps(w->scale + (b0 + j) * 16);
            const __m256 s1 = _mm256_loadu_ps(w->scale + (b0 + j) * 16 + 8);
            for (int64_t k = 0; k < kc; k += 4) {
                /* a 32-bit lane per output channel, its 4 inputs in the bytes */
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pb + (k0 + k) * 16));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pb + (k0 + k) * 16 + 32));
#define PIPE_G2_BYTE(v, t) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * (t)), 24))
                for (int t = 0; t < 4; t++) {
                    __m256 f0, f1;
                    switch (t) { /* shift counts must be immediates */
                    case 0: f0 = PIPE_G2_BYTE(v0, 0); f1 = PIPE_G2_BYTE(v1, 0); break;
                    case 1: f0 = PIPE_G2_BYTE(v0, 1); f1 = PIPE_G2_BYTE(v1, 1); break;
                    case 2: f0 = PIPE_G2_BYTE(v0, 2); f1 = PIPE_G2_BYTE(v1, 2); break;
                    default: f0 = PIPE_G2_BYTE(v0, 3); f1 = PIPE_G2_BYTE(v1, 3); break;
                    }
                    _mm256_storeu_ps(d + (k + t) * 16, _mm256_mul_ps(f0, s0));
                    _mm256_storeu_ps(d + (k + t) * 16 + 8, _mm256_mul_ps(f1, s1));
                }
#undef PIPE_G2_BYTE
            }
        }
    }
}

/* Lanes < n of 8 (n may be <= 0 or >= 8) as an AVX2 mask. */
__attribute__((target("avx2,fma"))) static inline __m256i pipe_g2_mask(int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
}

/* R rows (<= 6) x 16 columns over kc inputs: y (+)= x @ B; `first` starts from zero, a bias
 * is added (the last depth chunk); n: the columns < N in this block. The accumulators are
 * named, not an array: GCC kept an array on the stack and stored it at every input. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline))
void pipe_g2_tile(const int R, float *y, int64_t ldy, const float *x, int64_t ldx, const float *B,
                  int64_t kc, int first, const float *bias, int n) {
    __m256i m0 = pipe_g2_mask(n), m1 = pipe_g2_mask(n - 8);
    __m256 c0a, c0b, c1a, c1b, c2a, c2b, c3a, c3b, c4a, c4b, c5a, c5b;
    c0a = c0b = c1a = c1b = c2a = c2b = c3a = c3b = c4a = c4b = c5a = c5b = _mm256_setzero_ps();
#define PIPE_G2_LOAD(r, ca, cb) \
    if (R > r && !first) { ca = _mm256_maskload_ps(y + r * ldy, m0); cb = _mm256_maskload_ps(y + r * ldy + 8, m1); }
    PIPE_G2_LOAD(0, c0a, c0b) PIPE_G2_LOAD(1, c1a, c1b) PIPE_G2_LOAD(2, c2a, c2b)
    PIPE_G2_LOAD(3, c3a, c3b) PIPE_G2_LOAD(4, c4a, c4b) PIPE_G2_LOAD(5, c5a, c5b)
#undef PIPE_G2_LOAD
    /* one pointer per row: GCC spilled the offsets it derived from ldx */
    const float *x0 = x, *x1 = x0 + (R > 1 ? ldx : 0), *x2 = x1 + (R > 2 ? ldx : 0),
                *x3 = x2 + (R > 3 ? ldx : 0), *x4 = x3 + (R > 4 ? ldx : 0), *x5 = x4 + (R > 5 ? ldx : 0);
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(B + k * 16), w1 = _mm256_load_ps(B + k * 16 + 8);
        __m256 xv;
#define PIPE_G2_FMA(r, ca, cb) \
        if (R > r) { xv = _mm256_broadcast_ss(x##r + k); \
                     ca = _mm256_fmadd_ps(w0, xv, ca); cb = _mm256_fmadd_ps(w1, xv, cb); }
        PIPE_G2_FMA(0, c0a, c0b) PIPE_G2_FMA(1, c1a, c1b) PIPE_G2_FMA(2, c2a, c2b)
        PIPE_G2_FMA(3, c3a, c3b) PIPE_G2_FMA(4, c4a, c4b) PIPE_G2_FMA(5, c5a, c5b)
#undef PIPE_G2_FMA
    }
    /* the masks again: kept live through the loop they took two of the 16 registers */
    __asm__("" : "+r"(n));
    m0 = pipe_g2_mask(n);
    m1 = pipe_g2_mask(n - 8);
    const __m256 ba = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 bb = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
#define PIPE_G2_STORE(r, ca, cb) \
    if (R > r) { _mm256_maskstore_ps(y + r * ldy, m0, _mm256_add_ps(ca, ba)); \
                 _mm256_maskstore_ps(y + r * ldy + 8, m1, _mm256_add_ps(cb, bb)); }
    PIPE_G2_STORE(0, c0a, c0b) PIPE_G2_STORE(1, c1a, c1b) PIPE_G2_STORE(2, c2a, c2b)
    PIPE_G2_STORE(3, c3a, c3b) PIPE_G2_STORE(4, c4a, c4b) PIPE_G2_STORE(5, c5a, c5b)
#undef PIPE_G2_STORE
}

__attribute__((target("avx2,fma"), noinline)) /* its own registers, not the caller's */
static void pipe_g2_rows(int R, float *y, int64_t ldy, const float *x, int64_t ldx, const float *B,
                         int64_t kc, int first, const float *bias, int n) {
    switch (R) { /* each count unrolled on its own */
    case 6: pipe_g2_tile(6, y, ldy, x, ldx, B, kc, first, bias, n); break;
    case 5: pipe_g2_tile(5, y, ldy, x, ldx, B, kc, first, bias, n); break;
    case 4: pipe_g2_tile(4, y, ldy, x, ldx, B, kc, first, bias, n); break;
    case 3: pipe_g2_tile(3, y, ldy, x, ldx, B, kc, first, bias, n); break;
    case 2: pipe_g2_tile(2, y, ldy, x, ldx, B, kc, first, bias, n); break;
    default: pipe_g2_tile(1, y, ldy, x, ldx, B, kc, first, bias, n); break;
    }
}

/* Column blocks [b0, b1) of y, a panel at a time. -1: no panel memory. */
static int pipe_g2_blocks(float *y, int64_t ldy, const float *x, int64_t ldx, const pipe_g2_weights *w,
                          const float *bias, int64_t M, int64_t b0, int64_t b1) {
    if (pipe_g2_panel == NULL) {
        pipe_g2_panel = (float *)aligned_alloc(64, (size_t)PIPE_G2_NB * PIPE_G2_KC * 16 * 4);
        if (pipe_g2_panel == NULL) return -1;
    }
    const int64_t K = w->K;
    for (int64_t mc = 0; mc < M; mc += PIPE_G2_MC) {
      const int64_t mend = M - mc < PIPE_G2_MC ? M : mc + PIPE_G2_MC;
      for (int64_t pb = b0; pb < b1; pb += PIPE_G2_NB) {
        const int nb = (int)(b1 - pb < PIPE_G2_NB ? b1 - pb : PIPE_G2_NB);
        for (int64_t k0 = 0; k0 < K; k0 += PIPE_G2_KC) {
            const int64_t kc = K - k0 < PIPE_G2_KC ? K - k0 : PIPE_G2_KC;
            pipe_g2_widen(pipe_g2_panel, w, pb, nb, k0, (kc + 3) / 4 * 4);
            const int first = k0 == 0, last = k0 + kc >= K;
            for (int64_t m0 = mc; m0 < mend; m0 += PIPE_G2_MR) {
                const int R = (int)(mend - m0 < PIPE_G2_MR ? mend - m0 : PIPE_G2_MR);
                for (int j = 0; j < nb; j++) {
                    const int64_t n0 = (pb + j) * 16;
                    const int n = (int)(w->N - n0 < 16 ? w->N - n0 : 16);
                    pipe_g2_rows(R, y + m0 * ldy + n0, ldy, x + m0 * ldx + k0, ldx,
                                 pipe_g2_panel + (int64_t)j * ((kc + 3) / 4 * 4) * 16, kc, first,
                                 last && bias ? bias + n0 : NULL, n);
                }
            }
        }
      }
    }
    return 0;
}

/* y = x @ W^T (+ bias) for the weights in w. 0 done, -1 no panel memory. */
static int pipe_g2_gemm(float *y, int64_t ldy, const float *x, int64_t ldx, const pipe_g2_weights *w,
                        const float *bias, int64_t M) {
    const int64_t NB = (w->N + 15) / 16;
    int rc = 0;
    #pragma omp parallel if (omp_get_max_threads() > 1 && NB > 1) reduction(min : rc)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        rc = pipe_g2_blocks(y, ldy, x, ldx, w, bias, M, NB * t / nt, NB * (t + 1) / nt);
    }
    return rc;
}

static int pipeline_cpu_gemm_avx2_bf16(float *y, int64_t ldy, const float *x, int64_t ldx,
                                       const uint16_t *W, const float *bias, int64_t M, int64_t K,
                                       int64_t N) {
    const pipe_g2_weights w = {W, NULL, NULL, K, N, 16 * pipe_bf16_kp(K)};
    return pipe_g2_gemm(y, ldy, x, ldx, &w, bias, M);
}

static int pipeline_cpu_gemm_avx2_i8(float *y, int64_t ldy, const float *x, int64_t ldx,
                                     const int8_t *P, const float *scale, const float *bias,
                                     int64_t M, int64_t K, int64_t N) {
    const pipe_g2_weights w = {NULL, P, scale, K, N, PIPE_I8_BLOCK * 4 * ((K + 3) / 4)};
    return pipe_g2_gemm(y, ldy, x, ldx, &w, bias, M);
}

#endif
