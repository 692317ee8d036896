// Argument validation shared by every op and both backends. Messages name the op, the argument,
// what was expected and what was given, so a user can fix the call without reading the source.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "ripplekv/common.h"

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

}  // namespace ripplekv_ext
