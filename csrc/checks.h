// Argument validation shared by every op and both backends. Messages name the op, the argument,
// what was expected and what was given, so a user can fix the call without reading the source.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <string_view>

#include "ripplekv/common.h"
#include "ripplekv/numeric.h"
#include "ripplekv/options.h"

namespace ripplekv_ext {

inline void check_rank(const at::Tensor& t, const char* op, const char* name, int64_t rank,
                       const char* layout) {
  TORCH_CHECK(t.dim() == rank, op, ": ", name, " must be a ", rank, "-D tensor ", layout, ", got ",
              t.dim(), "-D with shape ", t.sizes());
}

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", dt);
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* name,
                        at::ScalarType expected) {
  TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, " must be ", expected, ", got ",
              t.scalar_type());
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* op,
                             const char* name, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the device of ", ref_name,
              " (", ref.device(), "), got ", t.device());
}

inline void check_size(const at::Tensor& t, int64_t dim, int64_t expected, const char* op,
                       const char* name, const char* what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, " dim ", dim, " (", what, ") must be ",
              expected, ", got ", t.size(dim), " (shape ", t.sizes(), ")");
}

inline ripplekv::Strides4 strides4(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

inline ripplekv::Strides3 strides3(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// Turns a kernel status into a TORCH_CHECK failure that says what was expected and where the
// offending value is (row = b * H + h of the flattened batch/head grid).
inline void check_status(const ripplekv::Status& s, const char* op, const char* name,
                         const std::string& expected) {
  TORCH_CHECK(s.ok(), op, ": ", name, " ", expected, ", got ", ripplekv::status_name(s.code), " (",
              s.value, ") in row ", s.row);
}

inline ripplekv::Pooling parse_pooling(std::string_view pooling, const char* op) {
  if (pooling == "max") return ripplekv::Pooling::kMax;
  if (pooling == "avg") return ripplekv::Pooling::kAvg;
  TORCH_CHECK(false, op, ": pooling must be 'max' or 'avg', got '", pooling, "'");
}

inline ripplekv::GroupReduce parse_group_reduce(std::string_view group_reduce, const char* op) {
  if (group_reduce == "mean") return ripplekv::GroupReduce::kMean;
  if (group_reduce == "max") return ripplekv::GroupReduce::kMax;
  TORCH_CHECK(false, op, ": group_reduce must be 'mean' or 'max', got '", group_reduce, "'");
}

inline void check_budget(int64_t budget, const char* op, const char* name) {
  TORCH_CHECK(budget >= 0, op, ": ", name, " must be a non-negative number of tokens, got ", budget);
}

// H_q = G * H_kv: returns G.
inline int64_t check_group(int64_t h_q, int64_t h_kv, const char* op, const char* q_name) {
  TORCH_CHECK(h_kv > 0 && h_q % h_kv == 0, op, ": ", q_name, " heads (H_q = ", h_q,
              ") must be a positive multiple of the keys heads (H_kv = ", h_kv, ")");
  return h_q / h_kv;
}

// Calls f(T{}) with the torch-free element type matching a float dtype (CPU kernels).
template <typename F>
void visit_float_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(ripplekv::Half{}); break;
    case at::kBFloat16: f(ripplekv::BFloat16{}); break;
    default: TORCH_CHECK(false, "ripplekv: unsupported dtype ", dtype);
  }
}

}  // namespace ripplekv_ext
