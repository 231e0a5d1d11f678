/* Worker stage, CPU ops: one paged-attention work item with AVX-512, query rows on lanes.
 *
 *   pipe_attn_item512: the work item of pipe_attn_item (cpu_ops_attn.h), same outputs
 *
 * The generic item scores one query row at a time against each key (a dot product ending in
 * a horizontal sum) and rescales its accumulator per row and block: at a prefill tile of 16
 * tokens x a GQA group of 7 that is 112 passes over every 16-key block. Here 16 query rows
 * share a register: q is transposed once per item to qt [D][16 rows], so a score vector of
 * 16 rows is D multiply-adds with one key element broadcast from memory, the online softmax
 * runs on those vectors (max, exp, sum without a horizontal step), and P x V is 16 keys x D
 * multiply-adds into an accumulator kept transposed the same way. Keys come in chunks of at
 * most 16 within one cache block, widened to float32 once per chunk (zero rows past the
 * chunk). A key a row may not see (causal) gets weight exactly 0, so a row that sees none in
 * a chunk keeps its state. Needs AVX-512F and head_dim a multiple of 16, at most 256. No
 * state; scratch comes from the caller.
 */
#ifndef PIPELINE_CPU_OPS_ATTN512_H
#define PIPELINE_CPU_OPS_ATTN512_H

#include <stdint.h>
#include "cpu_ops_dtype.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include "cpu_ops_fused.h" /* pipe_exp16 */

#define PIPE_ATTN512 1
#define PIPE_ATTN512_MAX_D 256
/* Fewer query rows than this in a tile (a decode token of a small GQA group) fill too few
 * lanes: the generic item, which streams the cache in place, wins there (batch-32 decode,
 * context 180: group 3 0.26 ms a layer against 0.36 here; group 7 0.42 against 0.39). */
#define PIPE_ATTN512_MIN_ROWS 6

static inline int pipe_attn512_ok(int64_t D) { return D % 16 == 0 && D <= PIPE_ATTN512_MAX_D; }

/* Floats of scratch the item needs for `max_rows` query rows: qt and acct (rows rounded up
 * to 16), m and l per row, 16 keys and 16 values of D. */
static inline int64_t pipe_attn512_scratch(int64_t max_rows, int64_t D) {
    const int64_t rp = (max_rows + 15) / 16 * 16;
    return 2 * rp * D + 2 * rp + 2 * 16 * D;
}

/* Writes, as pipe_attn_item does, acc [rows][D] (unnormalised), m and l per row (rows =
 * nt x group). `w`: pipe_attn512_scratch floats. Inlined with D a constant for the common
 * head sizes: the key and value offsets j x D then fold into the instructions (with D a
 * variable, 16 of them did not fit the registers and the score loop reloaded them). */
static inline __attribute__((always_inline))
void pipe_attn_item512_d(const pipe_attn_args *a, int64_t b, int64_t tile, int64_t kvh,
                         int64_t k_lo, int64_t k_hi, float *acc, float *m, float *l,
                         float *w, const int64_t D) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t start = a->cu_seqlens_q[b], q_len = a->cu_seqlens_q[b + 1] - start;
    const int64_t first_pos = a->seq_lens[b] - q_len, t0 = tile * PIPE_QTILE;
    const int64_t nt = q_len - t0 < PIPE_QTILE ? q_len - t0 : PIPE_QTILE;
    const int64_t rows = nt * group, nv = (rows + 15) / 16, esz = pipe_dtype_size(a->dtype);
    const int64_t last_pos = first_pos + t0 + nt - 1;
    if (k_hi > last_pos + 1) k_hi = last_pos + 1;
    float *qt = w, *acct = qt + nv * 16 * D, *mv = acct + nv * 16 * D, *lv = mv + nv * 16;
    float *kf = lv + nv * 16, *vf = kf + 16 * D;
    int32_t pos[PIPE_QTILE * 64]; /* per row lane; group <= 64 (checked by the caller) */
    for (int64_t r = 0; r < nv * 16; r++) {
        const int64_t lane = r % 16, v = r / 16;
        pos[r] = r < rows ? (int32_t)(first_pos + t0 + r / group) : -1; /* padding sees nothing */
        float row[PIPE_ATTN512_MAX_D];
        if (r < rows) {
            const int64_t tok = start + t0 + r / group, head = kvh * group + r % group;
            pipe_load_row(row, a->q + (tok * a->q_stride + head * D) * pipe_dtype_size(a->q_dtype),
                          D, a->q_dtype, a->scale);
        } else {
            for (int64_t d = 0; d < D; d++) row[d] = 0.0f;
        }
        for (int64_t d = 0; d < D; d++) {
            qt[(v * D + d) * 16 + lane] = row[d];
            acct[(v * D + d) * 16 + lane] = 0.0f;
        }
        mv[r] = PIPE_NEG_BIG;
        lv[r] = 0.0f;
    }
    const int32_t *bt = a->block_tables + b * a->max_blocks;
    const int64_t bs = a->block_size, kv_row = a->num_kv_heads * D;
    for (int64_t k0 = k_lo; k0 < k_hi;) {
        const int64_t off = k0 % bs;
        int64_t n = bs - off < k_hi - k0 ? bs - off : k_hi - k0;
        if (n > 16) n = 16;
        const int64_t base = ((int64_t)bt[k0 / bs] * bs + off) * kv_row + kvh * D;
        for (int64_t j = 0; j < 16; j++) {
            if (j < n) {
                pipe_load_row(kf + j * D, a->k_cache + (base + j * kv_row) * esz, D, a->dtype, 1.0f);
                pipe_load_row(vf + j * D, a->v_cache + (base + j * kv_row) * esz, D, a->dtype, 1.0f);
            } else {
                for (int64_t d = 0; d < D; d++) kf[j * D + d] = vf[j * D + d] = 0.0f;
            }
        }
        for (int64_t v = 0; v < nv; v++) {
            const __m512i pv = _mm512_loadu_si512(pos + v * 16);
            /* lanes that see key k0 + j: k0 + j <= pos (and j < n) */
            __mmask16 vis[16];
            __mmask16 any = 0;
            for (int j = 0; j < 16; j++) {
                vis[j] = j < n ? _mm512_cmple_epi32_mask(_mm512_set1_epi32((int32_t)(k0 + j)), pv) : 0;
                any |= vis[j];
            }
            if (!any) continue;
            const float *q = qt + v * D * 16;
            __m512 s[16];
            for (int j = 0; j < 16; j++) s[j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m512 qd = _mm512_loadu_ps(q + d * 16);
                for (int j = 0; j < 16; j++) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kf[j * D + d]), s[j]);
            }
            const __m512 m_old = _mm512_loadu_ps(mv + v * 16);
            __m512 mx = m_old;
            for (int j = 0; j < 16; j++) mx = _mm512_mask_max_ps(mx, vis[j], mx, s[j]);
            const __m512 corr = pipe_exp16(_mm512_sub_ps(m_old, mx));
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < 16; j++) {
                s[j] = _mm512_maskz_mov_ps(vis[j], pipe_exp16(_mm512_sub_ps(s[j], mx)));
                sum = _mm512_add_ps(sum, s[j]);
            }
            _mm512_storeu_ps(mv + v * 16, mx);
            _mm512_storeu_ps(lv + v * 16, _mm512_fmadd_ps(_mm512_loadu_ps(lv + v * 16), corr, sum));
            float *ac = acct + v * D * 16;
            for (int64_t d = 0; d < D; d += 8) { /* 8 independent chains of 16 keys */
                __m512 o[8];
                for (int i = 0; i < 8; i++) o[i] = _mm512_mul_ps(_mm512_loadu_ps(ac + (d + i) * 16), corr);
                for (int j = 0; j < 16; j++)
                    for (int i = 0; i < 8; i++)
                        o[i] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vf[j * D + d + i]), o[i]);
                for (int i = 0; i < 8; i++) _mm512_storeu_ps(ac + (d + i) * 16, o[i]);
            }
        }
        k0 += n;
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t lane = r % 16, v = r / 16;
        for (int64_t d = 0; d < D; d++) acc[r * D + d] = acct[(v * D + d) * 16 + lane];
        m[r] = mv[r];
        l[r] = lv[r];
    }
}

static void pipe_attn_item512(const pipe_attn_args *a, int64_t b, int64_t tile, int64_t kvh,
                              int64_t k_lo, int64_t k_hi, float *acc, float *m, float *l,
                              float *w) {
    if (a->head_dim == 64) pipe_attn_item512_d(a, b, tile, kvh, k_lo, k_hi, acc, m, l, w, 64);
    else if (a->head_dim == 128) pipe_attn_item512_d(a, b, tile, kvh, k_lo, k_hi, acc, m, l, w, 128);
    else pipe_attn_item512_d(a, b, tile, kvh, k_lo, k_hi, acc, m, l, w, a->head_dim);
}

#endif /* __AVX512F__ */
#endif
