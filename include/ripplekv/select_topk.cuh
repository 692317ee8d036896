// Top-k selection with the window kept, CUDA: one block per (layer, row), a radix select of the
// threshold (4 passes of 8 bits over order-preserving integer keys, histogram in shared memory)
// and an ordered stream compaction that writes the kept positions ascending: no sort.
// Layers are a grid dimension, so every layer of a packed multi-layer selection is one launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ripplekv/common.h"

namespace ripplekv {
namespace cuda {

struct SelectTopKPackedParams {
  const float* scores;      // [L, B, H, N - W], strides s_l and s
  int64_t* indices;         // [B, H, total], strides idx; layer l writes [offsets[l], offsets[l] + C_l)
  const int64_t* budgets;   // device [L]; the host has checked budget >= W where N > budget
  const int64_t* offsets;   // device [L + 1]
  int* nan_flag;            // device int, set to 1 when a NaN score is met
  int64_t L, B, H, N, W, s_l;
  Strides3 s, idx;
};

constexpr int kSelectThreads = 512;

// Larger float -> larger unsigned key; -0.0 maps like +0.0 so that they tie, as they compare.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive block-wide prefix sum of one int per thread; also returns the block total.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kSelectThreads / 32 ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    if (lane < kSelectThreads / 32) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - v;
  *total = warp_sums[kSelectThreads / 32 - 1];
  __syncthreads();
  return before;
}

// grid: (B * H, L), block: kSelectThreads.
__global__ void select_topk_kernel(SelectTopKPackedParams p) {
  __shared__ int hist[256];
  __shared__ int warp_sums[kSelectThreads / 32];
  __shared__ uint32_t prefix_s;
  __shared__ int remaining_s;
  const int64_t row = blockIdx.x, l = blockIdx.y, b = row / p.H, h = row % p.H;
  const int64_t budget = p.budgets[l];
  int64_t* out = p.indices + b * p.idx.b + h * p.idx.h + p.offsets[l] * p.idx.c;
  if (p.N <= budget) {
    for (int64_t j = threadIdx.x; j < p.N; j += blockDim.x) out[j * p.idx.c] = j;
    return;
  }
  const int64_t n_prefix = p.N - p.W, keep = budget - p.W;
  const float* scores = p.scores + l * p.s_l + b * p.s.b + h * p.s.h;
  for (int64_t t = threadIdx.x; t < p.W; t += blockDim.x) out[(keep + t) * p.idx.c] = n_prefix + t;
  if (keep <= 0) return;

  // Radix select of the keep-th largest key, most significant byte first.
  uint32_t prefix = 0, mask = 0;
  int remaining = static_cast<int>(keep);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n_prefix; j += blockDim.x) {
      const float v = scores[j * p.s.c];
      if (shift == 24 && isnan(v)) atomicExch(p.nan_flag, 1);
      const uint32_t key = order_key(v);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0, bin = 255;
      while (above + hist[bin] < remaining) above += hist[bin--];
      prefix_s = prefix | (static_cast<uint32_t>(bin) << shift);
      remaining_s = remaining - above;
    }
    __syncthreads();
    prefix = prefix_s;
    remaining = remaining_s;
    mask |= 255u << shift;
    __syncthreads();
  }
  // prefix is the threshold key; `remaining` of the keys equal to it are kept, the lowest positions.
  int written = 0, ties_seen = 0;
  for (int64_t base = 0; base < n_prefix; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const uint32_t key = j < n_prefix ? order_key(scores[j * p.s.c]) : 0u;
    const bool valid = j < n_prefix;
    const int tie = valid && key == prefix;
    int ties_in_chunk;
    const int tie_rank = ties_seen + block_exclusive_scan(tie, warp_sums, &ties_in_chunk);
    const int keep_it = valid && (key > prefix || (tie && tie_rank < remaining));
    int kept_in_chunk;
    const int slot = written + block_exclusive_scan(keep_it, warp_sums, &kept_in_chunk);
    if (keep_it) out[slot * p.idx.c] = j;
    written += kept_in_chunk;
    ties_seen += ties_in_chunk;
    if (written >= keep) break;  // block-uniform
  }
}

inline cudaError_t launch_select_topk_packed(const SelectTopKPackedParams& p, cudaStream_t stream) {
  if (p.L == 0 || p.B * p.H == 0) return cudaSuccess;
  select_topk_kernel<<<dim3(static_cast<unsigned>(p.B * p.H), static_cast<unsigned>(p.L)), kSelectThreads, 0,
                       stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ripplekv
