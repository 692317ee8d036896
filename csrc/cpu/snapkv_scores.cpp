#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../snapkv_scores.h"
#include "snapkv_parallel.h"

namespace ripplekv_ext {
namespace {

at::Tensor snapkv_scores_cpu(const at::Tensor& q_window, const at::Tensor& keys, int64_t kernel_size,
                             c10::string_view pooling, c10::string_view group_reduce, std::optional<double> scale) {
  constexpr const char* op = "snapkv_scores";
  check_window_inputs(q_window, keys, op);
  check_window_below_n(q_window, keys, op);
  check_kernel_size(kernel_size, op);
  auto scores = at::empty({keys.size(0), keys.size(1), keys.size(2) - q_window.size(2)},
                          keys.options().dtype(at::kFloat));
  const auto p = make_snapkv_scores_params(q_window, keys, scores.data_ptr<float>(), strides3(scores), kernel_size,
                                           pooling, group_reduce, scale, op);
  const int64_t n_prefix = p.N - p.W;
  std::vector<float> raw(p.B * p.H_kv * n_prefix);
  visit_float_type(keys.scalar_type(), [&](auto type_tag) {
    using T = decltype(type_tag);
    snapkv_raw_scores_parallel<T>(p, raw.data());
  });
  at::parallel_for(0, p.B * p.H_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      ripplekv::detail::pool_row(&raw[row * n_prefix], n_prefix, p.kernel_size, p.pooling,
                                 p.scores + (row / p.H_kv) * p.s.b + (row % p.H_kv) * p.s.h, p.s.c);
  });
  return scores;
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("snapkv_scores", &snapkv_scores_cpu); }

}  // namespace ripplekv_ext
