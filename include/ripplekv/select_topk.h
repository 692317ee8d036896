// Top-k selection with the observation window always kept, CPU (docs/design.md §4).
//
// Per row: the C - W best of the N - W prefix scores (ties to the lower position) plus the window
// [N - W, N), written ascending. A threshold from nth_element (O(n)) and one ascending scan
// replace a sort: positions above the threshold are kept, and of those equal to it, the lowest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "ripplekv/common.h"

namespace ripplekv {

struct SelectTopKParams {
  const float* scores;  // [B, H, N - W], strides s
  int64_t* indices;     // [B, H, C] with C = min(budget, N), strides idx
  int64_t B, H, N, W, budget;
  Strides3 s, idx;
};

// Several layers' selections in one call (packed layout: layer l's kept tokens occupy
// [offsets[l], offsets[l] + C_l) of each index row, C_l = min(budgets[l], N)). Shared with the CUDA
// launcher (select_topk.cuh), which reads budgets and offsets from device memory.
struct SelectTopKPackedParams {
  const float* scores;     // [L, B, H, N - W], strides s_l and s
  int64_t* indices;        // [B, H, total], strides idx
  const int64_t* budgets;  // [L]; budget >= W where N > budget (checked by select_topk_packed_rows on CPU)
  const int64_t* offsets;  // [L + 1]
  int64_t L, B, H, N, W, s_l;
  Strides3 s, idx;
};

namespace detail {

// One row. scratch holds at least N - W floats. Returns kNaN with the NaN's position.
inline Status select_topk_row(const float* scores, int64_t score_stride, int64_t n, int64_t w,
                              int64_t budget, int64_t* out, int64_t out_stride, int64_t row,
                              std::vector<float>& scratch) {
  if (n <= budget) {
    for (int64_t j = 0; j < n; ++j) out[j * out_stride] = j;
    return Status::Ok();
  }
  const int64_t n_prefix = n - w, keep = budget - w;
  scratch.resize(n_prefix);
  for (int64_t j = 0; j < n_prefix; ++j) {
    const float v = scores[j * score_stride];
    if (std::isnan(v)) return Status::Error(StatusCode::kNaN, row, j);
    scratch[j] = v;
  }
  int64_t t = 0;
  if (keep > 0) {
    // The keep-th largest value; everything above it is kept, ties at it go to the lowest positions.
    std::nth_element(scratch.begin(), scratch.begin() + (keep - 1), scratch.end(), std::greater<float>());
    const float threshold = scratch[keep - 1];
    int64_t above = 0;
    for (int64_t j = 0; j < n_prefix; ++j) above += scores[j * score_stride] > threshold;
    int64_t ties_left = keep - above;
    for (int64_t j = 0; j < n_prefix && t < keep; ++j) {
      const float v = scores[j * score_stride];
      if (v > threshold || (v == threshold && ties_left-- > 0)) out[(t++) * out_stride] = j;
    }
  }
  for (int64_t j = n_prefix; j < n; ++j) out[(t++) * out_stride] = j;
  return Status::Ok();
}

}  // namespace detail

// Rows [row_begin, row_end) of the flattened (B * H) grid. budget >= W is the caller's contract
// when N > budget (kInvalidArgument otherwise).
inline Status select_topk_rows(const SelectTopKParams& p, int64_t row_begin, int64_t row_end) {
  if (p.N > p.budget && p.budget < p.W) return Status::Error(StatusCode::kInvalidArgument, row_begin, p.budget);
  std::vector<float> scratch;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / p.H, h = row % p.H;
    const Status s = detail::select_topk_row(p.scores + b * p.s.b + h * p.s.h, p.s.c, p.N, p.W, p.budget,
                                             p.indices + b * p.idx.b + h * p.idx.h, p.idx.c, row, scratch);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// Rows [row_begin, row_end) of the flattened (L * B * H) grid (row = (l * B + b) * H + h); a NaN is
// reported with that flattened row.
inline Status select_topk_packed_rows(const SelectTopKPackedParams& p, int64_t row_begin, int64_t row_end) {
  std::vector<float> scratch;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t l = r / (p.B * p.H), b = r / p.H % p.B, h = r % p.H, budget = p.budgets[l];
    if (p.N > budget && budget < p.W) return Status::Error(StatusCode::kInvalidArgument, r, budget);
    const Status s = detail::select_topk_row(p.scores + l * p.s_l + b * p.s.b + h * p.s.h, p.s.c, p.N, p.W, budget,
                                             p.indices + b * p.idx.b + h * p.idx.h + p.offsets[l] * p.idx.c, p.idx.c,
                                             r, scratch);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace ripplekv
