/* Worker stage, CPU ops: the decoder layers of a small-batch step in one C call.
 *
 *   pipeline_cpu_decoder_layers: layers [first, num_layers) of a Llama-family decoder over
 *   T tokens (at most PIPE_GEMV_MAX_M with float32 weights, the int4 GEMV's rows with int4),
 *   with the same kernels, in the same order, as the Python loop of layers/fused_decoder.py
 *   (so the results are bit-identical): per layer the q/k/v projection, RoPE + KV write,
 *   paged attention, the o projection, add + RMSNorm, the MLP (pipe_decoder_mlp) and the
 *   next layer's add + RMSNorm.
 *
 * At batch 1 a layer is a few dozen microseconds of memory traffic, and ten Python-level
 * calls per layer cost about as much again; here the whole stack is one call with the GIL
 * released. Packed weights take any T (AMX tiles from two rows), so batches come here too.
 * The layer table (weights, norms, caches: fixed after load) is built once by the model;
 * the per-step arguments are the activation buffers and the batch metadata, which layer 0
 * (on the checked Python path) has validated. Projections are float32 [in, out]
 * (kn), bf16 or int8, both packed in blocks of 16 outputs, each multiplied by the GEMV or on AMX
 * tiles as LowpWeight.linear would (pipeline_cpu_linear_*, cpu_ops_amx_gemm.h), or int4
 * (cpu_ops_gemv_q4.h). Owns no state.
 */
#ifndef PIPELINE_CPU_OPS_DECODER_H
#define PIPELINE_CPU_OPS_DECODER_H

#include <stdint.h>
#include "cpu_ops_amx_gemm.h"
#include "cpu_ops_attn.h"
#include "cpu_ops_fused.h"
#include "cpu_ops_gemv.h"
#include "cpu_ops_gemv_i8.h"
#include "cpu_ops_gemv_lp.h"
#include "cpu_ops_gemv_q4.h"

enum { PIPE_W_F32_KN = 0, PIPE_W_BF16 = 1, PIPE_W_INT8 = 2, PIPE_W_INT4 = 3 };
enum { PIPE_PROJ_QKV = 0, PIPE_PROJ_O = 1, PIPE_PROJ_GATE_UP = 2, PIPE_PROJ_DOWN = 3 };

typedef struct {
    int fmt;
    const void *w[4];
    const float *scale[4];
    const float *bias[4];
    const float *ln_in, *ln_post;
    float eps_in, eps_post;
    char *k_cache, *v_cache;
    /* int4 only: scale[p] holds fp16 scales; zero points (NULL: symmetric), input
     * permutations (NULL: none) and group sizes (cpu_ops_gemv_q4.h) */
    const uint8_t *zero[4];
    const int32_t *perm[4];
    int64_t group_size[4];
} pipe_layer;

typedef struct {
    int64_t T, hidden, q_size, kv_size, num_heads, num_kv_heads, head_dim, inter;
    /* activations: residual, h, o, down [T, hidden]; qkv [T, q + 2kv]; attn [T, q];
     * gate_up [T, 2 inter]; act [T, inter] */
    float *residual, *h, *o, *down, *qkv, *attn, *gate_up, *act;
    const int64_t *positions, *slots;
    const float *cos, *sin;
    int64_t max_positions, num_slots;
    int cache_dtype;
    pipe_attn_args attn_args; /* q, dtype and q_dtype are set per layer */
} pipe_step;

/* y [T, N] = x [T, K] @ W^T for projection p of layer L. */
static int pipe_decoder_proj(const pipe_layer *L, int p, float *y, const float *x, int64_t T,
                             int64_t K, int64_t N) {
    if (L->fmt == PIPE_W_F32_KN) {
        pipeline_cpu_gemv(y, N, x, K, (const float *)L->w[p], L->bias[p], T, K, N, 1);
        return 0;
    }
    if (L->fmt == PIPE_W_BF16)
        return pipeline_cpu_linear_bf16(y, N, x, K, (const uint16_t *)L->w[p], L->bias[p], T, K, N);
    if (L->fmt == PIPE_W_INT4)
        return pipeline_cpu_gemv_q4(y, N, x, K, (const uint8_t *)L->w[p], (const uint16_t *)L->scale[p],
                                    L->zero[p], L->perm[p], L->bias[p], T, K, N, L->group_size[p]);
    return pipeline_cpu_linear_i8(y, N, x, K, (const int8_t *)L->w[p], L->scale[p], L->bias[p],
                                  T, K, N);
}

/* Whether every projection of every layer runs here for T rows: the Python loop keeps the
 * steps where one would not (its LowpWeight dequantises for BLAS there, e.g. int8 rows past
 * the GEMV's on a depth the AMX tiles do not take). K: the four projections' depths. */
static int pipe_decoder_takes(const pipe_layer *layers, int64_t n, int64_t T, const int64_t K[4]) {
    for (int64_t i = 0; i < n; i++)
        for (int p = 0; p < 4; p++) {
            const int fmt = layers[i].fmt;
            if ((fmt == PIPE_W_F32_KN && T > PIPE_GEMV_MAX_M)
                || (fmt == PIPE_W_BF16 && !pipe_linear_bf16_route(T, K[p]))
                || (fmt == PIPE_W_INT8 && !pipe_linear_i8_route(T, K[p])))
                return 0;
        }
    return 1;
}

/* The MLP as layers/fused_decoder.py runs it: bf16 without biases in one call (the
 * activation as the down product's bf16 tiles), else SwiGLU in the gate_up epilogue (bf16,
 * int8), else the projection, silu_and_mul and the down projection. Nonzero: out of memory. */
static int pipe_decoder_mlp(const pipe_layer *L, pipe_step *s, int64_t T, int64_t H, int64_t I) {
    const float *gub = L->bias[PIPE_PROJ_GATE_UP];
    int rc = 1;
    if (L->fmt == PIPE_W_BF16 && gub == NULL && L->bias[PIPE_PROJ_DOWN] == NULL)
        rc = pipeline_cpu_mlp_bf16(s->down, H, s->h, H, (const uint16_t *)L->w[PIPE_PROJ_GATE_UP],
                                   (const uint16_t *)L->w[PIPE_PROJ_DOWN], T, H, I);
    if (rc <= 0) return rc;
    if (gub == NULL && (L->fmt == PIPE_W_BF16 || L->fmt == PIPE_W_INT8))
        rc = pipeline_cpu_swiglu(s->act, I, s->h, H, L->w[PIPE_PROJ_GATE_UP],
                                 L->fmt == PIPE_W_INT8 ? L->scale[PIPE_PROJ_GATE_UP] : NULL, T, H, I);
    if (rc < 0) return rc;
    if (rc == 1) {
        if (pipe_decoder_proj(L, PIPE_PROJ_GATE_UP, s->gate_up, s->h, T, H, 2 * I)) return 1;
        pipeline_cpu_silu_and_mul(s->act, s->gate_up, T, I, 2 * I);
    }
    return pipe_decoder_proj(L, PIPE_PROJ_DOWN, s->down, s->act, T, I, H);
}

/* Returns -1 when done; else 4 * layer + what failed (0: scratch memory, 1: RoPE/cache
 * index, 2: attention metadata or memory), for the caller to redo that layer on the
 * checked path and raise its error. */
static int64_t pipeline_cpu_decoder_layers(const pipe_layer *layers, int64_t first,
                                           int64_t num_layers, pipe_step *s) {
    const int64_t T = s->T, H = s->hidden, qs = s->q_size, kvs = s->kv_size;
    const int64_t row = qs + 2 * kvs, I = s->inter;
    for (int64_t i = first; i < num_layers; i++) {
        const pipe_layer *L = layers + i;
        if (pipe_decoder_proj(L, PIPE_PROJ_QKV, s->qkv, s->h, T, H, row)) return 4 * i;
        if (pipeline_cpu_rope_and_cache(
                s->qkv, s->qkv + qs, s->qkv + qs + kvs, row, row, row, s->positions, s->cos,
                s->sin, s->max_positions, L->k_cache, L->v_cache, s->slots, T, s->num_heads,
                s->num_kv_heads, s->head_dim, s->num_slots, s->cache_dtype) >= 0)
            return 4 * i + 1;
        pipe_attn_args a = s->attn_args;
        a.q = (const char *)s->qkv;
        a.k_cache = L->k_cache;
        a.v_cache = L->v_cache;
        a.q_stride = row;
        a.dtype = s->cache_dtype;
        a.q_dtype = PIPE_F32;
        if (pipeline_cpu_paged_attention((char *)s->attn, &a) != -1) return 4 * i + 2;
        if (pipe_decoder_proj(L, PIPE_PROJ_O, s->o, s->attn, T, qs, H)) return 4 * i;
        pipeline_cpu_rms_norm(s->h, s->o, s->residual, L->ln_post, T, H, H, H, H, L->eps_post);
        if (pipe_decoder_mlp(L, s, T, H, I)) return 4 * i;
        if (i + 1 < num_layers) {
            pipeline_cpu_rms_norm(s->h, s->down, s->residual, layers[i + 1].ln_in, T, H, H, H,
                                  H, layers[i + 1].eps_in);
        } else {
            for (int64_t k = 0; k < T * H; k++) s->residual[k] += s->down[k];
        }
    }
    return -1;
}

#endif
