// select_topk_packed and gather_kv_packed: everything but the selection and the copy, shared by the
// CPU and CUDA bindings.
//
// Packed layout: layer l's kept tokens occupy [offsets[l], offsets[l + 1]) of the token dimension
// of one [B, H_kv, sum_l C_l, (D)] buffer, C_l = min(budgets[l], N) (cu_seqlens-style offsets).
#pragma once

#include "aten.h"

#include <string>
#include <tuple>
#include <vector>

#include <c10/core/DeviceGuard.h>

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

template <auto run>
std::tuple<at::Tensor, at::Tensor> select_topk_packed_op(const at::Tensor& scores, at::IntArrayRef budgets,
                                                         int64_t window) {
  constexpr const char* op = "select_topk_packed";
  const std::vector<int64_t> offsets = packed_offsets(scores, budgets, window, op);
  const c10::OptionalDeviceGuard guard(scores.device());
  auto indices = at::empty({scores.size(1), scores.size(2), offsets.back()}, scores.options().dtype(at::kLong));
  if (indices.numel() > 0) run(scores, budgets.vec(), offsets, window, indices, op);
  return {indices, at::tensor(offsets, at::kLong).to(scores.device())};
}

// keys, values: L tensors [B, H_kv, N, D] of one shape, dtype and device; indices_flat int64
// [B, H_kv, total]; offsets int64 [L + 1]; all on one device.
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
    check_one_device({{"keys[0]", &k0}, {k_name.c_str(), &keys[l]}, {v_name.c_str(), &values[l]}}, op);
  }
  check_rank(indices_flat, op, "indices_flat", 3, "[B, H_kv, total]");
  check_dtype(indices_flat, op, "indices_flat", at::kLong);
  check_rank(offsets, op, "offsets", 1, "[L + 1]");
  check_dtype(offsets, op, "offsets", at::kLong);
  check_one_device({{"keys[0]", &k0}, {"indices_flat", &indices_flat}, {"offsets", &offsets}}, op);
  check_size(indices_flat, 0, k0.size(0), op, "indices_flat", "B");
  check_size(indices_flat, 1, k0.size(1), op, "indices_flat", "H_kv");
  check_size(offsets, 0, static_cast<int64_t>(keys.size()) + 1, op, "offsets", "L + 1");
}

// The offsets themselves, read to the host (on CUDA one small copy: the output size depends on them anyway).
inline std::vector<int64_t> checked_offsets(const at::Tensor& offsets, int64_t total, const char* op) {
  const at::Tensor host = offsets.to(at::kCPU).contiguous();
  const std::vector<int64_t> v(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  TORCH_CHECK(v.front() == 0, op, ": offsets[0] must be 0, got ", v.front());
  for (size_t l = 0; l + 1 < v.size(); ++l)
    TORCH_CHECK(v[l + 1] >= v[l], op, ": offsets must be non-decreasing, got offsets[", l + 1, "] = ", v[l + 1],
                " < offsets[", l, "] = ", v[l]);
  TORCH_CHECK(v.back() == total, op, ": offsets[L] must equal indices_flat dim 2 (", total, "), got ", v.back());
  return v;
}

// run(keys, values, indices_flat, host offsets, device offsets, keys_out, values_out) copies validated rows.
template <auto run>
std::tuple<at::Tensor, at::Tensor> gather_kv_packed_op(at::TensorList keys, at::TensorList values,
                                                       const at::Tensor& indices_flat, const at::Tensor& offsets) {
  constexpr const char* op = "gather_kv_packed";
  check_gather_kv_packed_inputs(keys, values, indices_flat, offsets, op);
  const c10::OptionalDeviceGuard guard(keys[0].device());
  const std::vector<int64_t> off = checked_offsets(offsets, indices_flat.size(2), op);
  check_indices_in_range(indices_flat, keys[0].size(2), op, "indices_flat");
  const std::vector<int64_t> shape{keys[0].size(0), keys[0].size(1), indices_flat.size(2), keys[0].size(3)};
  at::Tensor keys_out = at::empty(shape, keys[0].options()), values_out = at::empty(shape, keys[0].options());
  if (keys_out.numel() > 0) run(keys, values, indices_flat, off, offsets, keys_out, values_out);
  return {keys_out, values_out};
}

}  // namespace ripplekv_ext
