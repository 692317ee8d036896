// Typed C++ entry points of the ripplekv ops, for C++ callers (an engine, a libtorch program), as
// torchvision's ops/nms.h is for nms: each call goes through the dispatcher, so it reaches the CPU or
// CUDA kernel of its tensors' device, and autocast / tracing / fake tensors see it like any torch op.
//
// The op library must be loaded first (link libripplekv_ops so its registrations run, or dlopen it).
// Semantics and argument meanings: docs/design.md §4 and the schemas in csrc/ripplekv.cpp.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

namespace ripplekv_ext::ops {

namespace detail {
template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}
}  // namespace detail

// keys, values: [B, H_kv, N, D]; indices: int64 [B, H_kv, C] -> (K_c, V_c) [B, H_kv, C, D].
inline std::tuple<at::Tensor, at::Tensor> gather_kv(const at::Tensor& keys, const at::Tensor& values,
                                                    const at::Tensor& indices) {
  static const auto op = detail::find<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                         const at::Tensor&)>("ripplekv::gather_kv");
  return op.call(keys, values, indices);
}

// The same gather into caller-provided [B, H_kv, C, D] buffers; nothing is written if any check fails.
inline void gather_kv_into(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices,
                           at::Tensor& keys_out, at::Tensor& values_out) {
  static const auto op = detail::find<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                           at::Tensor&)>("ripplekv::gather_kv_into");
  op.call(keys, values, indices, keys_out, values_out);
}

// q_window: [B, H_q, W, D], keys: [B, H_kv, N, D] -> float32 [B, H_kv, N - W]. lengths: int64 [B] real tokens
// of a left-padded batch (each row scored alone, pad positions -inf), or nullopt.
inline at::Tensor snapkv_scores(const at::Tensor& q_window, const at::Tensor& keys, int64_t kernel_size = 7,
                                std::string_view pooling = "max", std::string_view group_reduce = "mean",
                                std::optional<double> scale = std::nullopt,
                                const std::optional<at::Tensor>& lengths = std::nullopt) {
  static const auto op =
      detail::find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, c10::string_view, c10::string_view,
                              std::optional<double>, const std::optional<at::Tensor>&)>("ripplekv::snapkv_scores");
  return op.call(q_window, keys, kernel_size, pooling, group_reduce, scale, lengths);
}

// scores: float32 [B, H_kv, N - W] -> int64 [B, H_kv, min(budget, N)], ascending.
inline at::Tensor select_topk(const at::Tensor& scores, int64_t budget, int64_t window) {
  static const auto op = detail::find<at::Tensor(const at::Tensor&, int64_t, int64_t)>("ripplekv::select_topk");
  return op.call(scores, budget, window);
}

// scores: float32 [B, H_kv, N - W], budgets and lengths: int64 [B] (left padding: row b's real tokens are
// [N - lengths[b], N)) -> int64 [B, H_kv, C_max], row b's C_b = min(budgets[b], lengths[b]) kept positions ascending
// in its last C_b slots, -1 before them.
inline at::Tensor select_topk_rows(const at::Tensor& scores, const at::Tensor& budgets, int64_t window,
                                   const at::Tensor& lengths) {
  static const auto op = detail::find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&)>(
      "ripplekv::select_topk_rows");
  return op.call(scores, budgets, window, lengths);
}

// -> (K_c, V_c, indices) with budget tokens per KV head, window included.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> snapkv_compress(
    const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values, int64_t budget,
    int64_t kernel_size = 7, std::string_view pooling = "max", std::string_view group_reduce = "mean",
    std::optional<double> scale = std::nullopt) {
  static const auto op = detail::find<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::string_view, c10::string_view,
      std::optional<double>)>("ripplekv::snapkv_compress");
  return op.call(q_window, keys, values, budget, kernel_size, pooling, group_reduce, scale);
}

// The per-row SnapKV compression of a left-padded batch -> (K_c, V_c [B, H_kv, C_max, D], indices as
// select_topk_rows'); pad slots hold zeros.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> snapkv_compress_rows(
    const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& budgets,
    const at::Tensor& lengths, int64_t kernel_size = 7, std::string_view pooling = "max",
    std::string_view group_reduce = "mean", std::optional<double> scale = std::nullopt) {
  static const auto op = detail::find<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
      c10::string_view, c10::string_view, std::optional<double>)>("ripplekv::snapkv_compress_rows");
  return op.call(q_window, keys, values, budgets, lengths, kernel_size, pooling, group_reduce, scale);
}

// queries: [B, H_q, N, D], keys: [B, H_kv, N, D] -> float32 [B, H_kv, N]. lengths: as for snapkv_scores.
inline at::Tensor h2o_scores(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size = 1024,
                             std::optional<double> scale = std::nullopt, std::string_view group_reduce = "mean",
                             const std::optional<at::Tensor>& lengths = std::nullopt) {
  static const auto op = detail::find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, std::optional<double>,
                                                 c10::string_view, const std::optional<at::Tensor>&)>(
      "ripplekv::h2o_scores");
  return op.call(queries, keys, chunk_size, scale, group_reduce, lengths);
}

// scores: float32 [L, B, H_kv, N - W], budgets [L] -> (int64 [B, H_kv, sum_l C_l], offsets int64 [L + 1]).
inline std::tuple<at::Tensor, at::Tensor> select_topk_packed(const at::Tensor& scores, at::IntArrayRef budgets,
                                                             int64_t window) {
  static const auto op = detail::find<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef, int64_t)>(
      "ripplekv::select_topk_packed");
  return op.call(scores, budgets, window);
}

// keys, values: L x [B, H_kv, N, D] -> packed [B, H_kv, sum_l C_l, D].
inline std::tuple<at::Tensor, at::Tensor> gather_kv_packed(at::TensorList keys, at::TensorList values,
                                                           const at::Tensor& indices_flat, const at::Tensor& offsets) {
  static const auto op = detail::find<std::tuple<at::Tensor, at::Tensor>(at::TensorList, at::TensorList,
                                                                         const at::Tensor&, const at::Tensor&)>(
      "ripplekv::gather_kv_packed");
  return op.call(keys, values, indices_flat, offsets);
}

}  // namespace ripplekv_ext::ops
