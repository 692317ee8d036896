// H2O heavy-hitter scores, CPU (docs/design.md §4): for every key, the causal attention mass it receives
// from every prompt query, summed per query head, then reduced over the head's group.
//
// Queries are processed in chunks: per row the scratch is the [G, N] running sums plus one chunk's
// O(G * chunk * (D + tile)), never the [N, N] attention matrix.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ripplekv/snapkv_scores.h"
#include "ripplekv/window_attention.h"
#include "ripplekv/window_attention_avx2.h"

namespace ripplekv {

struct H2OScoresParams {
  const void* queries;  // [B, H_q, N, D], strides q; query head h reads KV head h / G
  const void* keys;     // [B, H_kv, N, D], strides k
  float* scores;        // [B, H_kv, N], strides s
  int64_t B, H_kv, G, N, D, chunk_size;
  Strides4 q, k;
  Strides3 s;
  float scale;
  GroupReduce group_reduce;
};

namespace detail {

template <typename Attention, typename T>
Status h2o_scores_rows_with(const H2OScoresParams& p, int64_t row_begin, int64_t row_end) {
  if (p.chunk_size < 1 || p.G < 1) return Status::Error(StatusCode::kInvalidArgument, row_begin, p.chunk_size);
  std::vector<float> head_sums(p.G * p.N);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / p.H_kv, g = row % p.H_kv;
    const T* q = static_cast<const T*>(p.queries) + b * p.q.b + g * p.G * p.q.h;
    const T* k = static_cast<const T*>(p.keys) + b * p.k.b + g * p.k.h;
    std::fill(head_sums.begin(), head_sums.end(), 0.0f);
    for (int64_t c0 = 0; c0 < p.N; c0 += p.chunk_size) {
      const int64_t c1 = std::min(p.N, c0 + p.chunk_size);
      Attention attention(q + c0 * p.q.n, p.q.h, p.q.n, p.q.d, p.G, c1 - c0, p.D, c0, p.scale);
      attention.compute_normalizers(k, p.k.n, p.k.d);
      attention.accumulate(k, p.k.n, p.k.d, 0, c1, head_sums.data(), p.N);  // keys past c1 are all masked
    }
    float* out = p.scores + b * p.s.b + g * p.s.h;
    for (int64_t j = 0; j < p.N; ++j) out[j * p.s.c] = reduce_group(&head_sums[j], p.N, p.G, p.group_reduce);
  }
  return Status::Ok();
}

}  // namespace detail

// Scores of rows [row_begin, row_end) of the flattened (B * H_kv) grid, with the fastest
// window-attention kernel this CPU runs.
template <typename T>
Status h2o_scores_rows(const H2OScoresParams& p, int64_t row_begin, int64_t row_end) {
  return detail::visit_window_attention([&](auto tag) {
    return detail::h2o_scores_rows_with<typename decltype(tag)::type, T>(p, row_begin, row_end);
  });
}

}  // namespace ripplekv
