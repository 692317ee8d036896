// Causal softmax attention mass of blocks of queries, CUDA, without the [queries, keys] matrix.
//
// Shared by SnapKV (queries = the observation window) and H2O (queries = every prompt position).
// Pass 1 (stats kernel): per query, the softmax max and normalizer over a split of the visible keys,
// updated online tile by tile; splits give long caches enough blocks. Pass 2 (accumulate kernel):
// per key tile and KV head, merge each query's splits, recompute the logits and add normalized
// probabilities over queries, then reduce over the query heads of the group. Scratch: the split
// statistics, O(B * H_q * Q * splits), and the per-key output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ripplekv/common.h"

namespace ripplekv {
namespace cuda {

constexpr int kQueryBlock = 32;  // queries per shared-memory block
constexpr int kKeyTile = 32;     // keys per shared-memory tile (one per lane)
constexpr int kThreads = 256;    // 8 warps: 8 query rows x 32 keys per step

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }

struct WindowAttentionParams {
  const void* queries;  // [B, H_q, *, D], strides q; query i of the block list sits at position pos0 + i
  const void* keys;     // [B, H_kv, N, D], strides k
  float* stats;         // [B * H_q, Q, splits, 2] (max, sum) partial softmax statistics
  float* out;           // [B, H_kv, n_out], strides o: group-reduced attention mass of keys [0, n_out)
  int64_t B, H_kv, G, Q, D, pos0, n_out, splits, split_len;
  Strides4 q, k;
  Strides3 o;
  float scale;
  int group_max;  // 1: max over the group's query heads, 0: mean
};

// Shared memory: queries [kQueryBlock][D], keys [kKeyTile][D + 1] (padding: lanes read distinct banks).
inline size_t window_attention_smem(int64_t D) {
  return sizeof(float) * (kQueryBlock * D + kKeyTile * (D + 1) + kQueryBlock * (kKeyTile + 1));
}

template <typename T>
__device__ void load_query_block(const WindowAttentionParams& p, const T* q_head, int64_t i0, float* q_s) {
  for (int64_t e = threadIdx.x; e < kQueryBlock * p.D; e += blockDim.x) {
    const int64_t i = e / p.D, d = e % p.D;
    q_s[e] = i0 + i < p.Q ? p.scale * load_float(q_head + (i0 + i) * p.q.n + d * p.q.d) : 0.0f;
  }
}

template <typename T>
__device__ void load_key_tile(const WindowAttentionParams& p, const T* k_row, int64_t j0, int64_t j_end, float* k_s) {
  for (int64_t e = threadIdx.x; e < kKeyTile * p.D; e += blockDim.x) {
    const int64_t t = e / p.D, d = e % p.D;
    k_s[t * (p.D + 1) + d] = j0 + t < j_end ? load_float(k_row + (j0 + t) * p.k.n + d * p.k.d) : 0.0f;
  }
}

// logit of (query row r of the block, key lane) from shared memory; -inf when masked or out of range.
__device__ __forceinline__ float tile_logit(const float* q_s, const float* k_s, int64_t D, int r, int lane,
                                            int64_t query_pos, int64_t key_pos, int64_t key_end) {
  if (key_pos > query_pos || key_pos >= key_end) return -INFINITY;
  const float* qr = q_s + r * D;
  const float* kr = k_s + lane * (D + 1);
  float acc = 0.0f;
  for (int64_t d = 0; d < D; ++d) acc = fmaf(qr[d], kr[d], acc);
  return acc;
}

// max that keeps a NaN (fmaxf drops it): a NaN or +inf logit must give NaN scores, as on the CPU and in
// the reference, not a silently finite softmax.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline int64_t query_blocks(int64_t Q) { return (Q + kQueryBlock - 1) / kQueryBlock; }

// grid: (B * H_q * query blocks, splits): B * H_q on x, whose limit is 2^31 - 1 (y allows 65,535 only).
// Each warp owns query rows warp, warp + 8, ... of the block and keeps their running (max, sum) in
// registers; lanes are keys of the tile.
template <typename T>
__global__ void window_stats_kernel(WindowAttentionParams p) {
  extern __shared__ float smem[];
  float* q_s = smem;
  float* k_s = q_s + kQueryBlock * p.D;
  const int64_t n_blocks = (p.Q + kQueryBlock - 1) / kQueryBlock;
  const int64_t bh = blockIdx.x / n_blocks, b = bh / (p.H_kv * p.G), h = bh % (p.H_kv * p.G), g = h / p.G;
  const int64_t i0 = (blockIdx.x % n_blocks) * static_cast<int64_t>(kQueryBlock);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q_head = static_cast<const T*>(p.queries) + b * p.q.b + h * p.q.h;
  const T* k_row = static_cast<const T*>(p.keys) + b * p.k.b + g * p.k.h;
  const int64_t last_query = min(i0 + kQueryBlock, p.Q) - 1;
  const int64_t j_begin = blockIdx.y * p.split_len;
  const int64_t j_end = min(j_begin + p.split_len, p.pos0 + last_query + 1);  // nothing later is visible
  load_query_block<T>(p, q_head, i0, q_s);
  constexpr int kRows = kQueryBlock / (kThreads / 32);
  float m[kRows], s[kRows];
  for (int r = 0; r < kRows; ++r) m[r] = -INFINITY, s[r] = 0.0f;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
    __syncthreads();
    load_key_tile<T>(p, k_row, j0, j_end, k_s);
    __syncthreads();
    for (int r = 0; r < kRows; ++r) {
      const int row = warp + r * (kThreads / 32);
      const float l = tile_logit(q_s, k_s, p.D, row, lane, p.pos0 + i0 + row, j0 + lane, j_end);
      const float new_max = nan_max(m[r], warp_max(l));
      if (new_max == -INFINITY) continue;  // everything so far masked (a NaN goes on, and stays)
      const float tile_sum = warp_sum(__expf(l - new_max));
      s[r] = s[r] * __expf(m[r] - new_max) + tile_sum;
      m[r] = new_max;
    }
  }
  if (lane == 0) {
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = i0 + warp + r * (kThreads / 32);
      if (i >= p.Q) continue;
      float* st = p.stats + ((bh * p.Q + i) * p.splits + blockIdx.y) * 2;
      st[0] = m[r];
      st[1] = s[r];
    }
  }
}

// grid: (B * H_kv * key tiles of [0, n_out)). Lane = key of the tile; warps split the query rows.
template <typename T>
__global__ void window_accumulate_kernel(WindowAttentionParams p) {
  extern __shared__ float smem[];
  float* q_s = smem;
  float* k_s = q_s + kQueryBlock * p.D;
  float* part = k_s + kKeyTile * (p.D + 1);  // [8 warps][32 keys], then [32] max and [32] 1/sum
  float* m_s = part + (kThreads / 32) * kKeyTile;
  float* inv_s = m_s + kQueryBlock;
  const int64_t n_tiles = (p.n_out + kKeyTile - 1) / kKeyTile;
  const int64_t row = blockIdx.x / n_tiles, b = row / p.H_kv, g = row % p.H_kv;
  const int64_t j0 = (blockIdx.x % n_tiles) * static_cast<int64_t>(kKeyTile);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* k_row = static_cast<const T*>(p.keys) + b * p.k.b + g * p.k.h;
  load_key_tile<T>(p, k_row, j0, p.n_out, k_s);
  float group_acc = p.group_max ? -INFINITY : 0.0f;  // meaningful in warp 0: lane = key
  // Queries before the key never see it: start at the first query block that can.
  const int64_t first_query = j0 > p.pos0 ? j0 - p.pos0 : 0;
  for (int64_t hl = 0; hl < p.G; ++hl) {
    const int64_t h = g * p.G + hl, bh = b * p.H_kv * p.G + h;
    const T* q_head = static_cast<const T*>(p.queries) + b * p.q.b + h * p.q.h;
    float head_acc = 0.0f;
    for (int64_t i0 = first_query / kQueryBlock * kQueryBlock; i0 < p.Q; i0 += kQueryBlock) {
      __syncthreads();
      load_query_block<T>(p, q_head, i0, q_s);
      if (threadIdx.x < kQueryBlock) {  // merge the query's split statistics
        const int64_t i = i0 + threadIdx.x;
        float m = -INFINITY, s = 0.0f;
        if (i < p.Q) {
          const float* st = p.stats + (bh * p.Q + i) * p.splits * 2;
          for (int64_t sp = 0; sp < p.splits; ++sp) m = nan_max(m, st[2 * sp]);
          for (int64_t sp = 0; sp < p.splits; ++sp)
            if (st[2 * sp] != -INFINITY) s += st[2 * sp + 1] * __expf(st[2 * sp] - m);
        }
        m_s[threadIdx.x] = m;
        inv_s[threadIdx.x] = (s > 0.0f || isnan(s)) ? 1.0f / s : 0.0f;  // NaN stays NaN
      }
      __syncthreads();
      for (int r = warp; r < kQueryBlock; r += kThreads / 32) {
        if (i0 + r >= p.Q) break;
        const float l = tile_logit(q_s, k_s, p.D, r, lane, p.pos0 + i0 + r, j0 + lane, p.n_out);
        if (l != -INFINITY) head_acc += __expf(l - m_s[r]) * inv_s[r];
      }
    }
    __syncthreads();
    part[warp * kKeyTile + lane] = head_acc;
    __syncthreads();
    if (warp == 0) {
      float head_sum = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) head_sum += part[w * kKeyTile + lane];
      group_acc = p.group_max ? ((head_sum > group_acc || isnan(head_sum)) ? head_sum : group_acc)
                              : group_acc + head_sum;
    }
  }
  if (warp == 0 && j0 + lane < p.n_out) {
    p.out[b * p.o.b + g * p.o.h + (j0 + lane) * p.o.c] =
        p.group_max ? group_acc : group_acc / static_cast<float>(p.G);
  }
}

// Runs both passes. stats must hold B * H_q * Q * splits * 2 floats. Nothing to do (no query, key or
// row) launches nothing: a zero grid dimension is an invalid configuration.
template <typename T>
cudaError_t launch_window_attention(const WindowAttentionParams& p, cudaStream_t stream) {
  const int64_t stats_blocks = p.B * p.H_kv * p.G * query_blocks(p.Q);
  const int64_t acc_blocks = p.B * p.H_kv * ((p.n_out + kKeyTile - 1) / kKeyTile);
  if (stats_blocks == 0 || p.splits == 0) return cudaSuccess;
  if (stats_blocks > 0x7fffffff || acc_blocks > 0x7fffffff || p.splits > 65535) return cudaErrorInvalidValue;
  const size_t smem = window_attention_smem(p.D);
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(window_stats_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(window_accumulate_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 stats_grid(static_cast<unsigned>(stats_blocks), static_cast<unsigned>(p.splits));
  window_stats_kernel<T><<<stats_grid, kThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.n_out == 0) return err;
  const dim3 acc_grid(static_cast<unsigned>(acc_blocks));
  window_accumulate_kernel<T><<<acc_grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ripplekv
