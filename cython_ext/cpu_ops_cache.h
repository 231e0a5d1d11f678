/* Worker stage, CPU ops: writing K/V into the paged cache and copying cache blocks.
 *
 * The cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim]; a slot is
 * block * block_size + offset, so one token's K (or V) is one dense row of
 * num_kv_heads * head_dim elements. Both functions check every index before touching
 * memory and return the first bad one (or -1), so the Python side can raise a clear
 * error. They own no state and run without the GIL.
 */
#ifndef PIPELINE_CPU_OPS_CACHE_H
#define PIPELINE_CPU_OPS_CACHE_H

#include <stdint.h>
#include <string.h>
#include <omp.h>

/* Below this many bytes a parallel region costs more than the copy. */
#define PIPE_PAR_MIN_BYTES (256 * 1024)

static int64_t pipeline_cpu_reshape_and_cache(
        const char *key, const char *value, char *k_cache, char *v_cache,
        const int64_t *slot_mapping, int64_t num_tokens, int64_t key_stride,
        int64_t value_stride, int64_t num_blocks, int64_t block_size, int64_t row_elems,
        int64_t elem_size) {
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots) return t;
    const int64_t row_bytes = row_elems * elem_size;
    const int par = num_tokens * row_bytes * 2 >= PIPE_PAR_MIN_BYTES;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue; /* padding token */
        memcpy(k_cache + slot * row_bytes, key + t * key_stride * elem_size, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride * elem_size,
               (size_t)row_bytes);
    }
    return -1;
}

/* caches: num_caches base pointers (every layer's K then V); pairs: [num_pairs, 2]. */
static int64_t pipeline_cpu_copy_blocks(
        char *const *caches, int64_t num_caches, const int64_t *pairs, int64_t num_pairs,
        int64_t num_blocks, int64_t block_bytes) {
    for (int64_t i = 0; i < num_pairs; i++) {
        const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
        if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return i;
    }
    const int64_t work = num_caches * num_pairs;
    const int par = work * block_bytes >= PIPE_PAR_MIN_BYTES;
    #pragma omp parallel for schedule(static) if (par)
    for (int64_t w = 0; w < work; w++) {
        char *base = caches[w / num_pairs];
        const int64_t *p = pairs + 2 * (w % num_pairs);
        if (p[0] != p[1])
            memcpy(base + p[1] * block_bytes, base + p[0] * block_bytes, (size_t)block_bytes);
    }
    return -1;
}

#endif
