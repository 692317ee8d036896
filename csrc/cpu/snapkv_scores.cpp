#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../snapkv_scores.h"
#include "runners.h"
#include "snapkv_parallel.h"

namespace ripplekv_ext {

void run_snapkv_scores_cpu(const ripplekv::SnapKVScoresParams& p, at::ScalarType dtype) {
  const int64_t n_prefix = p.N - p.W;
  std::vector<float> raw(p.B * p.H_kv * n_prefix);
  visit_float_type(dtype, [&](auto type_tag) { snapkv_raw_scores_parallel<decltype(type_tag)>(p, raw.data()); });
  at::parallel_for(0, p.B * p.H_kv, 1, [&](int64_t begin, int64_t end) {
    ripplekv::pool_scores_rows(p, raw.data(), begin, end);
  });
}

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("snapkv_scores", &snapkv_scores_op<run_snapkv_scores_cpu>); }

}  // namespace ripplekv_ext
