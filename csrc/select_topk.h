// select_topk: everything but the selection itself, shared by the CPU and CUDA bindings (and by
// select_topk_packed and snapkv_compress, which select through the same backend runner).
//
// A backend runner selects rows of an [L, B, H_kv, N - W] score tensor into an index tensor at host
// offsets: run(scores4, budgets, offsets, window, indices, op), raising on NaN scores.
#pragma once

#include "aten.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <c10/core/DeviceGuard.h>

#include "checks.h"
#include "ripplekv/select_topk.h"

namespace ripplekv_ext {

// scores: float32 [B, H_kv, N - W] (or [L, B, H_kv, N - W] when packed: rank given by the caller).
inline void check_scores(const at::Tensor& scores, int64_t rank, const char* layout, const char* op) {
  check_rank(scores, op, "scores", rank, layout);
  check_dtype(scores, op, "scores", at::kFloat);
}

inline void check_window_and_budget(int64_t n_prefix, int64_t window, int64_t budget, const char* op,
                                    const char* budget_name) {
  TORCH_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
  // N = n_prefix + window must itself be a token count (no int64 overflow).
  TORCH_CHECK(window <= std::numeric_limits<int64_t>::max() - n_prefix, op, ": window (", window,
              ") is too large: N = scores.shape[-1] + window overflows int64");
  check_budget(budget, op, budget_name);
  const int64_t n = n_prefix + window;
  TORCH_CHECK(n <= budget || budget >= window, op, ": ", budget_name, " must be >= window (", window,
              ") when compressing (N = ", n, "), got ", budget);
}

inline int64_t kept_tokens(int64_t n, int64_t budget) { return std::min(n, budget); }

// The pointers and sizes of a selection; budgets and offsets point wherever the backend reads them.
inline ripplekv::SelectTopKPackedParams make_select_topk_params(const at::Tensor& scores4, const int64_t* budgets,
                                                                const int64_t* offsets, int64_t window,
                                                                at::Tensor& indices) {
  ripplekv::SelectTopKPackedParams p{};
  p.scores = scores4.data_ptr<float>();
  p.indices = indices.data_ptr<int64_t>();
  p.budgets = budgets;
  p.offsets = offsets;
  p.L = scores4.size(0);
  p.B = scores4.size(1);
  p.H = scores4.size(2);
  p.N = scores4.size(3) + window;
  p.W = window;
  p.s_l = scores4.stride(0);
  p.s = {scores4.stride(1), scores4.stride(2), scores4.stride(3)};
  p.idx = strides3(indices);
  return p;
}

// The error for a NaN score met in flattened row r = (l * B + b) * H + h (position j, or -1 if unknown).
[[noreturn]] inline void fail_nan_score(const char* op, int64_t r, int64_t j, int64_t B, int64_t H) {
  const int64_t layer = r / (B * H), row = r % (B * H);
  TORCH_CHECK(false, op, ": scores must not contain NaN, got NaN",
              j >= 0 ? " at position " + std::to_string(j) : std::string(), " of row ", row,
              " (row = b * H_kv + h)", layer > 0 ? " of layer " + std::to_string(layer) : std::string(),
              " (NaN or inf in q_window/queries or keys gives NaN scores)");
}

template <auto run>
at::Tensor select_topk_op(const at::Tensor& scores, int64_t budget, int64_t window) {
  constexpr const char* op = "select_topk";
  check_scores(scores, 3, "[B, H_kv, N - W]", op);
  check_window_and_budget(scores.size(2), window, budget, op, "budget");
  const c10::OptionalDeviceGuard guard(scores.device());
  const int64_t kept = kept_tokens(scores.size(2) + window, budget);
  auto indices = at::empty({scores.size(0), scores.size(1), kept}, scores.options().dtype(at::kLong));
  if (indices.numel() > 0) run(scores.unsqueeze(0), std::vector<int64_t>{budget}, std::vector<int64_t>{0, kept}, window,
                               indices, op);
  return indices;
}

}  // namespace ripplekv_ext
