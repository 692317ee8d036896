// Fused SnapKV compression, CPU: score, select and gather one (b, g) row at a time.
//
// snapkv_compress_rows keeps each row's scores in a per-thread [N - W] buffer (beyond inputs and outputs
// O(threads * (N + G * W * (D + tile))) memory); the torch binding scores over (row, key range) tasks
// for load balance into a [B * H_kv, N - W] buffer, then calls snapkv_select_gather_rows. Neither
// holds the [B, H_q, W, N] probabilities: the binding keeps some rows' exps for its second pass, but
// never more than a fixed budget (csrc/cpu/snapkv_parallel.h), whatever B, H and N.
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

namespace detail {

inline bool snapkv_compress_params_ok(const SnapKVCompressParams& p) {
  const SnapKVScoresParams& sp = p.score;
  return sp.W >= 1 && sp.N - sp.W >= 1 && p.budget >= sp.W && p.budget < sp.N && sp.kernel_size % 2 == 1;
}

// Pool one row's unpooled scores row_raw[0, N - W), select its budget and gather it.
template <typename T>
Status snapkv_select_gather_row(const SnapKVCompressParams& p, int64_t row, const float* row_raw,
                                std::vector<float>& pooled, std::vector<float>& scratch) {
  const SnapKVScoresParams& sp = p.score;
  const int64_t n_prefix = sp.N - sp.W;
  pooled.resize(n_prefix);
  pool_row(row_raw, n_prefix, sp.kernel_size, sp.pooling, pooled.data(), 1);
  const int64_t b = row / sp.H_kv, g = row % sp.H_kv;
  const Status s = select_topk_row(pooled.data(), 1, sp.N, sp.W, p.budget, p.indices + b * p.idx.b + g * p.idx.h,
                                   p.idx.c, row, scratch);
  if (!s.ok()) return s;
  return gather_kv_rows<T>(p.gather, row, row + 1);
}

}  // namespace detail

// Select and gather rows [row_begin, row_end) of the (B * H_kv) grid from their unpooled scores
// raw[row * (N - W) + j] (split over key ranges by the caller for load balance, as the torch binding does).
template <typename T>
Status snapkv_select_gather_rows(const SnapKVCompressParams& p, const float* raw, int64_t row_begin, int64_t row_end) {
  if (!detail::snapkv_compress_params_ok(p)) return Status::Error(StatusCode::kInvalidArgument, row_begin, p.budget);
  const int64_t n_prefix = p.score.N - p.score.W;
  std::vector<float> pooled, scratch;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const Status s = detail::snapkv_select_gather_row<T>(p, row, raw + row * n_prefix, pooled, scratch);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// The whole op, one row at a time (scores in a per-row buffer): KV element type T (float, Half,
// BFloat16); rows [row_begin, row_end) of the (B * H_kv) grid.
template <typename T>
Status snapkv_compress_rows(const SnapKVCompressParams& p, int64_t row_begin, int64_t row_end) {
  if (!detail::snapkv_compress_params_ok(p)) return Status::Error(StatusCode::kInvalidArgument, row_begin, p.budget);
  std::vector<float> raw(p.score.N - p.score.W), pooled, scratch;
  for (int64_t row = row_begin; row < row_end; ++row) {
    detail::snapkv_raw_scores_row<T>(p.score, row, raw.data());
    const Status s = detail::snapkv_select_gather_row<T>(p, row, raw.data(), pooled, scratch);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace ripplekv
