// gather_kv and gather_kv_into: everything but the copy itself, shared by the CPU and CUDA bindings.
// Each backend passes the op a `run(params, element_size)` that copies validated rows.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include <c10/core/DeviceGuard.h>

#include "checks.h"
#include "ripplekv/gather_kv.h"

namespace ripplekv_ext {

// keys, values: [B, H_kv, N, D]; indices: int64 [B, H_kv, C].
inline void check_gather_kv_inputs(const at::Tensor& keys, const at::Tensor& values,
                                   const at::Tensor& indices, const char* op) {
  check_rank(keys, op, "keys", 4, "[B, H_kv, N, D]");
  check_rank(values, op, "values", 4, "[B, H_kv, N, D]");
  check_rank(indices, op, "indices", 3, "[B, H_kv, C]");
  check_float_dtype(keys, op, "keys");
  check_same_dtype(values, keys, op, "values", "keys");
  check_dtype(indices, op, "indices", at::kLong);
  check_one_device({{"keys", &keys}, {"values", &values}, {"indices", &indices}}, op);
  TORCH_CHECK(values.sizes() == keys.sizes(), op, ": values must have the shape of keys ",
              keys.sizes(), ", got ", values.sizes());
  check_size(indices, 0, keys.size(0), op, "indices", "B");
  check_size(indices, 1, keys.size(1), op, "indices", "H_kv");
}

// keys_out, values_out: [B, H_kv, C, D], dtype and device of keys; no element shared with each other,
// with the inputs or within themselves (the copies would then depend on their order, and race on a GPU).
inline void check_gather_kv_outputs(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices,
                                    const at::Tensor& keys_out, const at::Tensor& values_out, const char* op) {
  check_one_device({{"keys", &keys}, {"keys_out", &keys_out}, {"values_out", &values_out}}, op);
  const std::vector<int64_t> expected{keys.size(0), keys.size(1), indices.size(2), keys.size(3)};
  for (const auto& [out, name] : {std::pair{&keys_out, "keys_out"}, {&values_out, "values_out"}}) {
    TORCH_CHECK(out->sizes() == at::IntArrayRef(expected), op, ": ", name, " must have shape ",
                at::IntArrayRef(expected), " [B, H_kv, C, D], got ", out->sizes());
    check_same_dtype(*out, keys, op, name, "keys");
    check_no_self_overlap(*out, op, name);
    check_no_overlap(*out, name, keys, "keys", op);
    check_no_overlap(*out, name, values, "values", op);
    check_no_overlap(*out, name, indices, "indices", op);
  }
  check_no_overlap(keys_out, "keys_out", values_out, "values_out", op);
}

inline ripplekv::GatherKVParams make_gather_kv_params(const at::Tensor& keys,
                                                      const at::Tensor& values,
                                                      const at::Tensor& indices,
                                                      at::Tensor& keys_out,
                                                      at::Tensor& values_out) {
  return {keys.data_ptr(),       values.data_ptr(),      indices.data_ptr<int64_t>(),
          keys_out.data_ptr(),   values_out.data_ptr(),  keys.size(0),
          keys.size(1),          keys.size(2),           indices.size(2),
          keys.size(3),          strides4(keys),         strides4(values),
          strides4(keys_out),    strides4(values_out),   strides3(indices)};
}

inline std::tuple<at::Tensor, at::Tensor> empty_gather_kv_outputs(const at::Tensor& keys,
                                                                  const at::Tensor& indices) {
  const std::vector<int64_t> shape{keys.size(0), keys.size(1), indices.size(2), keys.size(3)};
  return {at::empty(shape, keys.options()), at::empty(shape, keys.options())};
}

// gather_kv_into: every check (shapes, devices, overlap, index range) before anything is written, so
// a bad call leaves an engine's preallocated cache as it was.
template <auto run>
void gather_kv_into_op(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices,
                       at::Tensor& keys_out, at::Tensor& values_out) {
  constexpr const char* op = "gather_kv_into";
  check_gather_kv_inputs(keys, values, indices, op);
  check_gather_kv_outputs(keys, values, indices, keys_out, values_out, op);
  check_indices_in_range(indices, keys.size(2), op, "indices");
  if (keys_out.numel() == 0) return;
  const c10::OptionalDeviceGuard guard(keys.device());
  run(make_gather_kv_params(keys, values, indices, keys_out, values_out), keys.element_size());
}

template <auto run>
std::tuple<at::Tensor, at::Tensor> gather_kv_op(const at::Tensor& keys, const at::Tensor& values,
                                                const at::Tensor& indices) {
  constexpr const char* op = "gather_kv";
  check_gather_kv_inputs(keys, values, indices, op);
  check_indices_in_range(indices, keys.size(2), op, "indices");
  const c10::OptionalDeviceGuard guard(keys.device());
  auto [keys_out, values_out] = empty_gather_kv_outputs(keys, indices);
  if (keys_out.numel() > 0)
    run(make_gather_kv_params(keys, values, indices, keys_out, values_out), keys.element_size());
  return {keys_out, values_out};
}

}  // namespace ripplekv_ext
