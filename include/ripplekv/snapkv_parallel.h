// SnapKV window scoring over threads, split over (row, key range) tasks instead of rows alone. Torch-free:
// the caller passes its own parallel-for (and thread count), so an engine embedding include/ gets the
// same fast CPU path as the torch binding.
//
// A row is one (b, g) pair; with few rows (SmolLM2 has 3 KV heads, a Llama layer at batch 1 has 8) and
// more threads than rows, or a row count that does not divide by the thread count, rows alone leave
// threads idle. Pass 1 computes partial softmax statistics per key range, which are merged per row;
// pass 2 scores each prefix key range against the merged statistics.
//
// Pass 1 also keeps its exps when a row's fit the store budget (options.store_budget_bytes; 0 turns it
// off), and pass 2 reads them back: one window-attention GEMM per key instead of two, which is most of
// the scoring time. Rows are then scored in groups whose stores fit the budget. A row too long for it (a
// Llama-3.1-8B layer past about 32K tokens at 16 MiB) runs both passes from the keys.
// Scratch: O(rows * chunks * G * W) statistics and at most the budget, which each calling thread keeps
// between calls (detail::snapkv_store_workspace).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "ripplekv/snapkv_scores.h"

namespace ripplekv {

struct SnapKVParallelOptions {
  int64_t threads = 1;                    // threads parallel_for may use (sizes the tasks)
  int64_t store_budget_bytes = 16 << 20;  // stored exps held at once; 0 recomputes pass 2's logits
};

namespace detail {

// The store's memory, kept by each calling thread from one call to the next (at most the budget): a fresh
// multi-megabyte buffer per layer is a new mapping whose pages the OS faults in and zeroes on first touch.
inline float* snapkv_store_workspace(int64_t floats) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t capacity = 0;
  if (floats > capacity) {
    buffer.reset();  // free the old one first: never hold both
    buffer.reset(new float[floats]);
    capacity = floats;
  }
  return buffer.get();
}

template <typename Attention, typename T, typename ParallelFor>
void snapkv_raw_scores_parallel_with(const SnapKVScoresParams& p, float* raw, const SnapKVParallelOptions& options,
                                     const ParallelFor& parallel_for) {
  constexpr int64_t kTile = Attention::kKeyTile;
  const int64_t rows = p.B * p.H_kv, gw = p.G * p.W, n_prefix = p.N - p.W;
  if (rows <= 0 || n_prefix <= 0) return;  // nothing to score (and no group size to divide by)
  const auto round_up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };

  // One row's store: an exp per key and query row, then a shift per key tile and query row.
  const int64_t width = Attention::store_width(p.G, p.W);
  const int64_t store_floats = (p.N + (p.N + kTile - 1) / kTile) * width;
  const int64_t budget_floats = options.store_budget_bytes / static_cast<int64_t>(sizeof(float));
  const bool keep = store_floats <= budget_floats;
  const int64_t group = keep ? std::min(rows, budget_floats / store_floats) : rows;

  // About 8 tasks per thread in each group, none under 512 keys (statistics and query setup are per
  // task); range starts on key-tile multiples, so each task's stored tiles are whole.
  constexpr int64_t kMinKeysPerChunk = 512;
  const int64_t wanted = (8 * std::max<int64_t>(1, options.threads) + group - 1) / group;
  const int64_t chunks = std::max<int64_t>(1, std::min(wanted, n_prefix / kMinKeysPerChunk));
  const int64_t keys_per_chunk = round_up((p.N + chunks - 1) / chunks, kTile);  // pass 1 sees all N keys
  const int64_t prefix_per_chunk = round_up((n_prefix + chunks - 1) / chunks, kTile);  // pass 2 the prefix

  // Not zero-filled: pass 1 writes every element pass 2 reads.
  float* const store = keep ? snapkv_store_workspace(group * store_floats) : nullptr;
  std::vector<float> chunk_max(group * chunks * gw), chunk_sum(group * chunks * gw);
  std::vector<float> row_max(group * gw), row_sum(group * gw);
  const auto row_store = [&](int64_t i) { return keep ? &store[i * store_floats] : nullptr; };
  const auto row_shifts = [&](int64_t i) { return keep ? &store[i * store_floats + p.N * width] : nullptr; };

  for (int64_t first = 0; first < rows; first += group) {
    const int64_t n_rows = std::min(group, rows - first);
    parallel_for(0, n_rows * chunks, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / chunks, j0 = (task % chunks) * keys_per_chunk;
        snapkv_window_stats_with<Attention, T>(p, first + i, j0, j0 + keys_per_chunk,
                                                                 &chunk_max[task * gw], &chunk_sum[task * gw],
                                                                 row_store(i), row_shifts(i));
      }
    });
    for (int64_t i = 0; i < n_rows; ++i)
      merge_softmax_stats(&chunk_max[i * chunks * gw], &chunk_sum[i * chunks * gw], chunks, gw,
                                            &row_max[i * gw], &row_sum[i * gw]);
    parallel_for(0, n_rows * chunks, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / chunks, j0 = (task % chunks) * prefix_per_chunk;
        if (j0 >= n_prefix) continue;
        snapkv_raw_scores_with<Attention, T>(
            p, first + i, &row_max[i * gw], &row_sum[i * gw], j0, std::min(n_prefix, j0 + prefix_per_chunk),
            raw + (first + i) * n_prefix + j0, row_store(i), row_shifts(i));
      }
    });
  }
}

}  // namespace detail

// Unpooled, group-reduced scores of every row into raw[row * (N - W) + j], with the fastest
// window-attention kernel this CPU runs. parallel_for(begin, end, body) runs body(b, e) over disjoint
// sub-ranges of [begin, end) covering it, on any threads (at::parallel_for in the torch binding, a
// plain loop or an engine's pool elsewhere).
template <typename T, typename ParallelFor>
void snapkv_raw_scores_parallel(const SnapKVScoresParams& p, float* raw, const SnapKVParallelOptions& options,
                                const ParallelFor& parallel_for) {
  detail::visit_window_attention([&](auto tag) {
    detail::snapkv_raw_scores_parallel_with<typename decltype(tag)::type, T>(p, raw, options, parallel_for);
  });
}

}  // namespace ripplekv
