// gather_kv: validation and parameter packing shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

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
  check_same_device(values, keys, op, "values", "keys");
  check_same_device(indices, keys, op, "indices", "keys");
  TORCH_CHECK(values.sizes() == keys.sizes(), op, ": values must have the shape of keys ",
              keys.sizes(), ", got ", values.sizes());
  check_size(indices, 0, keys.size(0), op, "indices", "B");
  check_size(indices, 1, keys.size(1), op, "indices", "H_kv");
}

// keys_out, values_out: [B, H_kv, C, D], dtype and device of keys.
inline void check_gather_kv_outputs(const at::Tensor& keys, const at::Tensor& indices,
                                    const at::Tensor& keys_out, const at::Tensor& values_out,
                                    const char* op) {
  const std::vector<int64_t> expected{keys.size(0), keys.size(1), indices.size(2), keys.size(3)};
  for (const auto& [out, name] : {std::pair{&keys_out, "keys_out"}, {&values_out, "values_out"}}) {
    TORCH_CHECK(out->sizes() == at::IntArrayRef(expected), op, ": ", name, " must have shape ",
                at::IntArrayRef(expected), " [B, H_kv, C, D], got ", out->sizes());
    check_same_dtype(*out, keys, op, name, "keys");
    check_same_device(*out, keys, op, name, "keys");
  }
  TORCH_CHECK(!keys_out.is_same(values_out), op, ": keys_out and values_out must be different tensors");
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

}  // namespace ripplekv_ext
