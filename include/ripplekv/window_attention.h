// Causal softmax attention mass of a block of queries, CPU, without the [queries, keys] matrix.
//
// Shared by SnapKV (the block is the observation window) and H2O (the block is a chunk of prompt
// queries). Two passes over the keys: the first finds each query's softmax max and normalizer
// online, tile by tile; the second recomputes the logits of a key tile and adds the normalized
// probabilities into per-head sums. Scratch is O(queries * (D + tile)), never O(queries * keys),
// unless the caller gives pass 1 a store to keep its exps in, so pass 2 need not recompute the
// logits (accumulate_stored): then the caller sizes and bounds that O(queries * keys) store.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ripplekv/numeric.h"

namespace ripplekv {
namespace detail {

class WindowAttention {
 public:
  static constexpr int64_t kKeyTile = 64;

  // G query heads x Q queries each; query i of every head sits at absolute position pos0 + i and
  // sees keys [0, pos0 + i]. Queries are read through strides and pre-multiplied by the scale.
  template <typename T>
  WindowAttention(const T* q, int64_t head_stride, int64_t query_stride, int64_t dim_stride, int64_t G,
                  int64_t Q, int64_t D, int64_t pos0, float scale)
      : G_(G), Q_(Q), D_(D), pos0_(pos0), rows_(G * Q),
        q_(rows_ * D), key_tile_(D * kKeyTile), logits_(rows_ * kKeyTile),
        max_(rows_, -std::numeric_limits<float>::infinity()), sum_(rows_, 0.0f), inv_sum_(rows_, 0.0f) {
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t d = 0; d < D; ++d) {
          const float v = scale * to_float(q[h * head_stride + i * query_stride + d * dim_stride]);
          q_[(h * Q + i) * D + d] = v;
        }
  }

  // Floats per key (and per key tile) of a probability store: one per query row.
  static int64_t store_width(int64_t G, int64_t Q) { return G * Q; }

  // Pass 1 over keys [j_begin, j_end) clipped to the visible [0, pos0 + Q): softmax max and normalizer
  // per query (online update). A sub-range gives partial statistics that merge_softmax_stats combines
  // (then import_stats); the default range gives the final ones.
  //
  // With `store` (j_begin a multiple of kKeyTile), it also keeps, for accumulate_stored, each visible
  // key's exp(logit - shift) at store[j * store_width + row] and each tile's shift (the running max it
  // was taken against) at tile_shifts[(j / kKeyTile) * store_width + row]: key j's absolute position
  // indexes both, so any tile-aligned sub-range writes its own part.
  template <typename T>
  void compute_normalizers(const T* keys, int64_t key_stride, int64_t dim_stride, int64_t j_begin = 0,
                           int64_t j_end = std::numeric_limits<int64_t>::max(), float* store = nullptr,
                           float* tile_shifts = nullptr) {
    const int64_t n_visible = std::min(pos0_ + Q_, j_end);
    for (int64_t j0 = j_begin; j0 < n_visible; j0 += kKeyTile) {
      const int64_t tile = std::min(kKeyTile, n_visible - j0);
      compute_logits(keys, key_stride, dim_stride, j0, tile);
      for (int64_t r = 0; r < rows_; ++r) {
        float* l = &logits_[r * kKeyTile];
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < tile; ++t) tile_max = l[t] > tile_max ? l[t] : tile_max;
        const float new_max = std::max(max_[r], tile_max);
        const bool masked = new_max == -std::numeric_limits<float>::infinity();  // fully masked so far
        if (store != nullptr) tile_shifts[(j0 / kKeyTile) * rows_ + r] = masked ? 0.0f : new_max;
        if (masked) {
          if (store != nullptr)
            for (int64_t t = 0; t < tile; ++t) store[(j0 + t) * rows_ + r] = 0.0f;  // exp(-inf)
          continue;
        }
        // Eight independent partial sums vectorize without reassociating a single sum.
        float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (store != nullptr) {
          for (int64_t t = 0; t < tile; ++t) {
            const float e = exp_nonpositive(l[t] - new_max);
            store[(j0 + t) * rows_ + r] = e;
            partial[t % 8] += e;
          }
        } else {
          for (int64_t t = 0; t < tile; ++t) partial[t % 8] += exp_nonpositive(l[t] - new_max);
        }
        float tile_sum = 0.0f;
        for (float p : partial) tile_sum += p;
        sum_[r] = sum_[r] * exp_nonpositive(max_[r] - new_max) + tile_sum;
        max_[r] = new_max;
      }
    }
    for (int64_t r = 0; r < rows_; ++r) inv_sum_[r] = 1.0f / sum_[r];
  }

  // The statistics of query i of head h at [h * Q + i] (what compute_normalizers found).
  void export_stats(float* max, float* sum) const {
    std::copy(max_.begin(), max_.end(), max);
    std::copy(sum_.begin(), sum_.end(), sum);
  }

  // Replaces the statistics (e.g. merged from key sub-ranges), in export_stats's layout.
  void import_stats(const float* max, const float* sum) {
    for (int64_t r = 0; r < rows_; ++r) {
      max_[r] = max[r];
      sum_[r] = sum[r];
      inv_sum_[r] = 1.0f / sum[r];
    }
  }

  // Pass 2 over keys [j_begin, j_end): head_sums[h * head_stride + (j - j_begin)] += sum over the
  // head's queries of p(query, j). Needs compute_normalizers first.
  template <typename T>
  void accumulate(const T* keys, int64_t key_stride, int64_t dim_stride, int64_t j_begin, int64_t j_end,
                  float* head_sums, int64_t head_stride) {
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
      const int64_t tile = std::min(kKeyTile, j_end - j0);
      compute_logits(keys, key_stride, dim_stride, j0, tile);
      for (int64_t h = 0; h < G_; ++h) {
        float* out = head_sums + h * head_stride + (j0 - j_begin);
        for (int64_t i = 0; i < Q_; ++i) {
          const int64_t r = h * Q_ + i;
          const float* l = &logits_[r * kKeyTile];
          const float m = max_[r], inv = inv_sum_[r];
          for (int64_t t = 0; t < tile; ++t) out[t] += exp_nonpositive(l[t] - m) * inv;
        }
      }
    }
  }

  // Pass 2 from what compute_normalizers kept in `store` / `tile_shifts` (same layout; j_begin a
  // multiple of kKeyTile), with the final statistics: no logits are recomputed. Key j's probability is
  // its stored exp(logit - shift) times exp(shift - max) / sum, a weight per query and tile.
  void accumulate_stored(const float* store, const float* tile_shifts, int64_t j_begin, int64_t j_end,
                         float* head_sums, int64_t head_stride) {
    std::vector<float> weight(rows_);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
      const int64_t tile = std::min(kKeyTile, j_end - j0);
      const float* shift = &tile_shifts[(j0 / kKeyTile) * rows_];
      for (int64_t r = 0; r < rows_; ++r) weight[r] = exp_nonpositive(shift[r] - max_[r]) * inv_sum_[r];
      for (int64_t h = 0; h < G_; ++h) {
        float* out = head_sums + h * head_stride + (j0 - j_begin);
        for (int64_t t = 0; t < tile; ++t) {
          const float* e = store + (j0 + t) * rows_ + h * Q_;
          for (int64_t i = 0; i < Q_; ++i) out[t] += e[i] * weight[h * Q_ + i];
        }
      }
    }
  }

 private:
  // logits_[r][t] = <q_r, k_{j0 + t}>, -inf where key j0 + t is in the future of query r.
  template <typename T>
  void compute_logits(const T* keys, int64_t key_stride, int64_t dim_stride, int64_t j0, int64_t tile) {
    // Keys transposed to [D][tile] so the inner loop is a contiguous multiply-add over keys.
    for (int64_t t = 0; t < tile; ++t) {
      const T* k = keys + (j0 + t) * key_stride;
      for (int64_t d = 0; d < D_; ++d) key_tile_[d * kKeyTile + t] = to_float(k[d * dim_stride]);
    }
    for (int64_t t = tile; t < kKeyTile; ++t)
      for (int64_t d = 0; d < D_; ++d) key_tile_[d * kKeyTile + t] = 0.0f;
    int64_t r = 0;
    for (; r + 4 <= rows_; r += 4) logits_block<4>(r);
    for (; r < rows_; ++r) logits_block<1>(r);
    if (pos0_ < j0 + tile - 1) {  // some query precedes some key of this tile
      for (int64_t h = 0; h < G_; ++h)
        for (int64_t i = 0; i < Q_; ++i) {
          const int64_t pos = pos0_ + i;
          float* l = &logits_[(h * Q_ + i) * kKeyTile];
          for (int64_t t = std::max<int64_t>(0, pos + 1 - j0); t < tile; ++t)
            l[t] = -std::numeric_limits<float>::infinity();
        }
    }
  }

  // Rows [r, r + R) of the logits tile, in blocks of kCols keys: the R x kCols accumulators stay in
  // registers for the whole reduction over D, so each key-tile load feeds R multiply-adds.
  template <int R>
  void logits_block(int64_t r) {
    constexpr int kCols = 8;
    for (int64_t t0 = 0; t0 < kKeyTile; t0 += kCols) {
      float acc[R][kCols] = {};
      const float* k = &key_tile_[t0];
      const float* q = &q_[r * D_];
      for (int64_t d = 0; d < D_; ++d, k += kKeyTile) {
        for (int x = 0; x < R; ++x) {
          const float qv = q[x * D_ + d];
          for (int t = 0; t < kCols; ++t) acc[x][t] += qv * k[t];
        }
      }
      for (int x = 0; x < R; ++x)
        for (int t = 0; t < kCols; ++t) logits_[(r + x) * kKeyTile + t0 + t] = acc[x][t];
    }
  }

  int64_t G_, Q_, D_, pos0_, rows_;
  std::vector<float> q_, key_tile_, logits_, max_, sum_, inv_sum_;
};

// Combines softmax statistics of one set of n queries over disjoint key ranges: chunk c's are at
// max[c * n + r], sum[c * n + r]. A chunk where a query saw no key (max -inf) adds nothing; a NaN
// anywhere stays NaN.
inline void merge_softmax_stats(const float* max, const float* sum, int64_t chunks, int64_t n, float* max_out,
                                float* sum_out) {
  for (int64_t r = 0; r < n; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, max[c * n + r]);
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float chunk_max = max[c * n + r];
      if (chunk_max == -std::numeric_limits<float>::infinity()) continue;
      total += sum[c * n + r] * exp_nonpositive(chunk_max - m);
    }
    max_out[r] = m;
    sum_out[r] = total;
  }
}

}  // namespace detail
}  // namespace ripplekv
