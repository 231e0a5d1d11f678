/* Worker stage, CPU ops: the small per-layer element-wise ops of a decoder layer, fused so a
 * decode step does one pass over each activation row instead of a chain of torch ops.
 *
 *   pipeline_cpu_rms_norm:       out = rms_norm(x [+ residual]) * weight; with a residual
 *                                the sum is written back to it (the residual stream).
 *   pipeline_cpu_rope_and_cache: neox (rotate-half) RoPE in place on q and k rows, then the
 *                                rotated k and v rows are written to their cache slots.
 *   pipeline_cpu_silu_and_mul:   out = silu(x[:, :I]) * x[:, I:] (the SwiGLU of a fused
 *                                gate/up projection).
 *
 * Activations are float32 (the ops' callers keep half types on the torch path, whose rounding
 * sequence matches transformers'); the cache may be float32, bfloat16 or float16. Sums are
 * float32. At batch 1 each call is a few hundred nanoseconds of work, so parallel regions are
 * only opened above PIPE_FUSED_PAR_MIN elements. No state; index values are checked before any
 * write and the first bad one is returned (or -1).
 */
#ifndef PIPELINE_CPU_OPS_FUSED_H
#define PIPELINE_CPU_OPS_FUSED_H

#include <stdint.h>
#include <math.h>
#include <omp.h>
#include "cpu_ops_dtype.h"

#define PIPE_FUSED_PAR_MIN (1 << 16)

/* x, residual and out rows are `x_stride`, `res_stride` and `out_stride` floats apart;
 * `residual` may be NULL. out may alias x (not residual). */
static void pipeline_cpu_rms_norm(float *out, const float *x, float *residual,
                                  const float *weight, int64_t num_tokens, int64_t hidden,
                                  int64_t out_stride, int64_t x_stride, int64_t res_stride,
                                  float eps) {
    const int par = num_tokens * hidden >= PIPE_FUSED_PAR_MIN;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * out_stride;
        float ss = 0.0f;
        if (residual != NULL) {
            float *r = residual + t * res_stride;
            for (int64_t i = 0; i < hidden; i++) {
                const float v = r[i] + xr[i];
                r[i] = v;
                ss += v * v;
            }
            xr = r;
        } else {
            for (int64_t i = 0; i < hidden; i++) ss += xr[i] * xr[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) o[i] = xr[i] * inv * weight[i];
    }
}

/* Rotate `heads` rows of one token in place with cos/sin rows stored full width as
 * cos = [c, c], sin = [-s, s] (RotaryEmbedding's tables). */
static inline void pipe_rope_rows(float *x, int64_t heads, int64_t D, const float *restrict cos,
                                  const float *restrict sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *restrict a = x + h * D, *restrict b = a + half;
        for (int64_t d = 0; d < half; d++) {
            const float x1 = a[d], x2 = b[d];
            a[d] = x1 * cos[d] + x2 * sin[d];
            b[d] = x2 * cos[half + d] + x1 * sin[half + d];
        }
    }
}

/* q [T, H, D], k and v [T, Hkv, D] float32 with row strides (in floats); tables
 * [max_positions, D] float32; caches [num_blocks, block_size, Hkv, D] in `dtype`.
 * Returns the first token whose position or slot is out of range, or -1. A negative slot
 * (padding) is rotated but not cached. */
static int64_t pipeline_cpu_rope_and_cache(
        float *q, float *k, const float *v, int64_t q_stride, int64_t k_stride,
        int64_t v_stride, const int64_t *positions, const float *cos_table,
        const float *sin_table, int64_t max_positions, char *k_cache, char *v_cache,
        const int64_t *slot_mapping, int64_t num_tokens, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int dtype) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions || slot_mapping[t] >= num_slots)
            return t;
    const int64_t D = head_dim, row = num_kv_heads * D, esz = pipe_dtype_size(dtype);
    const int par = num_tokens * (num_heads + 2 * num_kv_heads) * D >= PIPE_FUSED_PAR_MIN;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        pipe_rope_rows(q + t * q_stride, num_heads, D, c, s);
        float *kr = k + t * k_stride;
        pipe_rope_rows(kr, num_kv_heads, D, c, s);
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        pipe_store_row(k_cache + slot * row * esz, kr, row, dtype, 1.0f);
        pipe_store_row(v_cache + slot * row * esz, v + t * v_stride, row, dtype, 1.0f);
    }
    return -1;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* expf for eight lanes: Cody-Waite reduction to r in [-ln2/2, ln2/2] and the degree-6
 * Cephes polynomial (about 1 ulp on that range), times 2^n built in the exponent bits.
 * Inputs are clamped to [-87, 88] so 2^n stays a normal float; silu only needs the ends to
 * saturate (g / (1 + e^-g) is g or 0 to float precision there). Scalar expf runs ~20x
 * slower than this and made SwiGLU the largest element-wise cost of a batch-32 step. */
static inline __m256 pipe_exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#endif

#if defined(__x86_64__)
#include <immintrin.h>
/* pipe_exp8's operations on sixteen lanes (the same floats lane by lane), and SwiGLU's
 * silu(g) * u on them: the AMX kernel's fused gate_up epilogue (cpu_ops_amx.h) and
 * silu_and_mul below give the same floats. */
__attribute__((target("avx512f"))) static inline __m512 pipe_exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

__attribute__((target("avx512f"))) static inline __m512 pipe_silu_mul16(__m512 g, __m512 u) {
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), pipe_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}
#endif

/* out [T, I] (dense) = silu(x[:, :I]) * x[:, I:], x rows `x_stride` floats apart. */
static void pipeline_cpu_silu_and_mul(float *out, const float *x, int64_t num_tokens,
                                      int64_t inter, int64_t x_stride) {
    const int par = num_tokens * inter >= PIPE_FUSED_PAR_MIN;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *restrict g = x + t * x_stride, *restrict u = g + inter;
        float *restrict o = out + t * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16)
            _mm512_storeu_ps(o + i, pipe_silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(one, pipe_exp8(_mm256_sub_ps(zero, gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out[r] = the index of the largest of row r's n floats (rows ld apart), the first one
 * on ties, or of its first NaN: torch.argmax's answer. Greedy decoding's last step: at
 * batch 32 over a 151936-token vocabulary torch took 6 ms (19 MB at ~3 GB/s); this reads
 * each row once for the maximum and again, from L2, for its first position. */
static void pipeline_cpu_argmax(int64_t *out, const float *x, int64_t rows, int64_t n,
                                int64_t ld) {
    const int par = rows > 1 && rows * n >= PIPE_FUSED_PAR_MIN;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        float mx = n > 0 ? row[0] : 0.0f;
        int nan = 0;
        int64_t i = 0;
#if defined(__AVX512F__)
        if (n >= 16) {
            __m512 m = _mm512_loadu_ps(row);
            __mmask16 bad = 0;
            for (i = 0; i + 16 <= n; i += 16) {
                const __m512 v = _mm512_loadu_ps(row + i);
                bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                m = _mm512_max_ps(m, v);
            }
            mx = _mm512_reduce_max_ps(m);
            nan = bad != 0;
        }
#elif defined(__AVX2__)
        if (n >= 8) { /* the scalar loop read ~1 float a cycle: 0.14 ms of a batch-1 token */
            __m256 m = _mm256_loadu_ps(row), bad = _mm256_setzero_ps();
            for (i = 0; i + 8 <= n; i += 8) {
                const __m256 v = _mm256_loadu_ps(row + i);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                m = _mm256_max_ps(m, v);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, m);
            mx = lanes[0];
            for (int l = 1; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
            nan = _mm256_movemask_ps(bad) != 0;
        }
#endif
        for (; i < n; i++) {
            nan |= row[i] != row[i];
            mx = row[i] > mx ? row[i] : mx;
        }
        int64_t at = 0;
        if (nan) {
            while (row[at] == row[at]) at++;
        } else {
            at = n; /* found below: mx is one of the row's values */
            int64_t j = 0;
#if defined(__AVX512F__)
            const __m512 mv = _mm512_set1_ps(mx);
            for (; j + 16 <= n; j += 16) {
                const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), mv, _CMP_EQ_OQ);
                if (hit) { at = j + __builtin_ctz(hit); break; }
            }
#elif defined(__AVX2__)
            const __m256 mv = _mm256_set1_ps(mx);
            for (; j + 8 <= n; j += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), mv, _CMP_EQ_OQ));
                if (hit) { at = j + __builtin_ctz(hit); break; }
            }
#endif
            if (at == n)
                for (; j < n; j++)
                    if (row[j] == mx) { at = j; break; }
        }
        out[r] = n > 0 ? at : 0;
    }
}

#endif
