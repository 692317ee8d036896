// Top-k selection with the window kept, CUDA: one block per (layer, row), a radix select of the
// threshold (4 passes of 8 bits over order-preserving integer keys, histogram in shared memory)
// and an ordered stream compaction that writes the kept positions ascending: no sort.
// Layers are a grid dimension, so every layer of a packed multi-layer selection is one launch.
//
// A NaN score is not an order: the kernel records the first (lowest) row holding one in *nan_row,
// for the caller to raise on, whatever the budget (also when only the window is kept).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ripplekv/common.h"
#include "ripplekv/select_topk.h"

namespace ripplekv {
namespace cuda {

// A selection launch: the shared parameters (select_topk.h) with budgets and offsets in device memory,
// or, for one layer, budgets == nullptr and the budget passed by value (no device array to fill, so
// the launch can be captured in a CUDA graph).
struct SelectTopKLaunch {
  SelectTopKPackedParams p;  // p.budgets, p.offsets: device [L], [L + 1], or nullptr with L == 1
  int64_t budget;            // the budget when p.budgets == nullptr (offset 0)
  unsigned long long* nan_row;  // device; atomicMin'ed with the flattened row (l * B + b) * H + h of a NaN
};

namespace detail {

// Larger float -> larger unsigned key; -0.0 maps like +0.0 so that they tie, as they compare.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive block-wide prefix sum of one int per thread; also returns the block total.
template <int kThreads>
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
    int w = lane < kThreads / 32 ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    if (lane < kThreads / 32) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - v;
  *total = warp_sums[kThreads / 32 - 1];
  __syncthreads();
  return before;
}

// grid: (B * H, L), block: kThreads. Counts are 64-bit: a row may hold more than 2^31 keys.
template <int kThreads>
__global__ void select_topk_kernel(SelectTopKLaunch launch) {
  const SelectTopKPackedParams& p = launch.p;
  __shared__ unsigned long long hist[256];
  __shared__ int warp_sums[kThreads / 32];
  __shared__ uint32_t prefix_s;
  __shared__ long long remaining_s;
  const int64_t row = blockIdx.x, l = blockIdx.y, b = row / p.H, h = row % p.H;
  const int64_t budget = p.budgets != nullptr ? p.budgets[l] : launch.budget;
  int64_t* out = p.indices + b * p.idx.b + h * p.idx.h + (p.offsets != nullptr ? p.offsets[l] : 0) * p.idx.c;
  if (p.N <= budget) {
    for (int64_t j = threadIdx.x; j < p.N; j += blockDim.x) out[j * p.idx.c] = j;
    return;
  }
  const int64_t n_prefix = p.N - p.W, keep = budget - p.W;
  const float* scores = p.scores + l * p.s_l + b * p.s.b + h * p.s.h;
  // Before anything else, and whatever keep is: budget == W keeps no prefix key but is still a selection.
  for (int64_t j = threadIdx.x; j < n_prefix; j += blockDim.x)
    if (isnan(scores[j * p.s.c])) {
      atomicMin(launch.nan_row, static_cast<unsigned long long>((l * p.B + b) * p.H + h));
      break;
    }
  for (int64_t t = threadIdx.x; t < p.W; t += blockDim.x) out[(keep + t) * p.idx.c] = n_prefix + t;
  if (keep <= 0) return;

  // Radix select of the keep-th largest key, most significant byte first.
  uint32_t prefix = 0, mask = 0;
  long long remaining = keep;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n_prefix; j += blockDim.x) {
      const uint32_t key = order_key(scores[j * p.s.c]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1ull);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      long long above = 0;
      int bin = 255;
      while (above + static_cast<long long>(hist[bin]) < remaining) above += hist[bin--];
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
  int64_t written = 0, ties_seen = 0;
  for (int64_t base = 0; base < n_prefix; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const bool valid = j < n_prefix;
    const uint32_t key = valid ? order_key(scores[j * p.s.c]) : 0u;
    const int tie = valid && key == prefix;
    int ties_in_chunk;
    const int64_t tie_rank = ties_seen + block_exclusive_scan<kThreads>(tie, warp_sums, &ties_in_chunk);
    const int keep_it = valid && (key > prefix || (tie && tie_rank < remaining));
    int kept_in_chunk;
    const int64_t slot = written + block_exclusive_scan<kThreads>(keep_it, warp_sums, &kept_in_chunk);
    if (keep_it) out[slot * p.idx.c] = j;
    written += kept_in_chunk;
    ties_seen += ties_in_chunk;
    if (written >= keep) break;  // block-uniform
  }
}

}  // namespace detail

constexpr int kSelectThreads = 512;

// Launches the selection of every (layer, row); *launch.nan_row must start at ~0ull (no NaN).
inline cudaError_t launch_select_topk(const SelectTopKLaunch& launch, cudaStream_t stream) {
  const SelectTopKPackedParams& p = launch.p;
  if (p.L == 0 || p.B * p.H == 0) return cudaSuccess;
  if (p.B * p.H > 0x7fffffff || p.L > 65535 || (p.budgets == nullptr && p.L != 1)) return cudaErrorInvalidValue;
  detail::select_topk_kernel<kSelectThreads>
      <<<dim3(static_cast<unsigned>(p.B * p.H), static_cast<unsigned>(p.L)), kSelectThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ripplekv
