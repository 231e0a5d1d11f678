// Worker stage, CUDA ops: paged KV-cache write, paged attention and block copy kernels.
//
// Same contracts as the CPU kernels in cython_ext/cpu_ops_*.h (see pipeline_cuda.h). The
// attention kernel gives one thread block to each (query token, query head): its warps take
// interleaved keys of the token's causal range [0, position], each keeping an online-softmax
// state (max, sum, float32 accumulator; head_dim spread over the 32 lanes), and the warps'
// states are merged through shared memory at the end. One kernel therefore serves decode,
// chunked prefill and prefill with cached context in a single launch. Owns no state.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pipeline_cuda.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kNegBig = -1e30f;  // finite, so exp(a - b) is 0 or 1 and never NaN

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

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

// DPL: head_dim elements per lane, head_dim <= 32 * DPL.
template <typename T, int DPL>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int32_t* __restrict__ cu_seqlens_q,
    const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ block_tables,
    int num_seqs, int64_t q_stride, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks, float scale) {
  __shared__ float sm_m[kWarps], sm_l[kWarps];
  __shared__ float sm_acc[kWarps][DPL * 32];
  const int tok = blockIdx.x, head = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T* o = out + ((int64_t)tok * num_heads + head) * head_dim;

  // The token's sequence is the last b with cu_seqlens_q[b] <= tok (skips empty ones).
  int lo = 0, hi = num_seqs;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens_q[mid] <= tok) lo = mid; else hi = mid - 1;
  }
  if (lo >= num_seqs) {  // padding row past the last sequence
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = from_f32<T>(0.0f);
    return;
  }
  const int b = lo;
  const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  const int num_keys = seq_lens[b] - q_len + (tok - cu_seqlens_q[b]) + 1;  // causal
  const int kvh = head / (num_heads / num_kv_heads);
  const int64_t kv_row = (int64_t)num_kv_heads * head_dim;
  const int32_t* table = block_tables + (int64_t)b * max_blocks;

  float qr[DPL], acc[DPL];
  const T* qp = q + tok * q_stride + (int64_t)head * head_dim;
#pragma unroll
  for (int i = 0; i < DPL; i++) {
    const int d = lane + 32 * i;
    qr[i] = d < head_dim ? to_f32(qp[d]) * scale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = kNegBig, l = 0.0f;
  for (int k = warp; k < num_keys; k += kWarps) {
    const int64_t base = ((int64_t)table[k / block_size] * block_size + k % block_size) * kv_row +
                         (int64_t)kvh * head_dim;
    const T* kp = k_cache + base;
    const T* vp = v_cache + base;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      const int d = lane + 32 * i;
      if (d < head_dim) dot += qr[i] * to_f32(kp[d]);
    }
    dot = warp_sum(dot);
    const float m_new = fmaxf(m, dot);
    const float corr = __expf(m - m_new), p = __expf(dot - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < head_dim ? p * to_f32(vp[d]) : 0.0f);
    }
    m = m_new;
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < DPL; i++) sm_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float gm = kNegBig, gl = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; w++) gm = fmaxf(gm, sm_m[w]);
#pragma unroll
  for (int w = 0; w < kWarps; w++) gl += sm_l[w] * __expf(sm_m[w] - gm);
  const float inv = 1.0f / gl;  // gl > 0: key 0 is always visible
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) s += sm_acc[w][d] * __expf(sm_m[w] - gm);
    o[d] = from_f32<T>(s * inv);
  }
}

__global__ void copy_blocks_kernel(char* __restrict__ cache, const int64_t* __restrict__ pairs,
                                   int64_t block_bytes, bool vec16) {
  const int64_t src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  if (src == dst) return;
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

template <typename T, int DPL>
int launch_attention_dpl(void* out, const void* q, const void* k_cache, const void* v_cache,
                         const int32_t* cu, const int32_t* lens, const int32_t* tables,
                         int num_seqs, int num_tokens, int64_t q_stride, int num_heads,
                         int num_kv_heads, int head_dim, int block_size, int max_blocks,
                         float scale, cudaStream_t stream) {
  const dim3 grid((unsigned)num_tokens, (unsigned)num_heads);
  paged_attention_kernel<T, DPL><<<grid, kThreads, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(k_cache),
      static_cast<const T*>(v_cache), cu, lens, tables, num_seqs, q_stride, num_heads,
      num_kv_heads, head_dim, block_size, max_blocks, scale);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_attention(void* out, const void* q, const void* k_cache, const void* v_cache,
                     const int32_t* cu, const int32_t* lens, const int32_t* tables,
                     int num_seqs, int num_tokens, int64_t q_stride, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                     cudaStream_t stream) {
#define PIPE_ATTN(DPL)                                                                       \
  launch_attention_dpl<T, DPL>(out, q, k_cache, v_cache, cu, lens, tables, num_seqs,         \
                               num_tokens, q_stride, num_heads, num_kv_heads, head_dim,      \
                               block_size, max_blocks, scale, stream)
  if (head_dim <= 64) return PIPE_ATTN(2);
  if (head_dim <= 128) return PIPE_ATTN(4);
  return PIPE_ATTN(8);
#undef PIPE_ATTN
}

}  // namespace

extern "C" int pipeline_cuda_reshape_and_cache(
    const void* key, const void* value, void* k_cache, void* v_cache,
    const int64_t* slot_mapping, int64_t num_tokens, int64_t key_stride, int64_t value_stride,
    int64_t num_slots, int64_t num_kv_heads, int64_t head_dim, int dtype, void* stream) {
  if (num_tokens <= 0) return PIPELINE_CUDA_OK;
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

extern "C" int pipeline_cuda_paged_attention(
    void* out, const void* q, const void* k_cache, const void* v_cache,
    const int32_t* cu_seqlens_q, const int32_t* seq_lens, const int32_t* block_tables,
    int64_t num_seqs, int64_t num_tokens, int64_t q_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    int dtype, void* stream) {
  if (head_dim > PIPELINE_CUDA_MAX_HEAD_DIM) return PIPELINE_CUDA_EHEAD_DIM;
  if (num_tokens <= 0 || num_heads <= 0) return PIPELINE_CUDA_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define PIPE_ARGS                                                                            \
  out, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, (int)num_seqs,             \
      (int)num_tokens, q_stride, (int)num_heads, (int)num_kv_heads, (int)head_dim,           \
      (int)block_size, (int)max_blocks, scale, s
  switch (dtype) {
    case 0: return launch_attention<float>(PIPE_ARGS);
    case 1: return launch_attention<__nv_bfloat16>(PIPE_ARGS);
    case 2: return launch_attention<__half>(PIPE_ARGS);
    default: return PIPELINE_CUDA_EDTYPE;
  }
#undef PIPE_ARGS
}

extern "C" int pipeline_cuda_copy_blocks(void* const* caches, int64_t num_caches,
                                         const int64_t* pairs, int64_t num_pairs,
                                         int64_t block_bytes, void* stream) {
  if (num_pairs <= 0) return PIPELINE_CUDA_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // One launch per cache: copies are rare (copy-on-write of shared blocks), and it keeps the
  // pointer list on the host instead of staging it in device memory.
  for (int64_t c = 0; c < num_caches; c++) {
    char* base = static_cast<char*>(caches[c]);
    const bool vec16 = block_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
    copy_blocks_kernel<<<(unsigned)num_pairs, 256, 0, s>>>(base, pairs, block_bytes, vec16);
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
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}
