/* Worker stage, CPU ops: paged attention over a flattened varlen batch.
 *
 * One kernel serves decode, chunked prefill and prefill with cached context. Work items
 * are (sequence, kv head, tile of up to PIPE_QTILE query tokens, context split): the
 * heads of a GQA group share one pass over their K/V blocks, so every cache byte is read
 * once per item. When the batch has fewer items than twice the thread count (batch-1
 * decode, MQA) the context is split and the partial softmax states are merged afterwards
 * (flash-decoding), so both cores stream the cache. Softmax is online and every sum is
 * float32. Owns no state besides per-call scratch.
 */
#ifndef PIPELINE_CPU_OPS_ATTN_H
#define PIPELINE_CPU_OPS_ATTN_H

#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "cpu_ops_dtype.h"
#include "cpu_ops_simd.h"

#define PIPE_QTILE 16
#define PIPE_SPLIT_MIN_KEYS 256
/* Below this many multiply-adds (tens of microseconds on one core) waking the other
 * threads costs more than it saves, and far more when the cores are oversubscribed. */
#define PIPE_PAR_MIN_FMAS (1 << 18)
#define PIPE_NEG_BIG (-1e30f) /* finite: exp(a - b) stays 0 or 1, never NaN */
#define PIPE_ENOMEM (-2)      /* returned when per-call scratch cannot be allocated */

typedef struct {
    const char *q, *k_cache, *v_cache;
    const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
    int64_t num_seqs, num_tokens, q_stride, num_heads, num_kv_heads, head_dim;
    int64_t num_blocks, block_size, max_blocks;
    float scale;
    int dtype;   /* of the caches */
    int q_dtype; /* of q and out: the cache's, or float32 over a half cache (CPU bf16/int8 weights) */
} pipe_attn_args;

/* Index of the first malformed sequence, or -1. */
static int64_t pipe_attn_validate(const pipe_attn_args *a) {
    if (a->cu_seqlens_q[0] != 0) return 0;
    for (int64_t b = 0; b < a->num_seqs; b++) {
        const int64_t start = a->cu_seqlens_q[b], end = a->cu_seqlens_q[b + 1];
        const int64_t ctx = a->seq_lens[b];
        if (end < start || end > a->num_tokens || ctx < end - start) return b;
        if (ctx > a->max_blocks * a->block_size) return b;
        if (end == start) continue;
        const int32_t *bt = a->block_tables + b * a->max_blocks;
        for (int64_t i = 0; i < (ctx + a->block_size - 1) / a->block_size; i++)
            if (bt[i] < 0 || bt[i] >= a->num_blocks) return b;
    }
    return -1;
}

/* Keys an item takes per pass: scored, then one online-softmax step per row, then
 * accumulated, so the per-row work of a step (max, exp of the correction, the rescale of
 * acc) is spread over this many keys instead of one 16-key block (decode at context 200
 * ran at ~15 % of the FMA peak that way). */
#define PIPE_ATTN_CHUNK 256
/* Keys widened to float32 at a time: one tile of K (then of V) stays in L1 while every row
 * of the item reads it. */
#define PIPE_ATTN_TILE 32
/* Keys ahead whose rows the packing asks for: a pass's keys sit in blocks scattered over the
 * cache, which the hardware prefetcher does not follow (batch-32 decode of head_dim 128 from
 * DRAM: 1.1-1.5x faster with it, measured in a C harness on a 2-vCPU Zen 3). */
#define PIPE_ATTN_AHEAD 16

/* A tile of a pass: keys [at, at + n) of the pass, rows `stride` elements apart at k / v in
 * `dtype`: the float32 tile scratch, or (a lone row) the cache itself, in place. */
typedef struct {
    int64_t at, n, stride;
    const char *k, *v;
    int dtype;
} pipe_attn_tile;

/* Tile `t` of the pass starting at key c0 (len keys), from key c0 + at: up to PIPE_ATTN_TILE
 * K rows (pack_v: V rows) widened into kf (vf), or the rest of that key's cache block in
 * place. Returns the tile's key count. */
static inline int64_t pipe_attn_next_tile(const pipe_attn_args *a, const int32_t *bt, int64_t kvh,
                                          int64_t c0, int64_t at, int64_t len, int in_place,
                                          int pack_v, float *kf, float *vf, pipe_attn_tile *t) {
    const int64_t bs = a->block_size, D = a->head_dim, kv_row = a->num_kv_heads * D;
    const int64_t esz = pipe_dtype_size(a->dtype);
    int64_t k = c0 + at;
    t->at = at;
    if (in_place) {
        const int64_t off = k % bs, n = (c0 + len - k < bs - off) ? c0 + len - k : bs - off;
        const int64_t base = ((int64_t)bt[k / bs] * bs + off) * kv_row + kvh * D;
        t->n = n;
        t->k = a->k_cache + base * esz;
        t->v = a->v_cache + base * esz;
        t->stride = kv_row;
        t->dtype = a->dtype;
        return n;
    }
    const int64_t n = len - at < PIPE_ATTN_TILE ? len - at : PIPE_ATTN_TILE;
    const char *cache = pack_v ? a->v_cache : a->k_cache;
    float *dst = pack_v ? vf : kf;
    const int64_t end = c0 + len;
    for (int64_t j = 0; j < n; j++, k++) {
        const int64_t base = ((int64_t)bt[k / bs] * bs + k % bs) * kv_row + kvh * D;
        if (k + PIPE_ATTN_AHEAD < end) {
            const int64_t kp = k + PIPE_ATTN_AHEAD;
            const char *ahead = cache + (((int64_t)bt[kp / bs] * bs + kp % bs) * kv_row + kvh * D) * esz;
            for (int64_t o = 0; o < D * esz; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        pipe_load_row(dst + j * D, cache + base * esz, D, a->dtype, 1.0f);
    }
    t->n = n;
    t->k = (const char *)kf;
    t->v = (const char *)vf;
    t->stride = D;
    t->dtype = PIPE_F32;
    return n;
}

/* One work item: rows are (token, head-in-group) pairs of one tile; keys [k_lo, k_hi).
 * Keys go in passes of up to PIPE_ATTN_CHUNK keys. A pass scores its keys a tile at a time
 * (every row against the tile while it is in L1, into s [rows][CHUNK]), takes one online-
 * softmax step per row, then accumulates p x V a tile at a time the same way. Tiles are
 * widened to float32 once for all the rows (the group's heads, the tile's tokens); a lone row
 * (a decode token of an MHA model) reads the cache in place instead, a block piece at a time
 * (the SIMD loops widen bf16/fp16 as they go). */
static void pipe_attn_item(const pipe_attn_args *a, int64_t b, int64_t tile, int64_t kvh,
                           int64_t k_lo, int64_t k_hi, float *qf, float *acc, float *m,
                           float *l, float *s, float *kf, float *vf) {
    const int64_t D = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t start = a->cu_seqlens_q[b], q_len = a->cu_seqlens_q[b + 1] - start;
    const int64_t first_pos = a->seq_lens[b] - q_len; /* absolute position of query 0 */
    const int64_t t0 = tile * PIPE_QTILE;
    const int64_t nt = q_len - t0 < PIPE_QTILE ? q_len - t0 : PIPE_QTILE;
    const int64_t rows = nt * group;
    const int64_t last_pos = first_pos + t0 + nt - 1;
    if (k_hi > last_pos + 1) k_hi = last_pos + 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t tok = start + t0 + r / group, head = kvh * group + r % group;
        pipe_load_row(qf + r * D, a->q + (tok * a->q_stride + head * D) * pipe_dtype_size(a->q_dtype), D, a->q_dtype,
                      a->scale);
        m[r] = PIPE_NEG_BIG;
        l[r] = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.0f;
    }
    const int32_t *bt = a->block_tables + b * a->max_blocks;
    const int in_place = rows == 1 && pipe_simd_in_place(D, a->dtype);
    pipe_attn_tile t;
    for (int64_t c0 = k_lo; c0 < k_hi; c0 += PIPE_ATTN_CHUNK) {
        const int64_t len = k_hi - c0 < PIPE_ATTN_CHUNK ? k_hi - c0 : PIPE_ATTN_CHUNK;
        /* keys of this pass row r may see: up to its own position (causal) */
#define PIPE_NVIS(r) (first_pos + t0 + (r) / group - c0 + 1 < len ? first_pos + t0 + (r) / group - c0 + 1 : len)
        for (int64_t at = 0; at < len;) {
            at += pipe_attn_next_tile(a, bt, kvh, c0, at, len, in_place, 0, kf, vf, &t);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = PIPE_NVIS(r) - t.at < t.n ? PIPE_NVIS(r) - t.at : t.n;
                if (n > 0) pipe_scores(qf + r * D, t.k, t.stride, n, D, s + r * PIPE_ATTN_CHUNK + t.at, t.dtype);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t nvis = PIPE_NVIS(r);
            if (nvis <= 0) continue;
            float *sr = s + r * PIPE_ATTN_CHUNK, mx = m[r];
            for (int64_t j = 0; j < nvis; j++) mx = sr[j] > mx ? sr[j] : mx;
            const float corr = expf(m[r] - mx);
            l[r] = l[r] * corr + pipe_exp_sum(sr, nvis, mx);
            m[r] = mx;
            for (int64_t d = 0; d < D; d++) acc[r * D + d] *= corr;
        }
        for (int64_t at = 0; at < len;) {
            at += pipe_attn_next_tile(a, bt, kvh, c0, at, len, in_place, 1, kf, vf, &t);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = PIPE_NVIS(r) - t.at < t.n ? PIPE_NVIS(r) - t.at : t.n;
                if (n > 0) pipe_accumulate(acc + r * D, 1.0f, s + r * PIPE_ATTN_CHUNK + t.at, t.v, t.stride, n, D, t.dtype);
            }
        }
#undef PIPE_NVIS
    }
}

#include "cpu_ops_attn512.h"

/* Returns the index of a malformed sequence, PIPE_ENOMEM, or -1 once `out` [T, H, D] is
 * written. Rows of `out` past cu_seqlens_q[num_seqs] (padding) are zeroed. */
static int64_t pipeline_cpu_paged_attention(char *out, const pipe_attn_args *a) {
    const int64_t bad = pipe_attn_validate(a);
    if (bad >= 0) return bad;
    const int64_t B = a->num_seqs, H = a->num_heads, D = a->head_dim, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, esz = pipe_dtype_size(a->q_dtype), bs = a->block_size;
    int64_t *tile_end = (int64_t *)malloc((size_t)(B > 0 ? B : 1) * sizeof(int64_t));
    if (tile_end == NULL) return PIPE_ENOMEM;
    int64_t tiles = 0, max_ctx = 0, fmas = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t q_len = a->cu_seqlens_q[b + 1] - a->cu_seqlens_q[b];
        tiles += (q_len + PIPE_QTILE - 1) / PIPE_QTILE;
        fmas += 2 * q_len * a->seq_lens[b] * H * D;
        tile_end[b] = tiles;
        if (a->seq_lens[b] > max_ctx) max_ctx = a->seq_lens[b];
    }
    const int par = fmas >= PIPE_PAR_MIN_FMAS;
    const int64_t items = tiles * Hkv, nthreads = par ? omp_get_max_threads() : 1;
    int64_t nsplit = 1;
    if (par && items > 0 && items < 2 * nthreads) {
        nsplit = (2 * nthreads + items - 1) / items;
        const int64_t cap = (max_ctx + PIPE_SPLIT_MIN_KEYS - 1) / PIPE_SPLIT_MIN_KEYS;
        if (nsplit > cap) nsplit = cap;
        if (nsplit < 1) nsplit = 1;
    }
    float *part = NULL; /* per (token, head, split): m, l, acc[D] */
    if (nsplit > 1) {
        part = (float *)malloc((size_t)(a->num_tokens * H * nsplit * (D + 2)) * sizeof(float));
        if (part == NULL) nsplit = 1; /* fall back to one pass per item */
    }
    int oom = 0;
    const int64_t max_rows = PIPE_QTILE * group;
    int64_t extra = 0; /* the AVX-512 item's scratch, after the generic item's */
#ifdef PIPE_ATTN512
    const int use512 = pipe_attn512_ok(D) && group <= 64;
    if (use512) extra = pipe_attn512_scratch(max_rows, D);
#endif
    #pragma omp parallel if (par && items * nsplit > 1)
    {
        const int64_t generic = 2 * max_rows * D + 2 * max_rows + max_rows * PIPE_ATTN_CHUNK + 2 * PIPE_ATTN_TILE * D;
        float *scratch = (float *)malloc((size_t)(generic + extra) * sizeof(float));
        if (scratch == NULL) {
            #pragma omp atomic write
            oom = 1;
        }
        float *qf = scratch, *acc = qf + max_rows * D, *m = acc + max_rows * D;
        float *l = m + max_rows, *s = l + max_rows, *kf = s + max_rows * PIPE_ATTN_CHUNK, *vf = kf + PIPE_ATTN_TILE * D;
        int64_t b = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items * nsplit; it++) {
            if (scratch == NULL) continue; /* this call fails with PIPE_ENOMEM */
            const int64_t split = it % nsplit, kvh = (it / nsplit) % Hkv, gt = it / nsplit / Hkv;
            if (b >= B || gt >= tile_end[b] || (b > 0 && gt < tile_end[b - 1])) {
                int64_t lo = 0, hi = B - 1; /* first b with tile_end[b] > gt */
                while (lo < hi) { int64_t mid = (lo + hi) / 2; if (tile_end[mid] > gt) hi = mid; else lo = mid + 1; }
                b = lo;
            }
            const int64_t tile = gt - (b > 0 ? tile_end[b - 1] : 0), ctx = a->seq_lens[b];
            const int64_t q_len = a->cu_seqlens_q[b + 1] - a->cu_seqlens_q[b];
            const int64_t nt = q_len - tile * PIPE_QTILE < PIPE_QTILE ? q_len - tile * PIPE_QTILE : PIPE_QTILE;
            const int64_t chunk = ((ctx + nsplit - 1) / nsplit + bs - 1) / bs * bs;
            const int64_t k_lo = split * chunk, k_hi = k_lo + chunk < ctx ? k_lo + chunk : ctx;
#ifdef PIPE_ATTN512
            if (use512 && nt * group >= PIPE_ATTN512_MIN_ROWS)
                pipe_attn_item512(a, b, tile, kvh, k_lo, k_hi, acc, m, l, scratch + generic);
            else
#endif
                pipe_attn_item(a, b, tile, kvh, k_lo, k_hi, qf, acc, m, l, s, kf, vf);
            for (int64_t r = 0; r < nt * group; r++) {
                const int64_t tok = a->cu_seqlens_q[b] + tile * PIPE_QTILE + r / group;
                const int64_t head = kvh * group + r % group;
                if (nsplit == 1) {
                    pipe_store_row(out + (tok * H + head) * D * esz, acc + r * D, D, a->q_dtype, 1.0f / l[r]);
                } else {
                    float *p = part + ((tok * H + head) * nsplit + split) * (D + 2);
                    p[0] = m[r];
                    p[1] = l[r];
                    memcpy(p + 2, acc + r * D, (size_t)D * sizeof(float));
                }
            }
        }
        if (nsplit > 1) { /* merge the splits' softmax states; `scratch` holds one row */
            const int64_t used = a->cu_seqlens_q[B] - a->cu_seqlens_q[0];
            #pragma omp for schedule(static)
            for (int64_t row = 0; row < used * H; row++) {
                if (scratch == NULL) continue;
                const int64_t flat = a->cu_seqlens_q[0] * H + row;
                const float *p = part + flat * nsplit * (D + 2);
                float mx = PIPE_NEG_BIG, sum = 0.0f;
                for (int64_t i = 0; i < nsplit; i++) mx = p[i * (D + 2)] > mx ? p[i * (D + 2)] : mx;
                for (int64_t d = 0; d < D; d++) scratch[d] = 0.0f;
                for (int64_t i = 0; i < nsplit; i++) {
                    const float w = expf(p[i * (D + 2)] - mx), *pa = p + i * (D + 2) + 2;
                    sum += w * p[i * (D + 2) + 1];
                    for (int64_t d = 0; d < D; d++) scratch[d] += w * pa[d];
                }
                pipe_store_row(out + flat * D * esz, scratch, D, a->q_dtype, 1.0f / sum);
            }
        }
        free(scratch);
    }
    free(part);
    free(tile_end);
    if (oom) return PIPE_ENOMEM;
    const int64_t pad_from = a->cu_seqlens_q[B];
    if (pad_from < a->num_tokens)
        memset(out + pad_from * H * D * esz, 0, (size_t)((a->num_tokens - pad_from) * H * D * esz));
    return -1;
}

#endif
