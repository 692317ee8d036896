// SnapKV window scores, CPU (DESIGN.md §4): for every prefix key, the attention mass it receives
// from the last W queries, reduced over each KV head's query group and pooled along positions.
//
// A row is one (b, g) pair of the [B, H_kv] grid; the caller spreads rows over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "ripplekv/numeric.h"
#include "ripplekv/options.h"
#include "ripplekv/window_attention.h"
#include "ripplekv/window_attention_avx2.h"

namespace ripplekv {

struct SnapKVScoresParams {
  const void* q_window;  // [B, H_q, W, D], strides q; H_q = G * H_kv, query head h reads KV head h / G
  const void* keys;      // [B, H_kv, N, D], strides k
  float* scores;         // [B, H_kv, N - W], strides s
  int64_t B, H_kv, G, W, N, D;
  Strides4 q, k;
  Strides3 s;
  float scale;           // logit scale (1/sqrt(D) by default; the binding resolves it)
  int64_t kernel_size;   // odd; 1 disables pooling
  Pooling pooling;
  GroupReduce group_reduce;
};

namespace detail {

// max that keeps a NaN (std::max drops it when it comes second), so a NaN score reaches the
// selection and is reported there, as torch's max_pool1d / amax propagate it in the reference.
inline float nan_max(float acc, float x) { return (x > acc || x != x) ? x : acc; }

// out[j] = pool(in)[j] with stride 1 and padding k / 2: max pads with -inf, avg counts the zero
// padding in the divisor (as avg_pool1d does by default).
inline void pool_row(const float* in, int64_t n, int64_t kernel_size, Pooling pooling, float* out,
                     int64_t out_stride) {
  const int64_t pad = kernel_size / 2;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t lo = std::max<int64_t>(0, j - pad), hi = std::min<int64_t>(n, j + pad + 1);
    float acc = pooling == Pooling::kMax ? -std::numeric_limits<float>::infinity() : 0.0f;
    for (int64_t t = lo; t < hi; ++t) acc = pooling == Pooling::kMax ? nan_max(acc, in[t]) : acc + in[t];
    out[j * out_stride] = pooling == Pooling::kMax ? acc : acc / static_cast<float>(kernel_size);
  }
}

// Unpooled, group-reduced window mass of every prefix key of one row into raw[0, N - W), with the
// window-attention kernel `Attention` (portable or AVX2).
template <typename Attention, typename T>
void snapkv_raw_scores_row_with(const SnapKVScoresParams& p, int64_t row, float* raw) {
  const int64_t b = row / p.H_kv, g = row % p.H_kv;
  const T* q = static_cast<const T*>(p.q_window) + b * p.q.b + g * p.G * p.q.h;
  const T* k = static_cast<const T*>(p.keys) + b * p.k.b + g * p.k.h;
  const int64_t n_prefix = p.N - p.W;
  constexpr int64_t tile_keys = Attention::kKeyTile;
  Attention attention(q, p.q.h, p.q.n, p.q.d, p.G, p.W, p.D, n_prefix, p.scale);
  attention.compute_normalizers(k, p.k.n, p.k.d);
  // Per-head sums for one key tile at a time, so the group max needs no [G, N] buffer.
  std::vector<float> head_sums(p.G * tile_keys);
  for (int64_t j0 = 0; j0 < n_prefix; j0 += tile_keys) {
    const int64_t tile = std::min(tile_keys, n_prefix - j0);
    std::fill(head_sums.begin(), head_sums.end(), 0.0f);
    attention.accumulate(k, p.k.n, p.k.d, j0, j0 + tile, head_sums.data(), tile_keys);
    for (int64_t t = 0; t < tile; ++t) {
      float acc = head_sums[t];
      for (int64_t h = 1; h < p.G; ++h)
        acc = p.group_reduce == GroupReduce::kMax ? nan_max(acc, head_sums[h * tile_keys + t])
                                                  : acc + head_sums[h * tile_keys + t];
      raw[j0 + t] = p.group_reduce == GroupReduce::kMax ? acc : acc / static_cast<float>(p.G);
    }
  }
}

// The same with the fastest window-attention kernel this CPU runs.
template <typename T>
void snapkv_raw_scores_row(const SnapKVScoresParams& p, int64_t row, float* raw) {
#ifdef RIPPLEKV_HAS_AVX2_KERNELS
  if (window_attention_avx2_enabled()) return snapkv_raw_scores_row_with<WindowAttentionAvx2, T>(p, row, raw);
#endif
  snapkv_raw_scores_row_with<WindowAttention, T>(p, row, raw);
}

}  // namespace detail

// Scores of rows [row_begin, row_end) of the flattened (B * H_kv) grid.
template <typename T>
Status snapkv_scores_rows(const SnapKVScoresParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t n_prefix = p.N - p.W;
  if (p.W < 1 || n_prefix < 1 || p.G < 1 || p.kernel_size < 1 || p.kernel_size % 2 == 0) {
    return Status::Error(StatusCode::kInvalidArgument, row_begin, p.W);
  }
  std::vector<float> raw(n_prefix);
  for (int64_t row = row_begin; row < row_end; ++row) {
    detail::snapkv_raw_scores_row<T>(p, row, raw.data());
    float* out = p.scores + (row / p.H_kv) * p.s.b + (row % p.H_kv) * p.s.h;
    detail::pool_row(raw.data(), n_prefix, p.kernel_size, p.pooling, out, p.s.c);
  }
  return Status::Ok();
}

}  // namespace ripplekv
