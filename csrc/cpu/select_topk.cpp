#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../select_topk.h"
#include "ripplekv/select_topk.h"

namespace ripplekv_ext {
namespace {

at::Tensor select_topk_cpu(const at::Tensor& scores, int64_t budget, int64_t window) {
  constexpr const char* op = "select_topk";
  check_scores(scores, 3, "[B, H_kv, N - W]", op);
  check_window_and_budget(scores.size(2), window, budget, op, "budget");
  const int64_t B = scores.size(0), H = scores.size(1), N = scores.size(2) + window;
  auto indices = at::empty({B, H, kept_tokens(N, budget)}, scores.options().dtype(at::kLong));
  const ripplekv::SelectTopKParams p{scores.data_ptr<float>(), indices.data_ptr<int64_t>(), B, H, N, window, budget,
                                     strides3(scores), strides3(indices)};
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    const ripplekv::Status s = ripplekv::select_topk_rows(p, begin, end);
    TORCH_CHECK(s.ok(), op, ": scores must not contain NaN, got NaN at position ", s.value, " of row ", s.row,
                " (row = b * H_kv + h)");
  });
  return indices;
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("select_topk", &select_topk_cpu); }

}  // namespace ripplekv_ext
