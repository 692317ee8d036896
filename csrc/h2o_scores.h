// h2o_scores: validation shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

#include "checks.h"

namespace ripplekv_ext {

// queries: [B, H_q, N, D]; keys: [B, H_kv, N, D]; same dtype and device.
inline void check_h2o_inputs(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size, const char* op) {
  check_rank(queries, op, "queries", 4, "[B, H_q, N, D]");
  check_rank(keys, op, "keys", 4, "[B, H_kv, N, D]");
  check_float_dtype(queries, op, "queries");
  check_same_dtype(keys, queries, op, "keys", "queries");
  check_same_device(keys, queries, op, "keys", "queries");
  check_size(keys, 0, queries.size(0), op, "keys", "B");
  check_size(keys, 2, queries.size(2), op, "keys", "N");
  check_size(keys, 3, queries.size(3), op, "keys", "D");
  check_group(queries.size(1), keys.size(1), op, "queries");
  TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
}

}  // namespace ripplekv_ext
