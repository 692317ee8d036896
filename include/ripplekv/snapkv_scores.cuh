// SnapKV window scores, CUDA: the two window-attention passes (window_attention.cuh) write the
// group-reduced mass of every prefix key, then a pooling kernel applies the 1-D max/avg pool.
// The [B, H_q, W, N] probabilities never exist.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ripplekv/snapkv_scores.h"
#include "ripplekv/window_attention.cuh"

namespace ripplekv {
namespace cuda {

// Keys per split of the statistics pass: enough blocks for a long cache, few enough partials that
// merging them stays cheap (at most kMaxSplits per query).
constexpr int64_t kSplitLen = 1024;
constexpr int64_t kMaxSplits = 64;

inline int64_t snapkv_splits(int64_t N) {
  return std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, (N + kSplitLen - 1) / kSplitLen));
}

// Scratch floats the launcher needs: split statistics plus the unpooled scores.
inline int64_t snapkv_scores_workspace(const SnapKVScoresParams& p) {
  return p.B * p.H_kv * p.G * p.W * snapkv_splits(p.N) * 2 + p.B * p.H_kv * (p.N - p.W);
}

// raw: [rows, n] contiguous -> out[row * s.h-style strides] (rows = b * H + h).
template <bool pooling_max>
__global__ void pool_kernel(const float* __restrict__ raw, float* __restrict__ out, int64_t rows, int64_t H,
                            int64_t n, Strides3 s, int64_t kernel_size) {
  const int64_t total = rows * n;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / n, j = e % n, pad = kernel_size / 2;
    const int64_t lo = j > pad ? j - pad : 0, hi = j + pad + 1 < n ? j + pad + 1 : n;
    const float* r = raw + row * n;
    float acc = pooling_max ? -INFINITY : 0.0f;
    // fmaxf would drop a NaN score; keep it so the selection reports it.
    for (int64_t t = lo; t < hi; ++t) acc = pooling_max ? ((r[t] > acc || isnan(r[t])) ? r[t] : acc) : acc + r[t];
    out[(row / H) * s.b + (row % H) * s.h + j * s.c] = pooling_max ? acc : acc / static_cast<float>(kernel_size);
  }
}

// T: float, __half or __nv_bfloat16. workspace: snapkv_scores_workspace(p) floats of device memory.
template <typename T>
cudaError_t launch_snapkv_scores(const SnapKVScoresParams& p, float* workspace, cudaStream_t stream) {
  const int64_t n_prefix = p.N - p.W, rows = p.B * p.H_kv;
  WindowAttentionParams w{};
  w.queries = p.q_window;
  w.keys = p.keys;
  w.splits = snapkv_splits(p.N);
  w.split_len = (p.N + w.splits - 1) / w.splits;
  w.stats = workspace;
  w.out = workspace + p.B * p.H_kv * p.G * p.W * w.splits * 2;
  w.B = p.B;
  w.H_kv = p.H_kv;
  w.G = p.G;
  w.Q = p.W;
  w.D = p.D;
  w.pos0 = n_prefix;
  w.n_out = n_prefix;
  w.q = p.q;
  w.k = p.k;
  w.o = Strides3{p.H_kv * n_prefix, n_prefix, 1};
  w.scale = p.scale;
  w.group_max = p.group_reduce == GroupReduce::kMax;
  if (rows * n_prefix <= 0) return cudaSuccess;  // empty batch: nothing to launch
  cudaError_t err = launch_window_attention<T>(w, stream);
  if (err != cudaSuccess) return err;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((rows * n_prefix + 255) / 256, 65536));
  if (p.pooling == Pooling::kMax) {
    pool_kernel<true><<<blocks, 256, 0, stream>>>(w.out, p.scores, rows, p.H_kv, n_prefix, p.s, p.kernel_size);
  } else {
    pool_kernel<false><<<blocks, 256, 0, stream>>>(w.out, p.scores, rows, p.H_kv, n_prefix, p.s, p.kernel_size);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ripplekv
