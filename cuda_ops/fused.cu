// Worker stage, CUDA ops: the elementwise steps of a decoder layer fused into one kernel each
// (half types): residual add + RMSNorm, SiLU(gate) * up, and rotary embedding in place.
//
// A batch-1 decode step of a 1B model on an H200 ran ~20 kernels a layer, 13 of them
// elementwise at 1-2 us apiece: 0.43 ms of a 1.85 ms step whose weights read in 0.58 ms
// (docs/gpu.md). Each kernel here replaces 2-5 of torch's and rounds where torch's chain
// rounds, so outputs match the unfused layer (transformers' order: the norm in float32, cast
// back before the weight multiply). Owns no state.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.h"
#include "pipeline_cuda.h"

namespace {

using pipeline_cuda::from_f32;
using pipeline_cuda::to_f32;
using pipeline_cuda::warp_sum;

constexpr int kNormThreads = 256;

template <typename T>
__device__ __forceinline__ float round_to(float v) {  // v as T holds it
  return to_f32(from_f32<T>(v));
}

// The sum of every thread's v over a block of kNormThreads, returned to all of them.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[kNormThreads / 32];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float s = threadIdx.x < kNormThreads / 32 ? part[threadIdx.x] : 0.0f;
    s = warp_sum(s);
    if (threadIdx.x == 0) part[0] = s;
  }
  __syncthreads();
  return part[0];
}

// One block per row: x += add (rounded to T, as torch's add), then
// h = T(weight * T(x * rsqrt(mean(x^2) + eps))).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(
    T* __restrict__ x, const T* __restrict__ add, T* __restrict__ h, const T* __restrict__ weight,
    int dim, float eps) {
  const int64_t row = blockIdx.x;
  T* xr = x + row * dim;
  const T* ar = add != nullptr ? add + row * dim : nullptr;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = to_f32(xr[i]);
    if (ar != nullptr) {
      v = round_to<T>(v + to_f32(ar[i]));
      xr[i] = from_f32<T>(v);
    }
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss) / dim + eps);
  T* hr = h + row * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x)
    hr[i] = from_f32<T>(to_f32(weight[i]) * round_to<T>(to_f32(xr[i]) * inv));
}

// The same for rows of dim % 8 == 0 up to kNormThreads * 8 * kChunks, 16-byte aligned: each
// thread loads 8 elements at once and keeps them in registers between the two passes (a
// batch-1 row is one block: the scalar loop's serial loads took 7 us of it on an H200).
template <typename T, int kChunks>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_vec_kernel(
    T* __restrict__ x, const T* __restrict__ add, T* __restrict__ h, const T* __restrict__ weight,
    int dim, float eps) {
  const int64_t row = blockIdx.x;
  const int nv = dim / 8;
  uint4* xr = reinterpret_cast<uint4*>(x + row * dim);
  const uint4* ar = add != nullptr ? reinterpret_cast<const uint4*>(add + row * dim) : nullptr;
  float v[kChunks][8];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; c++) {
    const int j = threadIdx.x + c * kNormThreads;
    if (j >= nv) continue;
    alignas(16) T xe[8];
    alignas(16) T ae[8];
    *reinterpret_cast<uint4*>(xe) = xr[j];
    if (ar != nullptr) *reinterpret_cast<uint4*>(ae) = ar[j];
#pragma unroll
    for (int e = 0; e < 8; e++) {
      float f = to_f32(xe[e]);
      if (ar != nullptr) {
        f = round_to<T>(f + to_f32(ae[e]));
        xe[e] = from_f32<T>(f);
      }
      v[c][e] = f;
      ss += f * f;
    }
    if (ar != nullptr) xr[j] = *reinterpret_cast<const uint4*>(xe);
  }
  const float inv = rsqrtf(block_sum(ss) / dim + eps);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  uint4* hr = reinterpret_cast<uint4*>(h + row * dim);
#pragma unroll
  for (int c = 0; c < kChunks; c++) {
    const int j = threadIdx.x + c * kNormThreads;
    if (j >= nv) continue;
    alignas(16) T we[8];
    alignas(16) T he[8];
    *reinterpret_cast<uint4*>(we) = wr[j];
#pragma unroll
    for (int e = 0; e < 8; e++) he[e] = from_f32<T>(to_f32(we[e]) * round_to<T>(v[c][e] * inv));
    hr[j] = *reinterpret_cast<const uint4*>(he);
  }
}

// out[r, i] = T(T(silu(g)) * u) with g = gate_up[r, i], u = gate_up[r, inter + i].
template <typename T>
__global__ void silu_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t rows,
                                int64_t inter) {
  const int64_t n = rows * inter;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = e / inter, i = e - r * inter;
    const float g = to_f32(gate_up[r * 2 * inter + i]);
    const float s = round_to<T>(g / (1.0f + expf(-g)));
    out[e] = from_f32<T>(s * to_f32(gate_up[r * 2 * inter + inter + i]));
  }
}

// Rotate-half RoPE in place on x [tokens, heads, head_dim] (rows row_stride apart) with the
// full-width tables cos = [c, c], sin = [-s, s] ([tokens, head_dim], T): out[d] =
// T(T(x[d] * cos[d]) + x[d +- D/2] * sin[d]). One block per (token, head); a thread owns the
// pair (d, d + D/2), reading both before writing either.
template <typename T>
__global__ void rotary_kernel(T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                              int heads, int head_dim, int64_t row_stride) {
  const int64_t tok = blockIdx.x;
  const int head = blockIdx.y, half = head_dim / 2;
  T* p = x + tok * row_stride + (int64_t)head * head_dim;
  const T* c = cos + tok * head_dim;
  const T* s = sin + tok * head_dim;
  for (int d = threadIdx.x; d < half; d += blockDim.x) {
    const float a = to_f32(p[d]), b = to_f32(p[d + half]);
    const float lo = round_to<T>(a * to_f32(c[d])) + b * to_f32(s[d]);
    const float hi = round_to<T>(b * to_f32(c[d + half])) + a * to_f32(s[d + half]);
    p[d] = from_f32<T>(lo);
    p[d + half] = from_f32<T>(hi);
  }
}

template <typename T>
int launch_norm(void* x, const void* add, void* h, const void* weight, int64_t rows, int64_t dim,
                float eps, cudaStream_t s) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (dim % 8 == 0 && dim <= kNormThreads * 8 * 4 && aligned(x) && aligned(h) && aligned(weight) &&
      (add == nullptr || aligned(add))) {
    auto* xt = static_cast<T*>(x);
    auto* at = static_cast<const T*>(add);
    auto* ht = static_cast<T*>(h);
    auto* wt = static_cast<const T*>(weight);
    if (dim <= kNormThreads * 8)
      add_rms_norm_vec_kernel<T, 1><<<(unsigned)rows, kNormThreads, 0, s>>>(xt, at, ht, wt, (int)dim, eps);
    else if (dim <= kNormThreads * 16)
      add_rms_norm_vec_kernel<T, 2><<<(unsigned)rows, kNormThreads, 0, s>>>(xt, at, ht, wt, (int)dim, eps);
    else
      add_rms_norm_vec_kernel<T, 4><<<(unsigned)rows, kNormThreads, 0, s>>>(xt, at, ht, wt, (int)dim, eps);
    return (int)cudaGetLastError();
  }
  add_rms_norm_kernel<T><<<(unsigned)rows, kNormThreads, 0, s>>>(
      static_cast<T*>(x), static_cast<const T*>(add), static_cast<T*>(h),
      static_cast<const T*>(weight), (int)dim, eps);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_silu(void* out, const void* gate_up, int64_t rows, int64_t inter, cudaStream_t s) {
  const int64_t n = rows * inter;
  int64_t blocks = (n + 255) / 256;
  if (blocks > 65535) blocks = 65535;
  silu_mul_kernel<T><<<(unsigned)blocks, 256, 0, s>>>(static_cast<T*>(out),
                                                       static_cast<const T*>(gate_up), rows, inter);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_rotary(void* x, const void* cos, const void* sin, int64_t tokens, int64_t heads,
                  int64_t head_dim, int64_t row_stride, cudaStream_t s) {
  const int half = (int)(head_dim / 2);
  const int threads = half >= 128 ? 128 : ((half + 31) / 32) * 32;
  rotary_kernel<T><<<dim3((unsigned)tokens, (unsigned)heads), threads, 0, s>>>(
      static_cast<T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin), (int)heads,
      (int)head_dim, row_stride);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int pipeline_cuda_add_rms_norm(void* x, const void* add, void* h, const void* weight,
                                          int64_t rows, int64_t dim, float eps, int dtype,
                                          void* stream) {
  if (rows <= 0 || dim <= 0) return PIPELINE_CUDA_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 1: return launch_norm<__nv_bfloat16>(x, add, h, weight, rows, dim, eps, s);
    case 2: return launch_norm<__half>(x, add, h, weight, rows, dim, eps, s);
    default: return PIPELINE_CUDA_EDTYPE;
  }
}

extern "C" int pipeline_cuda_silu_mul(void* out, const void* gate_up, int64_t rows, int64_t inter,
                                      int dtype, void* stream) {
  if (rows <= 0 || inter <= 0) return PIPELINE_CUDA_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 1: return launch_silu<__nv_bfloat16>(out, gate_up, rows, inter, s);
    case 2: return launch_silu<__half>(out, gate_up, rows, inter, s);
    default: return PIPELINE_CUDA_EDTYPE;
  }
}

extern "C" int pipeline_cuda_rotary(void* x, const void* cos, const void* sin, int64_t tokens,
                                    int64_t heads, int64_t head_dim, int64_t row_stride, int dtype,
                                    void* stream) {
  if (tokens <= 0 || heads <= 0 || head_dim <= 0) return PIPELINE_CUDA_OK;
  if (head_dim % 2 != 0 || head_dim > PIPELINE_CUDA_MAX_HEAD_DIM) return PIPELINE_CUDA_EHEAD_DIM;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 1: return launch_rotary<__nv_bfloat16>(x, cos, sin, tokens, heads, head_dim, row_stride, s);
    case 2: return launch_rotary<__half>(x, cos, sin, tokens, heads, head_dim, row_stride, s);
    default: return PIPELINE_CUDA_EDTYPE;
  }
}
