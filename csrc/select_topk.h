// select_topk and select_topk_packed: validation shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "checks.h"

namespace ripplekv_ext {

// scores: float32 [B, H_kv, N - W] (or [L, B, H_kv, N - W] when packed: rank given by the caller).
inline void check_scores(const at::Tensor& scores, int64_t rank, const char* layout, const char* op) {
  check_rank(scores, op, "scores", rank, layout);
  check_dtype(scores, op, "scores", at::kFloat);
}

inline void check_window_and_budget(int64_t n_prefix, int64_t window, int64_t budget, const char* op,
                                    const char* budget_name) {
  TORCH_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
  check_budget(budget, op, budget_name);
  const int64_t n = n_prefix + window;
  TORCH_CHECK(n <= budget || budget >= window, op, ": ", budget_name, " must be >= window (", window,
              ") when compressing (N = ", n, "), got ", budget);
}

inline int64_t kept_tokens(int64_t n, int64_t budget) { return std::min(n, budget); }

}  // namespace ripplekv_ext
