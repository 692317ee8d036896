// h2o_scores: everything but the scoring, shared by the CPU and CUDA bindings. Each backend passes the op
// run(params, dtype), which scores a validated, non-empty call.
#pragma once

#include "aten.h"

#include <cmath>
#include <limits>
#include <vector>
#include <optional>
#include <string_view>

#include <c10/core/DeviceGuard.h>

#include "checks.h"
#include "rows.h"
#include "ripplekv/h2o_scores.h"

namespace ripplekv_ext {

// queries: [B, H_q, N, D]; keys: [B, H_kv, N, D]; same dtype and device.
inline void check_h2o_inputs(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size, const char* op) {
  check_rank(queries, op, "queries", 4, "[B, H_q, N, D]");
  check_rank(keys, op, "keys", 4, "[B, H_kv, N, D]");
  check_float_dtype(queries, op, "queries");
  check_same_dtype(keys, queries, op, "keys", "queries");
  check_one_device({{"queries", &queries}, {"keys", &keys}}, op);
  check_size(keys, 0, queries.size(0), op, "keys", "B");
  check_size(keys, 2, queries.size(2), op, "keys", "N");
  check_size(keys, 3, queries.size(3), op, "keys", "D");
  check_head_dim(keys.size(3), op, "keys");
  check_group(queries.size(1), keys.size(1), op, "queries");
  TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
}

// scores: fp32 [B, H_kv, N], allocated by the caller.
inline ripplekv::H2OScoresParams make_h2o_scores_params(const at::Tensor& queries, const at::Tensor& keys,
                                                        at::Tensor& scores, int64_t chunk_size,
                                                        std::optional<double> scale, std::string_view group_reduce,
                                                        const char* op) {
  const int64_t D = keys.size(3);
  ripplekv::H2OScoresParams p{};
  p.queries = queries.data_ptr();
  p.keys = keys.data_ptr();
  p.scores = scores.data_ptr<float>();
  p.B = keys.size(0);
  p.H_kv = keys.size(1);
  p.G = queries.size(1) / keys.size(1);
  p.N = keys.size(2);
  p.D = D;
  p.chunk_size = chunk_size;
  p.q = strides4(queries);
  p.k = strides4(keys);
  p.s = strides3(scores);
  p.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  p.group_reduce = parse_group_reduce(group_reduce, op);
  return p;
}

// With lengths (a left-padded batch, csrc/rows.h), row b is scored alone on its real queries and keys
// [N - n_b, N): pad keys get no attention, pad queries contribute nothing; pad positions hold -inf.
template <auto run>
at::Tensor h2o_scores_op(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size,
                         std::optional<double> scale, c10::string_view group_reduce,
                         const std::optional<at::Tensor>& lengths) {
  constexpr const char* op = "h2o_scores";
  check_h2o_inputs(queries, keys, chunk_size, op);
  const int64_t B = keys.size(0), N = keys.size(2);
  const std::vector<int64_t> n = lengths.has_value() ? read_row_lengths(*lengths, B, N, keys.device(), op)
                                                     : std::vector<int64_t>();
  const c10::OptionalDeviceGuard guard(keys.device());
  auto scores = at::empty({B, keys.size(1), N}, keys.options().dtype(at::kFloat));
  if (!lengths.has_value()) {
    const auto p = make_h2o_scores_params(queries, keys, scores, chunk_size, scale, group_reduce, op);
    if (scores.numel() > 0) run(p, keys.scalar_type());
    return scores;
  }
  parse_group_reduce(group_reduce, op);
  scores.fill_(-std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < B; ++b) {
    if (n[b] == 0 || scores.numel() == 0) continue;
    at::Tensor row_scores = scores.narrow(0, b, 1).narrow(2, N - n[b], n[b]);
    const auto p = make_h2o_scores_params(queries.narrow(0, b, 1).narrow(2, N - n[b], n[b]),
                                          keys.narrow(0, b, 1).narrow(2, N - n[b], n[b]), row_scores, chunk_size,
                                          scale, group_reduce, op);
    run(p, keys.scalar_type());
  }
  return scores;
}

}  // namespace ripplekv_ext
