// snapkv_compress_rows: SnapKV compression of a left-padded batch with per-row budgets (csrc/rows.h), shared by the
// CPU and CUDA bindings. Each compressed row runs the backend's scoring, selection and gather runners on its real
// sub-range (views at offset N - n_b), writing right-aligned into the padded outputs. One set of runner calls per
// row: a loop, not a fused kernel; the row's scores are materialised ([1, H_kv, n_b - W] floats).
#pragma once

#include "aten.h"

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include <c10/core/DeviceGuard.h>

#include "gather_kv.h"
#include "rows.h"
#include "snapkv_scores.h"

namespace ripplekv_ext {

// run_scores(params, dtype), run_select(scores4, budgets, offsets, window, indices, op) and
// run_gather(params, element_size): the backend's runners of snapkv_scores, select_topk and gather_kv.
template <auto run_scores, auto run_select, auto run_gather>
std::tuple<at::Tensor, at::Tensor, at::Tensor> snapkv_compress_rows_op(
    const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& budgets,
    const at::Tensor& lengths, int64_t kernel_size, c10::string_view pooling, c10::string_view group_reduce,
    std::optional<double> scale) {
  constexpr const char* op = "snapkv_compress_rows";
  // A budget of N checks everything but the budget (the budgets are per row, checked below).
  check_snapkv_compress_inputs(q_window, keys, values, keys.size(2), kernel_size, pooling, group_reduce, op);
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2), D = keys.size(3), W = q_window.size(2);
  const auto n = read_row_lengths(lengths, B, N, keys.device(), op);
  const auto budget = read_row_budgets(budgets, n, W, keys.device(), op);
  const auto kept = row_kept(n, budget);
  const int64_t c_max = max_kept(kept);
  const c10::OptionalDeviceGuard guard(keys.device());
  // Pad slots: index -1 and zero K/V.
  at::Tensor indices = at::full({B, H, c_max}, -1, keys.options().dtype(at::kLong));
  at::Tensor keys_out = at::zeros({B, H, c_max, D}, keys.options());
  at::Tensor values_out = at::zeros({B, H, c_max, D}, keys.options());
  if (indices.numel() == 0 || D == 0) return {keys_out, values_out, indices};
  for (int64_t b = 0; b < B; ++b) {
    if (kept[b] == 0) continue;
    const int64_t first = N - n[b];  // the row's first real position
    const at::Tensor row_keys = keys.narrow(0, b, 1).narrow(2, first, n[b]);
    const at::Tensor row_values = values.narrow(0, b, 1).narrow(2, first, n[b]);
    at::Tensor row_indices = indices.narrow(0, b, 1).narrow(2, c_max - kept[b], kept[b]);
    at::Tensor row_keys_out = keys_out.narrow(0, b, 1).narrow(2, c_max - kept[b], kept[b]);
    at::Tensor row_values_out = values_out.narrow(0, b, 1).narrow(2, c_max - kept[b], kept[b]);
    if (n[b] <= budget[b]) {  // nothing to compress: the row's real tokens
      row_indices.copy_(at::arange(first, N, indices.options()));
      row_keys_out.copy_(row_keys);
      row_values_out.copy_(row_values);
      continue;
    }
    at::Tensor row_scores = at::empty({1, H, n[b] - W}, keys.options().dtype(at::kFloat));
    run_scores(make_snapkv_scores_params(q_window.narrow(0, b, 1), row_keys, row_scores.data_ptr<float>(),
                                         strides3(row_scores), kernel_size, pooling, group_reduce, scale, op),
               keys.scalar_type());
    select_row<run_select>(row_scores, budget[b], kept[b], W, row_indices, b, first, op);
    // The selection is relative to the row's view; the gather reads that view, then indices become absolute.
    run_gather(make_gather_kv_params(row_keys, row_values, row_indices, row_keys_out, row_values_out),
               keys.element_size());
    row_indices.add_(first);
  }
  return {keys_out, values_out, indices};
}

}  // namespace ripplekv_ext
