#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../h2o_scores.h"
#include "ripplekv/h2o_scores.h"

namespace ripplekv_ext {
namespace {

void run_h2o_scores_cpu(const ripplekv::H2OScoresParams& p, at::ScalarType dtype) {
  visit_float_type(dtype, [&](auto type_tag) {
    at::parallel_for(0, p.B * p.H_kv, 1, [&](int64_t begin, int64_t end) {
      check_status(ripplekv::h2o_scores_rows<decltype(type_tag)>(p, begin, end), "h2o_scores", "arguments",
                   "must be valid");
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("h2o_scores", &h2o_scores_op<run_h2o_scores_cpu>); }

}  // namespace ripplekv_ext
