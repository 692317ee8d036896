// Fused SnapKV compression, CPU: score, select and gather one (b, g) row at a time.
//
// Each row's scores live only in a per-thread [N - W] buffer, so beyond inputs and outputs the op
// needs O(threads * (N + G * W * (D + tile))) memory: no [B, H_q, W, N] probabilities and not even
// the [B, H_kv, N - W] score tensor.
#pragma once

#include <cstdint>
#include <vector>

#include "ripplekv/gather_kv.h"
#include "ripplekv/select_topk.h"
#include "ripplekv/snapkv_scores.h"

namespace ripplekv {

struct SnapKVCompressParams {
  SnapKVScoresParams score;  // score.scores and score.s are unused: scores stay in scratch
  GatherKVParams gather;     // gather.indices / gather.idx point at the index output [B, H_kv, C]
  int64_t* indices;          // [B, H_kv, C], strides idx (the same buffer as gather.indices)
  Strides3 idx;
  int64_t budget;            // C; the caller handles N <= budget (nothing to compress)
};

// KV element type T (float, Half, BFloat16); rows [row_begin, row_end) of the (B * H_kv) grid.
template <typename T>
Status snapkv_compress_rows(const SnapKVCompressParams& p, int64_t row_begin, int64_t row_end) {
  const SnapKVScoresParams& sp = p.score;
  const int64_t n_prefix = sp.N - sp.W;
  if (sp.W < 1 || n_prefix < 1 || p.budget < sp.W || p.budget >= sp.N || sp.kernel_size % 2 == 0) {
    return Status::Error(StatusCode::kInvalidArgument, row_begin, p.budget);
  }
  std::vector<float> raw(n_prefix), pooled(n_prefix), scratch;
  for (int64_t row = row_begin; row < row_end; ++row) {
    detail::snapkv_raw_scores_row<T>(sp, row, raw.data());
    detail::pool_row(raw.data(), n_prefix, sp.kernel_size, sp.pooling, pooled.data(), 1);
    const int64_t b = row / sp.H_kv, g = row % sp.H_kv;
    Status s = detail::select_topk_row(pooled.data(), 1, sp.N, sp.W, p.budget,
                                       p.indices + b * p.idx.b + g * p.idx.h, p.idx.c, row, scratch);
    if (!s.ok()) return s;
    s = gather_kv_rows<T>(p.gather, row, row + 1);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace ripplekv
