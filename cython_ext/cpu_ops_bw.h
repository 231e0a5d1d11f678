/* Bench support, CPU ops: the machine's read bandwidth, the physical limit of a decode step
 * that streams its weights once (`pipeline bench worker`).
 *
 *   pipe_read_sum: the sum of n floats, read by `threads` OpenMP threads, each over one
 *   contiguous slice, with eight independent vector accumulators: the loop is bound by
 *   loads, not by the latency of one add chain (torch.sum ran at ~60 % of this, a one-thread
 *   memcpy measures one core's copy, not the memory system). No state.
 */
#ifndef PIPELINE_CPU_OPS_BW_H
#define PIPELINE_CPU_OPS_BW_H

#include <stdint.h>
#include <omp.h>
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

#endif
