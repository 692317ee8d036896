// select_topk_packed and gather_kv_packed: validation shared by the CPU and CUDA bindings.
//
// Packed layout: layer l's kept tokens occupy [offsets[l], offsets[l + 1]) of the token dimension
// of one [B, H_kv, sum_l C_l, (D)] buffer, C_l = min(budgets[l], N) (cu_seqlens-style offsets).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "checks.h"
#include "select_topk.h"

namespace ripplekv_ext {

// Returns the host offsets [L + 1] of the packed layout for per-layer budgets.
inline std::vector<int64_t> packed_offsets(const at::Tensor& scores, at::IntArrayRef budgets, int64_t window,
                                           const char* op) {
  check_scores(scores, 4, "[L, B, H_kv, N - W]", op);
  const int64_t L = scores.size(0);
  TORCH_CHECK(static_cast<int64_t>(budgets.size()) == L, op, ": budgets must have L = ", L,
              " entries (scores dim 0), got ", budgets.size());
  std::vector<int64_t> offsets{0};
  for (int64_t l = 0; l < L; ++l) {
    const std::string name = "budgets[" + std::to_string(l) + "]";
    check_window_and_budget(scores.size(3), window, budgets[l], op, name.c_str());
    offsets.push_back(offsets.back() + kept_tokens(scores.size(3) + window, budgets[l]));
  }
  return offsets;
}

// keys, values: L tensors [B, H_kv, N, D] of one shape, dtype and device; indices_flat int64
// [B, H_kv, total]; offsets int64 [L + 1].
inline void check_gather_kv_packed_inputs(at::TensorList keys, at::TensorList values, const at::Tensor& indices_flat,
                                          const at::Tensor& offsets, const char* op) {
  TORCH_CHECK(!keys.empty(), op, ": keys must hold at least one layer, got 0");
  TORCH_CHECK(values.size() == keys.size(), op, ": values must hold as many layers as keys (", keys.size(), "), got ",
              values.size());
  const at::Tensor& k0 = keys[0];
  check_rank(k0, op, "keys[0]", 4, "[B, H_kv, N, D]");
  check_float_dtype(k0, op, "keys[0]");
  for (size_t l = 0; l < keys.size(); ++l) {
    const std::string k_name = "keys[" + std::to_string(l) + "]", v_name = "values[" + std::to_string(l) + "]";
    TORCH_CHECK(keys[l].sizes() == k0.sizes(), op, ": ", k_name, " must have the shape of keys[0] ", k0.sizes(),
                ", got ", keys[l].sizes());
    TORCH_CHECK(values[l].sizes() == k0.sizes(), op, ": ", v_name, " must have the shape of keys[0] ", k0.sizes(),
                ", got ", values[l].sizes());
    check_same_dtype(keys[l], k0, op, k_name.c_str(), "keys[0]");
    check_same_dtype(values[l], k0, op, v_name.c_str(), "keys[0]");
    check_same_device(keys[l], k0, op, k_name.c_str(), "keys[0]");
    check_same_device(values[l], k0, op, v_name.c_str(), "keys[0]");
  }
  check_rank(indices_flat, op, "indices_flat", 3, "[B, H_kv, total]");
  check_dtype(indices_flat, op, "indices_flat", at::kLong);
  check_same_device(indices_flat, k0, op, "indices_flat", "keys[0]");
  check_size(indices_flat, 0, k0.size(0), op, "indices_flat", "B");
  check_size(indices_flat, 1, k0.size(1), op, "indices_flat", "H_kv");
  check_rank(offsets, op, "offsets", 1, "[L + 1]");
  check_dtype(offsets, op, "offsets", at::kLong);
  check_size(offsets, 0, static_cast<int64_t>(keys.size()) + 1, op, "offsets", "L + 1");
}

// Host-side check of the offsets themselves (CPU, where reading them costs nothing).
inline void check_offsets_values(const std::vector<int64_t>& offsets, int64_t total, const char* op) {
  TORCH_CHECK(offsets.front() == 0, op, ": offsets[0] must be 0, got ", offsets.front());
  for (size_t l = 0; l + 1 < offsets.size(); ++l)
    TORCH_CHECK(offsets[l + 1] >= offsets[l], op, ": offsets must be non-decreasing, got offsets[", l + 1, "] = ",
                offsets[l + 1], " < offsets[", l, "] = ", offsets[l]);
  TORCH_CHECK(offsets.back() == total, op, ": offsets[L] must equal indices_flat dim 2 (", total, "), got ",
              offsets.back());
}

inline std::tuple<at::Tensor, at::Tensor> empty_packed_outputs(const at::Tensor& k0, const at::Tensor& indices_flat) {
  const std::vector<int64_t> shape{k0.size(0), k0.size(1), indices_flat.size(2), k0.size(3)};
  return {at::empty(shape, k0.options()), at::empty(shape, k0.options())};
}

}  // namespace ripplekv_ext
