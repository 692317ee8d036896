// select_topk_rows: per-row budgets for a left-padded batch (csrc/rows.h), shared by the CPU and CUDA bindings.
// Each row runs the backend's select_topk runner (csrc/select_topk.h) on its real prefix scores, then its indices
// are shifted to absolute positions. One runner call per compressed row: a loop, not a fused kernel.
#pragma once

#include "aten.h"

#include <limits>
#include <vector>

#include <c10/core/DeviceGuard.h>

#include "rows.h"
#include "select_topk.h"

namespace ripplekv_ext {

// scores: float32 [B, H_kv, N - W]; budgets, lengths: int64 [B] -> int64 [B, H_kv, C_max], C_b = min(budget_b, n_b)
// and C_max = max_b C_b. Row b's kept positions ascending in its last C_b slots, -1 in the first C_max - C_b.
template <auto run>
at::Tensor select_topk_rows_op(const at::Tensor& scores, const at::Tensor& budgets, int64_t window,
                               const at::Tensor& lengths) {
  constexpr const char* op = "select_topk_rows";
  check_scores(scores, 3, "[B, H_kv, N - W]", op);
  // The window checks alone (the budgets are per row, checked below).
  check_window_and_budget(scores.size(2), window, std::numeric_limits<int64_t>::max(), op, "budget");
  const int64_t B = scores.size(0), H = scores.size(1), N = scores.size(2) + window;
  const auto n = read_row_lengths(lengths, B, N, scores.device(), op);
  const auto budget = read_row_budgets(budgets, n, window, scores.device(), op);
  const auto kept = row_kept(n, budget);
  const int64_t c_max = max_kept(kept);
  const c10::OptionalDeviceGuard guard(scores.device());
  at::Tensor indices = at::full({B, H, c_max}, -1, scores.options().dtype(at::kLong));
  if (indices.numel() == 0) return indices;
  for (int64_t b = 0; b < B; ++b) {
    if (kept[b] == 0) continue;
    const int64_t first = N - n[b];  // the row's first real position
    at::Tensor out = indices.narrow(0, b, 1).narrow(2, c_max - kept[b], kept[b]);
    if (n[b] <= budget[b]) {
      out.copy_(at::arange(first, N, indices.options()));
      continue;
    }
    const at::Tensor row_scores = scores.narrow(0, b, 1).narrow(2, first, n[b] - window);
    select_row<run>(row_scores, budget[b], kept[b], window, out, b, first, op);
    out.add_(first);
  }
  return indices;
}

}  // namespace ripplekv_ext
