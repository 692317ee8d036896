// SnapKV window scores, CPU (docs/design.md §4): for every prefix key, the attention mass it receives
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

template <typename A>
struct AttentionTag {
  using type = A;
};

// f(AttentionTag<K>{}) with K the fastest window-attention kernel this CPU runs (AVX2 or portable).
template <typename F>
decltype(auto) visit_window_attention(F&& f) {
#ifdef RIPPLEKV_HAS_AVX2_KERNELS
  if (window_attention_avx2_enabled()) return f(AttentionTag<WindowAttentionAvx2>{});
#endif
  return f(AttentionTag<WindowAttention>{});
}

// One row's window attention: its G heads' W window queries and its KV head's keys.
template <typename Attention, typename T>
Attention snapkv_row_attention(const SnapKVScoresParams& p, int64_t row, const T** keys) {
  const int64_t b = row / p.H_kv, g = row % p.H_kv;
  *keys = static_cast<const T*>(p.keys) + b * p.k.b + g * p.k.h;
  const T* q = static_cast<const T*>(p.q_window) + b * p.q.b + g * p.G * p.q.h;
  return Attention(q, p.q.h, p.q.n, p.q.d, p.G, p.W, p.D, p.N - p.W, p.scale);
}

// Pass 1 of one row over keys [j_begin, j_end): softmax max and normalizer of its G * W window queries
// (query i of head h at [h * W + i]), partial when the range is not all of [0, N). With `store`, it
// also keeps the range's exps for snapkv_raw_scores_with (layout: Attention::compute_normalizers).
template <typename Attention, typename T>
void snapkv_window_stats_with(const SnapKVScoresParams& p, int64_t row, int64_t j_begin, int64_t j_end, float* max,
                              float* sum, float* store = nullptr, float* tile_shifts = nullptr) {
  const T* k;
  Attention attention = snapkv_row_attention<Attention, T>(p, row, &k);
  attention.compute_normalizers(k, p.k.n, p.k.d, j_begin, j_end, store, tile_shifts);
  attention.export_stats(max, sum);
}

// head_sums[h * head_stride] reduced over the G heads of a group (mean or NaN-keeping max).
inline float reduce_group(const float* head_sums, int64_t head_stride, int64_t G, GroupReduce mode) {
  float acc = head_sums[0];
  for (int64_t h = 1; h < G; ++h)
    acc = mode == GroupReduce::kMax ? nan_max(acc, head_sums[h * head_stride]) : acc + head_sums[h * head_stride];
  return mode == GroupReduce::kMax ? acc : acc / static_cast<float>(G);
}

// Pass 2 with `attention`'s final statistics: the unpooled, group-reduced window mass of prefix keys
// [j_begin, j_end) into raw[0, j_end - j_begin). The per-head sums come from recomputed logits, or
// from `store` / `tile_shifts` when pass 1 kept them (then j_begin is a multiple of the key tile).
template <typename Attention, typename T>
void accumulate_raw_scores(Attention& attention, const T* k, const SnapKVScoresParams& p, int64_t j_begin,
                           int64_t j_end, float* raw, const float* store = nullptr,
                           const float* tile_shifts = nullptr) {
  constexpr int64_t tile_keys = Attention::kKeyTile;
  // Per-head sums for one key tile at a time, so the group max needs no [G, N] buffer.
  std::vector<float> head_sums(p.G * tile_keys);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += tile_keys) {
    const int64_t tile = std::min(tile_keys, j_end - j0);
    std::fill(head_sums.begin(), head_sums.end(), 0.0f);
    if (store != nullptr) {
      attention.accumulate_stored(store, tile_shifts, j0, j0 + tile, head_sums.data(), tile_keys);
    } else {
      attention.accumulate(k, p.k.n, p.k.d, j0, j0 + tile, head_sums.data(), tile_keys);
    }
    for (int64_t t = 0; t < tile; ++t) raw[j0 - j_begin + t] = reduce_group(&head_sums[t], tile_keys, p.G, p.group_reduce);
  }
}

// Pass 2 of one row over prefix keys [j_begin, j_end), given the row's final (merged) statistics and,
// optionally, what pass 1 stored for the row.
template <typename Attention, typename T>
void snapkv_raw_scores_with(const SnapKVScoresParams& p, int64_t row, const float* max, const float* sum,
                            int64_t j_begin, int64_t j_end, float* raw, const float* store = nullptr,
                            const float* tile_shifts = nullptr) {
  const T* k;
  Attention attention = snapkv_row_attention<Attention, T>(p, row, &k);
  attention.import_stats(max, sum);
  accumulate_raw_scores(attention, k, p, j_begin, j_end, raw, store, tile_shifts);
}

// Both passes over a whole row with one kernel object: raw[0, N - W).
template <typename Attention, typename T>
void snapkv_raw_scores_row_with(const SnapKVScoresParams& p, int64_t row, float* raw) {
  const T* k;
  Attention attention = snapkv_row_attention<Attention, T>(p, row, &k);
  attention.compute_normalizers(k, p.k.n, p.k.d);
  accumulate_raw_scores(attention, k, p, 0, p.N - p.W, raw);
}

// The same with the fastest kernel this CPU runs.
template <typename T>
void snapkv_raw_scores_row(const SnapKVScoresParams& p, int64_t row, float* raw) {
  visit_window_attention([&](auto tag) { snapkv_raw_scores_row_with<typename decltype(tag)::type, T>(p, row, raw); });
}

}  // namespace detail

// Pools rows [row_begin, row_end) of the (B * H_kv) grid's unpooled scores raw[row * (N - W) + j] into
// p.scores (what snapkv_raw_scores_parallel computes).
inline void pool_scores_rows(const SnapKVScoresParams& p, const float* raw, int64_t row_begin, int64_t row_end) {
  const int64_t n_prefix = p.N - p.W;
  for (int64_t row = row_begin; row < row_end; ++row)
    detail::pool_row(raw + row * n_prefix, n_prefix, p.kernel_size, p.pooling,
                     p.scores + (row / p.H_kv) * p.s.b + (row % p.H_kv) * p.s.h, p.s.c);
}

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
