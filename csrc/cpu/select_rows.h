// The CPU selection runner of select_topk and select_topk_packed (csrc/select_topk.h describes runners).
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "../select_topk.h"

namespace ripplekv_ext {

inline void run_select_topk_cpu(const at::Tensor& scores4, const std::vector<int64_t>& budgets,
                                const std::vector<int64_t>& offsets, int64_t window, at::Tensor& indices,
                                const char* op) {
  const auto p = make_select_topk_params(scores4, budgets.data(), offsets.data(), window, indices);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.N));
  at::parallel_for(0, p.L * p.B * p.H, grain, [&](int64_t begin, int64_t end) {
    const ripplekv::Status s = ripplekv::select_topk_packed_rows(p, begin, end);
    if (s.code == ripplekv::StatusCode::kNaN) fail_nan_score(op, s.row, s.value, p.B, p.H);
    check_status(s, op, "budget", "must be >= window when compressing");
  });
}

}  // namespace ripplekv_ext
