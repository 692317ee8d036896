// The single schema block for every ripplekv op. Backends register in csrc/cpu and csrc/cuda.
#include <torch/library.h>

TORCH_LIBRARY(ripplekv, m) {
  // keys, values: [B, H_kv, N, D]; indices: int64 [B, H_kv, C] -> K_c, V_c: [B, H_kv, C, D]. An index of -1
  // (a pad slot of the per-row ops) writes zeros.
  m.def("gather_kv(Tensor keys, Tensor values, Tensor indices) -> (Tensor, Tensor)");
  // The same gather into caller-provided compact buffers (e.g. an engine's preallocated cache).
  m.def(
      "gather_kv_into(Tensor keys, Tensor values, Tensor indices, Tensor(a!) keys_out, "
      "Tensor(b!) values_out) -> ()");
  // q_window: [B, H_q, W, D], keys: [B, H_kv, N, D] -> float32 [B, H_kv, N - W]: window attention
  // mass per prefix key (causal inside the window, fp32 softmax), group-reduced, then 1-D pooled. With
  // lengths [B] (left padding), each row is scored alone on its real keys; pad positions are -inf.
  m.def(
      "snapkv_scores(Tensor q_window, Tensor keys, int kernel_size=7, str pooling=\"max\", "
      "str group_reduce=\"mean\", float? scale=None, Tensor? lengths=None) -> Tensor");
  // scores: float32 [B, H_kv, N - W] -> int64 [B, H_kv, min(budget, N)], ascending, window kept,
  // ties to the lower position.
  m.def("select_topk(Tensor scores, int budget, int window) -> Tensor");
  // Left-padded batch (row b's n_b = lengths[b] real tokens are positions [N - n_b, N)), per-row budgets [B]:
  // -> int64 [B, H_kv, C_max], C_b = min(budgets[b], n_b) right-aligned per row, -1 in the pad slots.
  m.def("select_topk_rows(Tensor scores, Tensor budgets, int window, Tensor lengths) -> Tensor");
  // Score + select + gather without the [B, H_q, W, N] probabilities -> (K_c, V_c, indices).
  m.def(
      "snapkv_compress(Tensor q_window, Tensor keys, Tensor values, int budget, int kernel_size=7, "
      "str pooling=\"max\", str group_reduce=\"mean\", float? scale=None) -> (Tensor, Tensor, Tensor)");
  // The same per row of a left-padded batch with per-row budgets -> (K_c, V_c [B, H_kv, C_max, D], indices as
  // select_topk_rows'); pad slots hold index -1 and zero K/V.
  m.def(
      "snapkv_compress_rows(Tensor q_window, Tensor keys, Tensor values, Tensor budgets, Tensor lengths, "
      "int kernel_size=7, str pooling=\"max\", str group_reduce=\"mean\", float? scale=None) -> "
      "(Tensor, Tensor, Tensor)");
  // queries: [B, H_q, N, D], keys: [B, H_kv, N, D] -> float32 [B, H_kv, N]: cumulative causal
  // attention over every query, in query chunks. With lengths [B] (left padding), each row alone; pads -inf.
  m.def(
      "h2o_scores(Tensor queries, Tensor keys, int chunk_size=1024, float? scale=None, "
      "str group_reduce=\"mean\", Tensor? lengths=None) -> Tensor");
  // scores: float32 [L, B, H_kv, N - W], budgets: [L] -> (int64 [B, H_kv, sum_l C_l], offsets int64 [L + 1]).
  m.def("select_topk_packed(Tensor scores, int[] budgets, int window) -> (Tensor, Tensor)");
  // keys, values: L x [B, H_kv, N, D] -> packed [B, H_kv, sum_l C_l, D], layer l in [offsets[l], offsets[l + 1]).
  m.def(
      "gather_kv_packed(Tensor[] keys, Tensor[] values, Tensor indices_flat, Tensor offsets) -> "
      "(Tensor, Tensor)");
}
