#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../snapkv_scores.h"

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
  visit_float_type(keys.scalar_type(), [&](auto type_tag) {
    using T = decltype(type_tag);
    // A row costs O(G * W * N * D): one row per task already amortizes the threading.
    at::parallel_for(0, p.B * p.H_kv, 1, [&](int64_t begin, int64_t end) {
      check_status(ripplekv::snapkv_scores_rows<T>(p, begin, end), op, "arguments", "must be valid");
    });
  });
  return scores;
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("snapkv_scores", &snapkv_scores_cpu); }

}  // namespace ripplekv_ext
