// The torch binding's side of the CPU SnapKV scoring driver (include/ripplekv/snapkv_parallel.h): ATen's
// thread pool and the store budget, RIPPLEKV_SNAPKV_STORE_MIB (MiB, 16 by default, 0 turns the store off).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>

#include "ripplekv/snapkv_parallel.h"

namespace ripplekv_ext {

// Bytes of stored exps the scoring may hold at once (read once per process).
inline int64_t snapkv_store_budget_bytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("RIPPLEKV_SNAPKV_STORE_MIB");
    const int64_t mib = env != nullptr && env[0] != '\0' ? std::max<int64_t>(0, std::atoll(env)) : 16;
    return mib << 20;
  }();
  return bytes;
}

template <typename T>
void snapkv_raw_scores_parallel(const ripplekv::SnapKVScoresParams& p, float* raw) {
  const ripplekv::SnapKVParallelOptions options{at::get_num_threads(), snapkv_store_budget_bytes()};
  ripplekv::snapkv_raw_scores_parallel<T>(
      p, raw, options, [](int64_t begin, int64_t end, const auto& body) { at::parallel_for(begin, end, 1, body); });
}

}  // namespace ripplekv_ext
