#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../h2o_scores.h"
#include "ripplekv/h2o_scores.h"

namespace ripplekv_ext {
namespace {

at::Tensor h2o_scores_cpu(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size,
                          std::optional<double> scale, c10::string_view group_reduce) {
  constexpr const char* op = "h2o_scores";
  check_h2o_inputs(queries, keys, chunk_size, op);
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2);
  auto scores = at::empty({B, H, N}, keys.options().dtype(at::kFloat));
  const auto p = make_h2o_scores_params(queries, keys, scores, chunk_size, scale, group_reduce, op);
  visit_float_type(keys.scalar_type(), [&](auto type_tag) {
    using T = decltype(type_tag);
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      check_status(ripplekv::h2o_scores_rows<T>(p, begin, end), op, "arguments", "must be valid");
    });
  });
  return scores;
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("h2o_scores", &h2o_scores_cpu); }

}  // namespace ripplekv_ext
