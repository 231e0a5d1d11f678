/* Bench support, CPU ops: the machine's limits (`pipeline bench worker`): its read bandwidth,
 * the limit of a decode step that streams its weights once, and the peak of the AMX tile
 * products (cpu_ops_amx.h) or of AVX2 FMAs, the limit of a prefill or a large batch.
 *
 *   pipe_read_sum: the sum of n floats, read by `threads` OpenMP threads, each over one
 *   contiguous slice, with eight independent vector accumulators: the loop is bound by
 *   loads, not by the latency of one add chain (torch.sum ran at ~60 % of this, a one-thread
 *   memcpy measures one core's copy, not the memory system).
 *   pipe_amx_peak: FLOP/s of TDPBF16PS / TDPBSSD on tiles loaded once (no memory traffic).
 *   pipe_fma_peak: FLOP/s of AVX2 float32 FMAs on registers (float32 and, on a core with
 *   AVX2 alone, bf16 products: the GEMV widens bf16 in registers and runs these FMAs).
 * No state.
 */
#ifndef PIPELINE_CPU_OPS_BW_H
#define PIPELINE_CPU_OPS_BW_H

#include <stdint.h>
#include <omp.h>
#include "cpu_ops_amx.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static double pipe_read_slice(const float *restrict x, int64_t n) {
    int64_t i = 0;
    double total = 0.0;
#if defined(__AVX2__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
        a4 = _mm256_add_ps(a4, _mm256_loadu_ps(x + i + 32));
        a5 = _mm256_add_ps(a5, _mm256_loadu_ps(x + i + 40));
        a6 = _mm256_add_ps(a6, _mm256_loadu_ps(x + i + 48));
        a7 = _mm256_add_ps(a7, _mm256_loadu_ps(x + i + 56));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    for (int l = 0; l < 8; l++) total += lanes[l];
#else
    float s[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += x[i + l];
    for (int l = 0; l < 8; l++) total += s[l];
#endif
    for (; i < n; i++) total += x[i];
    return total;
}

static double pipe_read_sum(const float *x, int64_t n, int threads) {
    double total = 0.0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        total += pipe_read_slice(x + lo, hi - lo);
    }
    return total;
}

/* FLOP/s of `threads` threads each issuing `iters` x 12 independent 8-lane float32 FMAs
 * (VFMADD231PS ymm) on registers: the peak, no memory
 * traffic. 0 without AVX2/FMA. */
__attribute__((target("avx2,fma")))
static double pipe_fma_peak(int64_t iters, int threads) {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0.0;
    double t0 = 0.0, t1 = 0.0, sink = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        /* 12 chains (FMA latency 4-5 cycles x 2 ports), named: an array was kept in memory */
        const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
        __m256 a0 = _mm256_set1_ps(0.f), a1 = _mm256_set1_ps(1.f), a2 = _mm256_set1_ps(2.f),
               a3 = _mm256_set1_ps(3.f), a4 = _mm256_set1_ps(4.f), a5 = _mm256_set1_ps(5.f),
               a6 = _mm256_set1_ps(6.f), a7 = _mm256_set1_ps(7.f), a8 = _mm256_set1_ps(8.f),
               a9 = _mm256_set1_ps(9.f), a10 = _mm256_set1_ps(10.f), a11 = _mm256_set1_ps(11.f);
        #pragma omp barrier
        #pragma omp master
        t0 = omp_get_wtime();
        for (int64_t i = 0; i < iters; i++) {
            a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c);
            a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
            a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
            a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
            a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c);
            a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
        }
        #pragma omp barrier
        #pragma omp master
        t1 = omp_get_wtime();
        float out[8];
        __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                 _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
        t = _mm256_add_ps(t, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
        _mm256_storeu_ps(out, t);
        sink += out[0]; /* the chains' results used: not optimised away */
    }
    return sink == -1.0 ? 0.0 : (double)threads * (double)iters * 12.0 * 16.0 / (t1 - t0);
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
