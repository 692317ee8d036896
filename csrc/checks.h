// Argument validation shared by every op and both backends. Messages name the op, the argument,
// what was expected and what was given, so a user can fix the call without reading the source.
#pragma once

#include "aten.h"
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

// Every tensor an op reads or writes must be on one device (meta included): a mix would dispatch to
// one backend's kernel, or to the fake kernel, and read or return memory of another device.
inline void check_one_device(std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors,
                             const char* op) {
  const at::Device first = tensors.begin()->second->device();
  bool same = true;
  for (const auto& [name, t] : tensors) same = same && t->device() == first;
  if (same) return;
  std::string listing;
  for (const auto& [name, t] : tensors) listing += std::string(listing.empty() ? "" : ", ") + name + " on " + t->device().str();
  TORCH_CHECK(false, op, ": every tensor must be on one device, got ", listing);
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

// H_q = G * H_kv with G >= 1: returns G. (H_q = 0 would make a group of no query heads, whose mean
// is undefined: the reference raises too.)
inline int64_t check_group(int64_t h_q, int64_t h_kv, const char* op, const char* q_name) {
  TORCH_CHECK(h_kv > 0 && h_q > 0 && h_q % h_kv == 0, op, ": ", q_name, " heads (H_q = ", h_q,
              ") must be a positive multiple of the keys heads (H_kv = ", h_kv, ")");
  return h_q / h_kv;
}

// The logit scale defaults to 1/sqrt(D): D = 0 has no scale and no logits (the reference raises too).
inline void check_head_dim(int64_t d, const char* op, const char* name) {
  TORCH_CHECK(d >= 1, op, ": ", name, " head dimension D (dim 3) must be >= 1, got ", d);
}

// Byte range [first, last] of the memory a tensor's elements occupy.
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  intptr_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const intptr_t span = static_cast<intptr_t>((t.size(d) - 1) * t.stride(d)) * static_cast<intptr_t>(t.element_size());
    (span < 0 ? lo : hi) += span;
  }
  return {base + lo, base + hi + t.element_size() - 1};
}

// True when some element of t sits at the address of another: a stride-0 (expanded) dimension, or
// strides that interleave. The test is sufficient, not exact: with dimensions sorted by stride, each
// stride must step past everything the smaller ones span (slices and permutations of a buffer pass).
inline bool may_overlap_itself(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of dimensions with size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(std::abs(t.stride(d)), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // elements spanned by the dimensions so far, minus one
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += stride * (size - 1);
  }
  return false;
}

// An output written by an op must not have two elements at one address (the result would depend
// on write order, and on a GPU races).
inline void check_no_self_overlap(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.numel() == 0 || !may_overlap_itself(t), op, ": ", name,
              " must not have elements that share memory (an expanded or stride-0 view, strides ", t.strides(),
              "): write into a tensor of its own");
}

// An output must share no element with another tensor of the call: reading and writing one address
// gives a result that depends on the order of the copies (and races on a GPU). Exact: tensors whose
// byte ranges intersect but that at::get_overlap_status cannot decide (e.g. K and V interleaved in one
// buffer) compare their element addresses, O(n log n), which only such layouts pay.
inline void check_no_overlap(const at::Tensor& out, const char* out_name, const at::Tensor& other,
                             const char* other_name, const char* op) {
  if (out.numel() == 0 || other.numel() == 0) return;
  const auto [a0, a1] = byte_range(out);
  const auto [b0, b1] = byte_range(other);
  if (a1 < b0 || b1 < a0) return;
  bool overlap = true;
  const at::MemOverlapStatus status = at::get_overlap_status(out, other);
  if (status == at::MemOverlapStatus::No) {
    overlap = false;
  } else if (status == at::MemOverlapStatus::TooHard && out.element_size() == other.element_size() &&
             (reinterpret_cast<intptr_t>(out.data_ptr()) - reinterpret_cast<intptr_t>(other.data_ptr())) %
                     static_cast<intptr_t>(out.element_size()) == 0) {
    // Element offsets from a common base, compared as sets.
    const auto base = reinterpret_cast<intptr_t>(out.data_ptr());
    const auto offsets = [&](const at::Tensor& t) {
      const auto opts = at::TensorOptions().dtype(at::kLong).device(t.device());
      at::Tensor off = at::full({}, static_cast<int64_t>((reinterpret_cast<intptr_t>(t.data_ptr()) - base) / t.element_size()), opts);
      for (int64_t d = 0; d < t.dim(); ++d) {
        std::vector<int64_t> shape(t.dim(), 1);
        shape[d] = t.size(d);
        off = off + (at::arange(t.size(d), opts) * t.stride(d)).view(shape);
      }
      return off.reshape(-1);
    };
    overlap = at::isin(offsets(out), offsets(other)).any().item<bool>();
  }
  TORCH_CHECK(!overlap, op, ": ", out_name, " must not share memory with ", other_name,
              " (in-place or overlapping outputs are not supported: the copies would read what they overwrite); "
              "write into a separate buffer");
}

// The first index outside [lowest, n): its position ("i, j, k") and value. For error messages only, so it runs
// after a range check has already failed.
inline std::pair<std::string, int64_t> first_index_outside(const at::Tensor& indices, int64_t lowest, int64_t n) {
  const at::Tensor where = at::nonzero(indices.lt(lowest).logical_or(indices.ge(n)))[0].cpu();
  at::Tensor value = indices;
  std::string position;
  for (int64_t d = 0; d < where.numel(); ++d) {
    const int64_t i = where[d].item<int64_t>();
    value = value.select(0, i);
    position += (d ? ", " : "") + std::to_string(i);
  }
  return {position, value.item<int64_t>()};
}

// Every index in [0, n), checked before anything is written (one reduction; on CUDA one sync). The
// first offender is located only on failure, for the message.
inline void check_indices_in_range(const at::Tensor& indices, int64_t n, const char* op, const char* name) {
  if (indices.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(indices);
  if (lo.item<int64_t>() >= 0 && hi.item<int64_t>() < n) return;
  const auto [position, value] = first_index_outside(indices, 0, n);
  TORCH_CHECK(false, op, ": ", name, " must lie in [0, N) = [0, ", n, "), got ", value, " at [", position,
              "] (nothing was written)");
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
