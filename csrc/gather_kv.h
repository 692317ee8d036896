// gather_kv and gather_kv_into: everything but the copy itself, shared by the CPU and CUDA bindings.
// Each backend passes the op a `run(params, element_size)` that copies validated rows.
#pragma once

#include "aten.h"

#include <string>
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

// Every index in [0, N), or -1: a pad slot (as in the padded indices of select_topk_rows and
// snapkv_compress_rows), which the gather writes with zeros. Anything else raises before anything is written.
// Returns whether some index is -1. One reduction (on CUDA one sync); the offender is located only on failure.
inline bool check_gather_indices(const at::Tensor& indices, int64_t n, const char* op) {
  if (indices.numel() == 0) return false;
  const auto [lo, hi] = at::aminmax(indices);
  const int64_t lowest = lo.item<int64_t>();
  if (lowest >= -1 && hi.item<int64_t>() < n) return lowest == -1;
  const auto [position, value] = first_index_outside(indices, -1, n);
  TORCH_CHECK(false, op, ": indices must lie in [0, N) = [0, ", n, ") or be -1 (a pad slot, written with zeros), got ",
              value, " at [", position, "] (nothing was written)");
}

// The gather of checked indices. Pad slots (-1) gather position 0 (or nothing when N = 0), then are zeroed: the
// kernels stay those of a plain gather, and only calls with pad slots pay the two extra passes.
template <auto run>
void gather_with_pad_slots(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices, bool has_pad,
                           at::Tensor& keys_out, at::Tensor& values_out) {
  if (!has_pad) {
    run(make_gather_kv_params(keys, values, indices, keys_out, values_out), keys.element_size());
    return;
  }
  const at::Tensor pad = indices.eq(-1);
  if (keys.size(2) > 0) {
    const at::Tensor safe = indices.masked_fill(pad, 0);
    run(make_gather_kv_params(keys, values, safe, keys_out, values_out), keys.element_size());
  }
  keys_out.masked_fill_(pad.unsqueeze(-1), 0);
  values_out.masked_fill_(pad.unsqueeze(-1), 0);
}

// gather_kv_into: every check (shapes, devices, overlap, index range) before anything is written, so
// a bad call leaves an engine's preallocated cache as it was.
template <auto run>
void gather_kv_into_op(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices,
                       at::Tensor& keys_out, at::Tensor& values_out) {
  constexpr const char* op = "gather_kv_into";
  check_gather_kv_inputs(keys, values, indices, op);
  check_gather_kv_outputs(keys, values, indices, keys_out, values_out, op);
  const bool has_pad = check_gather_indices(indices, keys.size(2), op);
  if (keys_out.numel() == 0) return;
  const c10::OptionalDeviceGuard guard(keys.device());
  gather_with_pad_slots<run>(keys, values, indices, has_pad, keys_out, values_out);
}

template <auto run>
std::tuple<at::Tensor, at::Tensor> gather_kv_op(const at::Tensor& keys, const at::Tensor& values,
                                                const at::Tensor& indices) {
  constexpr const char* op = "gather_kv";
  check_gather_kv_inputs(keys, values, indices, op);
  const bool has_pad = check_gather_indices(indices, keys.size(2), op);
  const c10::OptionalDeviceGuard guard(keys.device());
  auto [keys_out, values_out] = empty_gather_kv_outputs(keys, indices);
  if (keys_out.numel() > 0) gather_with_pad_slots<run>(keys, values, indices, has_pad, keys_out, values_out);
  return {keys_out, values_out};
}

}  // namespace ripplekv_ext
