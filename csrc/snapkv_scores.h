// snapkv_scores and snapkv_compress: everything but the scoring (and selection and gather), shared by the
// CPU and CUDA bindings. Each backend passes the op a runner that computes validated, non-empty calls.
#pragma once

#include "aten.h"

#include <cmath>
#include <limits>
#include <optional>
#include <string_view>
#include <tuple>

#include <c10/core/DeviceGuard.h>

#include "checks.h"
#include "rows.h"
#include "select_topk.h"
#include "ripplekv/snapkv_scores.h"

namespace ripplekv_ext {

// q_window: [B, H_q, W, D]; keys: [B, H_kv, N, D], same dtype and device. W is checked by the caller
// (scoring needs W < N; compression with nothing to compress accepts W <= N).
inline void check_window_inputs(const at::Tensor& q_window, const at::Tensor& keys, const char* op) {
  check_rank(q_window, op, "q_window", 4, "[B, H_q, W, D]");
  check_rank(keys, op, "keys", 4, "[B, H_kv, N, D]");
  check_float_dtype(q_window, op, "q_window");
  check_same_dtype(keys, q_window, op, "keys", "q_window");
  check_one_device({{"q_window", &q_window}, {"keys", &keys}}, op);
  check_size(keys, 0, q_window.size(0), op, "keys", "B");
  check_size(keys, 3, q_window.size(3), op, "keys", "D");
  check_head_dim(keys.size(3), op, "keys");
  check_group(q_window.size(1), keys.size(1), op, "q_window");
}

inline void check_window_below_n(const at::Tensor& q_window, const at::Tensor& keys, const char* op) {
  TORCH_CHECK(q_window.size(2) >= 1 && q_window.size(2) < keys.size(2), op,
              ": window W (q_window dim 2) must be in [1, N) = [1, ", keys.size(2), "), got ", q_window.size(2));
}

inline void check_kernel_size(int64_t kernel_size, const char* op) {
  TORCH_CHECK(kernel_size >= 1 && kernel_size % 2 == 1, op,
              ": kernel_size must be a positive odd number (pooling keeps the length), got ", kernel_size);
}

// values: like keys. W may equal N here (nothing to compress); the budget must leave room for the window.
inline void check_snapkv_compress_inputs(const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values,
                                         int64_t budget, int64_t kernel_size, std::string_view pooling,
                                         std::string_view group_reduce, const char* op) {
  check_window_inputs(q_window, keys, op);
  check_rank(values, op, "values", 4, "[B, H_kv, N, D]");
  check_same_dtype(values, keys, op, "values", "keys");
  check_one_device({{"q_window", &q_window}, {"keys", &keys}, {"values", &values}}, op);
  TORCH_CHECK(values.sizes() == keys.sizes(), op, ": values must have the shape of keys ", keys.sizes(), ", got ",
              values.sizes());
  check_kernel_size(kernel_size, op);
  parse_pooling(pooling, op);
  parse_group_reduce(group_reduce, op);
  const int64_t N = keys.size(2), W = q_window.size(2);
  TORCH_CHECK(W >= 1 && W <= N, op, ": window W (q_window dim 2) must be in [1, N] = [1, ", N, "], got ", W);
  check_window_and_budget(N - W, W, budget, op, "budget");
}

inline ripplekv::SnapKVScoresParams make_snapkv_scores_params(const at::Tensor& q_window, const at::Tensor& keys,
                                                              float* scores, ripplekv::Strides3 score_strides,
                                                              int64_t kernel_size, std::string_view pooling,
                                                              std::string_view group_reduce,
                                                              std::optional<double> scale, const char* op) {
  const int64_t D = keys.size(3);
  ripplekv::SnapKVScoresParams p{};
  p.q_window = q_window.data_ptr();
  p.keys = keys.data_ptr();
  p.scores = scores;
  p.B = keys.size(0);
  p.H_kv = keys.size(1);
  p.G = q_window.size(1) / keys.size(1);
  p.W = q_window.size(2);
  p.N = keys.size(2);
  p.D = D;
  p.q = strides4(q_window);
  p.k = strides4(keys);
  p.s = score_strides;
  p.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  p.kernel_size = kernel_size;
  p.pooling = parse_pooling(pooling, op);
  p.group_reduce = parse_group_reduce(group_reduce, op);
  return p;
}

// run(params, dtype): the pooled scores of params.scores (non-empty).
// With lengths (a left-padded batch, csrc/rows.h), row b is scored alone on its real keys [N - n_b, N) (softmax
// over them only, pooling padded at the row's own boundary); pad positions and rows with n_b <= W hold -inf.
template <auto run>
at::Tensor snapkv_scores_op(const at::Tensor& q_window, const at::Tensor& keys, int64_t kernel_size,
                            c10::string_view pooling, c10::string_view group_reduce, std::optional<double> scale,
                            const std::optional<at::Tensor>& lengths) {
  constexpr const char* op = "snapkv_scores";
  check_window_inputs(q_window, keys, op);
  check_window_below_n(q_window, keys, op);
  check_kernel_size(kernel_size, op);
  const int64_t B = keys.size(0), N = keys.size(2), W = q_window.size(2);
  const std::vector<int64_t> n = lengths.has_value() ? read_row_lengths(*lengths, B, N, keys.device(), op)
                                                     : std::vector<int64_t>();
  const c10::OptionalDeviceGuard guard(keys.device());
  auto scores = at::empty({B, keys.size(1), N - W}, keys.options().dtype(at::kFloat));
  if (!lengths.has_value()) {
    const auto p = make_snapkv_scores_params(q_window, keys, scores.data_ptr<float>(), strides3(scores), kernel_size,
                                             pooling, group_reduce, scale, op);
    if (scores.numel() > 0) run(p, keys.scalar_type());
    return scores;
  }
  parse_pooling(pooling, op);
  parse_group_reduce(group_reduce, op);
  scores.fill_(-std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < B; ++b) {
    if (n[b] <= W || scores.numel() == 0) continue;
    const at::Tensor row_keys = keys.narrow(0, b, 1).narrow(2, N - n[b], n[b]);
    at::Tensor row_scores = scores.narrow(0, b, 1).narrow(2, N - n[b], n[b] - W);
    const auto p = make_snapkv_scores_params(q_window.narrow(0, b, 1), row_keys, row_scores.data_ptr<float>(),
                                             strides3(row_scores), kernel_size, pooling, group_reduce, scale, op);
    run(p, keys.scalar_type());
  }
  return scores;
}

// run(score params, keys, values, budget, indices, keys_out, values_out): fills the three outputs of a
// non-empty call with N > budget.
template <auto run>
std::tuple<at::Tensor, at::Tensor, at::Tensor> snapkv_compress_op(
    const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values, int64_t budget, int64_t kernel_size,
    c10::string_view pooling, c10::string_view group_reduce, std::optional<double> scale) {
  constexpr const char* op = "snapkv_compress";
  check_snapkv_compress_inputs(q_window, keys, values, budget, kernel_size, pooling, group_reduce, op);
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2);
  const c10::OptionalDeviceGuard guard(keys.device());
  if (N <= budget) {  // nothing to compress: the whole cache, as fresh contiguous buffers
    return {keys.contiguous().clone(), values.contiguous().clone(),
            at::arange(N, keys.options().dtype(at::kLong)).expand({B, H, N}).contiguous()};
  }
  auto indices = at::empty({B, H, budget}, keys.options().dtype(at::kLong));
  const std::vector<int64_t> shape{B, H, budget, keys.size(3)};
  at::Tensor keys_out = at::empty(shape, keys.options()), values_out = at::empty(shape, keys.options());
  if (indices.numel() > 0) {
    const auto p = make_snapkv_scores_params(q_window, keys, nullptr, {0, 0, 0}, kernel_size, pooling, group_reduce,
                                             scale, op);
    run(p, keys, values, budget, indices, keys_out, values_out);
  }
  return {keys_out, values_out, indices};
}

}  // namespace ripplekv_ext
