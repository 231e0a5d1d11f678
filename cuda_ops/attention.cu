// Worker stage, CUDA ops: paged attention over a flattened varlen batch.
//
// Same contract as the CPU kernel in cython_ext/cpu_ops_attn.h (see pipeline_cuda.h). The
// kernel gives one thread block to each (query token, query head, context split): its warps
// take interleaved runs of keys of the token's causal range [0, position], each keeping an
// online-softmax state (max, sum, float32 accumulator; head_dim spread over the 32 lanes),
// and the warps' states are merged through shared memory at the end. When there are too few
// (token, head) pairs to fill the GPU (small-batch decode) the context is split across
// blocks and a second kernel merges the splits (flash-decoding). One launch serves decode,
// chunked prefill and prefill with cached context. Prefill is not tensor-core tiled. Owns no
// state besides the caller's workspace and a per-device SM count.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.h"
#include "pipeline_cuda.h"

namespace {

using pipeline_cuda::from_f32;
using pipeline_cuda::to_f32;
using pipeline_cuda::warp_sum;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;  // keys per warp step
constexpr int kMaxSplits = 32;
constexpr int kMinSplitKeys = 256;
constexpr float kNegBig = -1e30f;  // finite, so exp(a - b) is 0 or 1 and never NaN

// DPL: head_dim elements per lane, head_dim <= 32 * DPL. Block (token, head, split) covers
// the split-th of num_splits equal runs of the token's causal range (whole warp steps each);
// with one split it writes `out`, otherwise its unnormalised state (max, sum, acc[head_dim])
// goes to `partial` for combine_splits_kernel.
template <typename T, int DPL>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(
    T* __restrict__ out, float* __restrict__ partial, const T* __restrict__ q,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int32_t* __restrict__ cu_seqlens_q, const int32_t* __restrict__ seq_lens,
    const int32_t* __restrict__ block_tables, int num_seqs, int64_t q_stride, int num_heads,
    int num_kv_heads, int head_dim, int64_t num_blocks, int block_size, int max_blocks,
    float scale) {
  __shared__ float sm_m[kWarps], sm_l[kWarps];
  __shared__ float sm_acc[kWarps][DPL * 32];
  const int tok = blockIdx.x, head = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T* o = out + ((int64_t)tok * num_heads + head) * head_dim;

  // The token's sequence is the last b with cu_seqlens_q[b] <= tok (skips empty ones).
  int lo = 0, hi = num_seqs;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens_q[mid] <= tok) lo = mid; else hi = mid - 1;
  }
  if (lo >= num_seqs) {  // padding row past the last sequence (the combine zeroes it)
    if (num_splits == 1)
      for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = from_f32<T>(0.0f);
    return;
  }
  const int b = lo;
  const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  // Causal range, clamped to the table row so a too-long seq_len never reads the next row.
  const int num_keys =
      min(seq_lens[b] - q_len + (tok - cu_seqlens_q[b]) + 1, max_blocks * block_size);
  // The splits share the token's own range, not the table's width: a CUDA graph is captured
  // for the widest context, and a short one would leave all its keys to split 0 (a batch-1
  // decode of a 1B model spent 14 us a layer here so).
  constexpr int kStep = kWarps * kUnroll;
  const int per_split =
      num_splits == 1 ? num_keys : ((num_keys + num_splits - 1) / num_splits + kStep - 1) / kStep * kStep;
  const int k_begin = split * per_split;
  const int k_end = min(num_keys, k_begin + per_split);
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
  // Each warp takes kUnroll consecutive keys per step and issues all their K and V loads
  // before using any, so several cache rows are in flight per warp.
  for (int k0 = k_begin + warp * kUnroll; k0 < k_end; k0 += kWarps * kUnroll) {
    float kv[kUnroll][DPL], vv[kUnroll][DPL];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int k = k0 + u;
      const int64_t blk = k < k_end ? (int64_t)table[k / block_size] : -1;
      const bool valid = blk >= 0 && blk < num_blocks;  // a bad block id is left out, not read
      ok[u] = valid;
      const int64_t base =
          valid ? (blk * block_size + k % block_size) * kv_row + (int64_t)kvh * head_dim : 0;
#pragma unroll
      for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        const bool in = valid && d < head_dim;
        kv[u][i] = in ? to_f32(k_cache[base + d]) : 0.0f;
        vv[u][i] = in ? to_f32(v_cache[base + d]) : 0.0f;
      }
    }
    float score[kUnroll];
    float mx = m;
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; i++) dot += qr[i] * kv[u][i];
      dot = warp_sum(dot);
      score[u] = ok[u] ? dot : kNegBig;
      mx = fmaxf(mx, score[u]);
    }
    const float corr = __expf(m - mx);
    l *= corr;
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] *= corr;
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const float p = ok[u] ? __expf(score[u] - mx) : 0.0f;
      l += p;
#pragma unroll
      for (int i = 0; i < DPL; i++) acc[i] += p * vv[u][i];
    }
    m = mx;
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
  if (num_splits == 1) {
    const float inv = 1.0f / gl;  // gl > 0: key 0 is always visible
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; w++) s += sm_acc[w][d] * __expf(sm_m[w] - gm);
      o[d] = from_f32<T>(s * inv);
    }
    return;
  }
  // An empty split (k_begin past the causal range) leaves gm = kNegBig and gl = 0: its
  // weight in the combine is exp(kNegBig - max) = 0.
  float* part = partial + (((int64_t)tok * num_heads + head) * num_splits + split) * (head_dim + 2);
  if (threadIdx.x == 0) {
    part[0] = gm;
    part[1] = gl;
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) s += sm_acc[w][d] * __expf(sm_m[w] - gm);
    part[2 + d] = s;
  }
}

// Merges the num_splits partial states of one (token, head) into `out`.
template <typename T>
__global__ void combine_splits_kernel(T* __restrict__ out, const float* __restrict__ partial,
                                      const int32_t* __restrict__ cu_seqlens_q, int num_seqs,
                                      int num_heads, int head_dim, int num_splits) {
  const int tok = blockIdx.x, head = blockIdx.y;
  T* o = out + ((int64_t)tok * num_heads + head) * head_dim;
  if (tok >= cu_seqlens_q[num_seqs]) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = from_f32<T>(0.0f);
    return;
  }
  const int64_t stride = head_dim + 2;
  const float* part = partial + ((int64_t)tok * num_heads + head) * num_splits * stride;
  float gm = kNegBig, gl = 0.0f;
  for (int s = 0; s < num_splits; s++) gm = fmaxf(gm, part[s * stride]);
  for (int s = 0; s < num_splits; s++) gl += part[s * stride + 1] * __expf(part[s * stride] - gm);
  const float inv = 1.0f / gl;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < num_splits; s++)
      acc += part[s * stride + 2 + d] * __expf(part[s * stride] - gm);
    o[d] = from_f32<T>(acc * inv);
  }
}

struct AttnArgs {
  void* out;
  float* partial;
  const void *q, *k_cache, *v_cache;
  const int32_t *cu, *lens, *tables;
  int num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t num_blocks;
  int num_splits;
  int64_t q_stride;
  float scale;
};

template <typename T, int DPL>
int launch_attention_dpl(const AttnArgs& a, cudaStream_t stream) {
  const dim3 grid((unsigned)a.num_tokens, (unsigned)a.num_heads, (unsigned)a.num_splits);
  paged_attention_kernel<T, DPL><<<grid, kThreads, 0, stream>>>(
      static_cast<T*>(a.out), a.partial, static_cast<const T*>(a.q),
      static_cast<const T*>(a.k_cache), static_cast<const T*>(a.v_cache), a.cu, a.lens,
      a.tables, a.num_seqs, a.q_stride, a.num_heads, a.num_kv_heads, a.head_dim, a.num_blocks,
      a.block_size, a.max_blocks, a.scale);
  if (a.num_splits > 1) {
    const int threads = a.head_dim >= 128 ? 128 : ((a.head_dim + 31) / 32) * 32;
    combine_splits_kernel<T><<<dim3((unsigned)a.num_tokens, (unsigned)a.num_heads), threads, 0,
                               stream>>>(static_cast<T*>(a.out), a.partial, a.cu, a.num_seqs,
                                         a.num_heads, a.head_dim, a.num_splits);
  }
  return (int)cudaGetLastError();
}

template <typename T>
int launch_attention(const AttnArgs& a, cudaStream_t stream) {
  if (a.head_dim <= 64) return launch_attention_dpl<T, 2>(a, stream);
  if (a.head_dim <= 128) return launch_attention_dpl<T, 4>(a, stream);
  return launch_attention_dpl<T, 8>(a, stream);
}

int sm_count() {
  static int cached[64];  // per device; 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 1;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
      n = 1;
    cached[dev] = n;
  }
  return cached[dev];
}

}  // namespace

extern "C" int pipeline_cuda_attention_splits(int64_t num_tokens, int64_t num_heads,
                                              int64_t max_context) {
  // Split the context only when (token, head) blocks alone cannot fill the GPU twice over,
  // and never below kMinSplitKeys keys per split.
  const int64_t blocks = num_tokens * num_heads, target = 2 * (int64_t)sm_count();
  if (blocks <= 0 || blocks >= target) return 1;
  int64_t splits = (target + blocks - 1) / blocks;
  const int64_t cap = (max_context + kMinSplitKeys - 1) / kMinSplitKeys;
  if (splits > cap) splits = cap;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits < 1 ? 1 : (int)splits;
}

extern "C" int pipeline_cuda_paged_attention(
    void* out, const void* q, const void* k_cache, const void* v_cache,
    const int32_t* cu_seqlens_q, const int32_t* seq_lens, const int32_t* block_tables,
    int64_t num_seqs, int64_t num_tokens, int64_t q_stride, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
    int64_t max_blocks, float scale, int dtype, int num_splits, float* workspace, void* stream) {
  if (head_dim > PIPELINE_CUDA_MAX_HEAD_DIM) return PIPELINE_CUDA_EHEAD_DIM;
  if (num_splits < 1 || (num_splits > 1 && workspace == nullptr)) return PIPELINE_CUDA_ESPLITS;
  if (num_tokens <= 0 || num_heads <= 0 || head_dim <= 0) return PIPELINE_CUDA_OK;
  // GQA maps q head h to kv head h / (num_heads / num_kv_heads): it needs an exact multiple.
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return PIPELINE_CUDA_EHEADS;
  AttnArgs a;
  a.out = out;
  a.partial = workspace;
  a.q = q;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.cu = cu_seqlens_q;
  a.lens = seq_lens;
  a.tables = block_tables;
  a.num_seqs = (int)num_seqs;
  a.num_tokens = (int)num_tokens;
  a.num_heads = (int)num_heads;
  a.num_kv_heads = (int)num_kv_heads;
  a.head_dim = (int)head_dim;
  a.block_size = (int)block_size;
  a.max_blocks = (int)max_blocks;
  a.num_blocks = num_blocks;
  a.num_splits = num_splits;
  a.q_stride = q_stride;
  a.scale = scale;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_attention<float>(a, s);
    case 1: return launch_attention<__nv_bfloat16>(a, s);
    case 2: return launch_attention<__half>(a, s);
    default: return PIPELINE_CUDA_EDTYPE;
  }
}
