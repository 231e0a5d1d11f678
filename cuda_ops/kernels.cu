// Worker stage, CUDA ops: writing K/V into the paged cache, copying cache blocks, and the
// error text of the C API (pipeline_cuda.h). Same contracts as cython_ext/cpu_ops_cache.h.
// Owns no state.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.h"
#include "pipeline_cuda.h"

namespace {

template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ k_cache, T* __restrict__ v_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int64_t key_stride, int64_t value_stride,
                                         int64_t num_slots, int row) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;  // padding token (or a bad slot: never write)
  const T* k = key + t * key_stride;
  const T* v = value + t * value_stride;
  T* kd = k_cache + slot * row;
  T* vd = v_cache + slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    kd[i] = k[i];
    vd[i] = v[i];
  }
}

__global__ void copy_blocks_kernel(char* __restrict__ cache, const int64_t* __restrict__ pairs,
                                   int64_t num_blocks, int64_t block_bytes, bool vec16) {
  const int64_t src = pairs[2 * (int64_t)blockIdx.x], dst = pairs[2 * (int64_t)blockIdx.x + 1];
  // A bad block id is skipped like a bad slot: never read or write outside the cache.
  if (src == dst || src < 0 || dst < 0 || src >= num_blocks || dst >= num_blocks) return;
  if (vec16) {
    const uint4* s = reinterpret_cast<const uint4*>(cache + src * block_bytes);
    uint4* d = reinterpret_cast<uint4*>(cache + dst * block_bytes);
    for (int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) d[i] = s[i];
  } else {
    const char* s = cache + src * block_bytes;
    char* d = cache + dst * block_bytes;
    for (int64_t i = threadIdx.x; i < block_bytes; i += blockDim.x) d[i] = s[i];
  }
}

template <typename T>
int launch_reshape(const void* key, const void* value, void* k_cache, void* v_cache,
                   const int64_t* slots, int64_t num_tokens, int64_t key_stride,
                   int64_t value_stride, int64_t num_slots, int row, cudaStream_t stream) {
  const int threads = row >= 256 ? 256 : ((row + 31) / 32) * 32;
  reshape_and_cache_kernel<T><<<(unsigned)num_tokens, threads, 0, stream>>>(
      static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(k_cache),
      static_cast<T*>(v_cache), slots, key_stride, value_stride, num_slots, row);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int pipeline_cuda_reshape_and_cache(
    const void* key, const void* value, void* k_cache, void* v_cache,
    const int64_t* slot_mapping, int64_t num_tokens, int64_t key_stride, int64_t value_stride,
    int64_t num_slots, int64_t num_kv_heads, int64_t head_dim, int dtype, void* stream) {
  if (num_tokens <= 0 || num_kv_heads <= 0 || head_dim <= 0) return PIPELINE_CUDA_OK;
  const int row = (int)(num_kv_heads * head_dim);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_reshape<float>(key, value, k_cache, v_cache, slot_mapping, num_tokens,
                                         key_stride, value_stride, num_slots, row, s);
    case 1: return launch_reshape<__nv_bfloat16>(key, value, k_cache, v_cache, slot_mapping,
                                                 num_tokens, key_stride, value_stride,
                                                 num_slots, row, s);
    case 2: return launch_reshape<__half>(key, value, k_cache, v_cache, slot_mapping, num_tokens,
                                          key_stride, value_stride, num_slots, row, s);
    default: return PIPELINE_CUDA_EDTYPE;
  }
}

extern "C" int pipeline_cuda_copy_blocks(void* const* caches, int64_t num_caches,
                                         const int64_t* pairs, int64_t num_pairs,
                                         int64_t num_blocks, int64_t block_bytes, void* stream) {
  if (num_pairs <= 0 || num_caches <= 0 || block_bytes <= 0) return PIPELINE_CUDA_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // One launch per cache: copies are rare (copy-on-write of shared blocks), and it keeps the
  // pointer list on the host instead of staging it in device memory.
  for (int64_t c = 0; c < num_caches; c++) {
    char* base = static_cast<char*>(caches[c]);
    const bool vec16 = block_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
    copy_blocks_kernel<<<(unsigned)num_pairs, 256, 0, s>>>(base, pairs, num_blocks, block_bytes,
                                                         vec16);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
  }
  return PIPELINE_CUDA_OK;
}

extern "C" const char* pipeline_cuda_error_string(int code) {
  switch (code) {
    case PIPELINE_CUDA_EDTYPE: return "unsupported dtype code (0=float32, 1=bfloat16, 2=float16)";
    case PIPELINE_CUDA_EHEAD_DIM: return "head_dim above PIPELINE_CUDA_MAX_HEAD_DIM (256)";
    case PIPELINE_CUDA_ENOMEM: return "host allocation failed";
    case PIPELINE_CUDA_ESPLITS: return "num_splits < 1, or > 1 without a workspace";
    case PIPELINE_CUDA_EHEADS: return "num_kv_heads must be >= 1 and divide num_heads";
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}
