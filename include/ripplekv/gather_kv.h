// KV gather, CPU: K_c[b, g, t] = K[b, g, idx[b, g, t]] (and the same for V).
//
// A "row" is one (b, g) pair; the caller splits rows across threads (at::parallel_for in the torch
// binding, a plain loop in the C++ test), so this file needs no threading library.
#pragma once

#include <cstring>

#include "ripplekv/common.h"

namespace ripplekv {

struct GatherKVParams {
  const void* keys;        // [B, H, N, D], strides k
  const void* values;      // [B, H, N, D], strides v
  const int64_t* indices;  // [B, H, C],    strides idx; every entry in [0, N)
  void* keys_out;          // [B, H, C, D], strides ko
  void* values_out;        // [B, H, C, D], strides vo
  int64_t B, H, N, C, D;
  Strides4 k, v, ko, vo;
  Strides3 idx;
};

// Gathers rows [row_begin, row_end) of the flattened (B * H) grid. T only fixes the element size:
// the gather copies bits, so one instantiation per width serves fp32, fp16 and bf16 alike.
template <typename T>
Status gather_kv_rows(const GatherKVParams& p, int64_t row_begin, int64_t row_end) {
  const T* keys = static_cast<const T*>(p.keys);
  const T* values = static_cast<const T*>(p.values);
  T* keys_out = static_cast<T*>(p.keys_out);
  T* values_out = static_cast<T*>(p.values_out);
  const bool rows_contiguous = p.k.d == 1 && p.v.d == 1 && p.ko.d == 1 && p.vo.d == 1;

  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / p.H;
    const int64_t h = row % p.H;
    const int64_t* idx_row = p.indices + b * p.idx.b + h * p.idx.h;
    for (int64_t t = 0; t < p.C; ++t) {
      const int64_t j = idx_row[t * p.idx.c];
      if (j < 0 || j >= p.N) {
        return Status::Error(StatusCode::kIndexOutOfRange, row, j);
      }
      const T* k_src = keys + b * p.k.b + h * p.k.h + j * p.k.n;
      const T* v_src = values + b * p.v.b + h * p.v.h + j * p.v.n;
      T* k_dst = keys_out + b * p.ko.b + h * p.ko.h + t * p.ko.n;
      T* v_dst = values_out + b * p.vo.b + h * p.vo.h + t * p.vo.n;
      if (rows_contiguous) {
        std::memcpy(k_dst, k_src, sizeof(T) * p.D);
        std::memcpy(v_dst, v_src, sizeof(T) * p.D);
      } else {
        for (int64_t d = 0; d < p.D; ++d) {
          k_dst[d * p.ko.d] = k_src[d * p.k.d];
          v_dst[d * p.vo.d] = v_src[d * p.v.d];
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace ripplekv
