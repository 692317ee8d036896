// Left-padded batches (docs/design.md §4, "Batches"): row b's n_b real tokens are positions [N - n_b, N), so each
// row's real tokens are a contiguous suffix. The per-row ops run the existing per-call machinery on the row's
// sub-range (a view at offset N - n_b of length n_b) and write right-aligned into padded outputs; this header
// holds what they share: reading the per-row lengths and budgets.
#pragma once

#include "aten.h"

#include <algorithm>
#include <vector>

#include "checks.h"

namespace ripplekv_ext {

// An int64 [B] tensor on the data's device or on the CPU, read once on the host. Reading a CUDA tensor
// synchronises the stream, so the per-row ops cannot be captured in a CUDA graph.
inline std::vector<int64_t> read_row_values(const at::Tensor& t, int64_t B, const at::Device& data_device,
                                            const char* op, const char* name) {
  check_rank(t, op, name, 1, "[B]");
  check_dtype(t, op, name, at::kLong);
  TORCH_CHECK(t.device().is_cpu() || t.device() == data_device, op, ": ", name,
              " must be on the CPU or on the device of the data (", data_device, "), got ", t.device());
  check_size(t, 0, B, op, name, "B");
  const at::Tensor host = t.to(at::kCPU).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + B);
}

// lengths[b] = n_b, the real tokens of row b, each in [0, N].
inline std::vector<int64_t> read_row_lengths(const at::Tensor& lengths, int64_t B, int64_t N,
                                             const at::Device& data_device, const char* op) {
  std::vector<int64_t> n = read_row_values(lengths, B, data_device, op, "lengths");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(n[b] >= 0 && n[b] <= N, op, ": lengths[", b, "] (real tokens of row ", b,
                ") must be in [0, N] = [0, ", N, "], got ", n[b]);
  return n;
}

// budgets[b] >= 0 tokens per KV head for row b, window included; a compressed row (n_b > budget_b) needs
// budget_b >= window.
inline std::vector<int64_t> read_row_budgets(const at::Tensor& budgets, const std::vector<int64_t>& n, int64_t window,
                                             const at::Device& data_device, const char* op) {
  std::vector<int64_t> budget = read_row_values(budgets, static_cast<int64_t>(n.size()), data_device, op, "budgets");
  for (size_t b = 0; b < n.size(); ++b) {
    TORCH_CHECK(budget[b] >= 0, op, ": budgets[", b, "] must be a non-negative number of tokens, got ", budget[b]);
    TORCH_CHECK(n[b] <= budget[b] || budget[b] >= window, op, ": budgets[", b, "] must be >= window (", window,
                ") when row ", b, " is compressed (its n_b = ", n[b], " real tokens exceed the budget), got ",
                budget[b]);
  }
  return budget;
}

// C_b = min(budget_b, n_b) kept per row.
inline std::vector<int64_t> row_kept(const std::vector<int64_t>& n, const std::vector<int64_t>& budget) {
  std::vector<int64_t> kept(n.size());
  for (size_t b = 0; b < n.size(); ++b) kept[b] = std::min(n[b], budget[b]);
  return kept;
}

inline int64_t max_kept(const std::vector<int64_t>& kept) {
  return kept.empty() ? 0 : *std::max_element(kept.begin(), kept.end());
}

// Raised when a row's selection failed: if the row's real scores hold a NaN, an error naming the batch row, the
// head and the absolute position; otherwise the original error is rethrown by the caller.
inline void fail_if_nan_in_row(const at::Tensor& row_scores, int64_t b, int64_t first_position, const char* op) {
  const at::Tensor where = at::nonzero(at::isnan(row_scores.reshape({row_scores.size(-2), row_scores.size(-1)}))).cpu();
  if (where.size(0) == 0) return;
  TORCH_CHECK(false, op, ": scores must not contain NaN, got NaN in batch row ", b, " (KV head ",
              where[0][0].item<int64_t>(), ", position ", first_position + where[0][1].item<int64_t>(),
              ") (NaN or inf in q_window/queries or keys gives NaN scores)");
}

// One row's top-k through the backend's select_topk runner (csrc/select_topk.h) on its real prefix scores
// [1, H_kv, n_b - W], into `out` ([1, H_kv, kept] positions relative to the row's first real token); a NaN is
// reported with the batch row and the absolute position.
template <auto run_select>
void select_row(const at::Tensor& row_scores, int64_t budget, int64_t kept, int64_t window, at::Tensor& out,
                int64_t b, int64_t first_position, const char* op) {
  try {
    run_select(row_scores.unsqueeze(0), std::vector<int64_t>{budget}, std::vector<int64_t>{0, kept}, window, out, op);
  } catch (const c10::Error&) {
    fail_if_nan_in_row(row_scores, b, first_position, op);
    throw;
  }
}

}  // namespace ripplekv_ext
