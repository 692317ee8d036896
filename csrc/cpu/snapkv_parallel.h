// SnapKV window scoring on CPU threads, split over (row, key range) tasks instead of rows alone.
//
// A row is one (b, g) pair; with few rows (SmolLM2 has 3 KV heads, a Llama layer at batch 1 has 8) and
// more threads than rows, or a row count that does not divide by the thread count, rows alone leave
// threads idle. Pass 1 computes partial softmax statistics per key range, which are merged per row;
// pass 2 scores each prefix key range against the merged statistics.
//
// Pass 1 also keeps its exps when a row's fit the store budget (16 MiB unless RIPPLEKV_SNAPKV_STORE_MIB
// says otherwise; 0 turns it off), and pass 2 reads them back: one window-attention GEMM per key instead
// of two, which is most of the scoring time. Rows are then scored in groups whose stores fit the budget.
// A row too long for it (a Llama-3.1-8B layer past about 32K tokens) runs both passes from the keys.
// Scratch: the [rows, N - W] raw scores, O(rows * chunks * G * W) statistics and at most the budget, which
// each calling thread keeps between calls (snapkv_store_workspace).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "ripplekv/snapkv_scores.h"

namespace ripplekv_ext {

// Bytes of stored exps the scoring may hold at once (read once per process).
inline int64_t snapkv_store_budget_bytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("RIPPLEKV_SNAPKV_STORE_MIB");
    const int64_t mib = env != nullptr && env[0] != '\0' ? std::max<int64_t>(0, std::atoll(env)) : 16;
    return mib << 20;
  }();
  return bytes;
}

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

template <typename Attention, typename T>
void snapkv_raw_scores_parallel_with(const ripplekv::SnapKVScoresParams& p, float* raw) {
  constexpr int64_t kTile = Attention::kKeyTile;
  const int64_t rows = p.B * p.H_kv, gw = p.G * p.W, n_prefix = p.N - p.W;
  const auto round_up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };

  // One row's store: an exp per key and query row, then a shift per key tile and query row.
  const int64_t width = Attention::store_width(p.G, p.W);
  const int64_t store_floats = (p.N + (p.N + kTile - 1) / kTile) * width;
  const int64_t budget_floats = snapkv_store_budget_bytes() / static_cast<int64_t>(sizeof(float));
  const bool keep = store_floats <= budget_floats;
  const int64_t group = keep ? std::min(rows, budget_floats / store_floats) : rows;

  // About 8 tasks per thread in each group, none under 512 keys (statistics and query setup are per
  // task); range starts on key-tile multiples, so each task's stored tiles are whole.
  constexpr int64_t kMinKeysPerChunk = 512;
  const int64_t wanted = (8 * at::get_num_threads() + group - 1) / group;
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
    at::parallel_for(0, n_rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / chunks, j0 = (task % chunks) * keys_per_chunk;
        ripplekv::detail::snapkv_window_stats_with<Attention, T>(p, first + i, j0, j0 + keys_per_chunk,
                                                                 &chunk_max[task * gw], &chunk_sum[task * gw],
                                                                 row_store(i), row_shifts(i));
      }
    });
    for (int64_t i = 0; i < n_rows; ++i)
      ripplekv::detail::merge_softmax_stats(&chunk_max[i * chunks * gw], &chunk_sum[i * chunks * gw], chunks, gw,
                                            &row_max[i * gw], &row_sum[i * gw]);
    at::parallel_for(0, n_rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / chunks, j0 = (task % chunks) * prefix_per_chunk;
        if (j0 >= n_prefix) continue;
        ripplekv::detail::snapkv_raw_scores_with<Attention, T>(
            p, first + i, &row_max[i * gw], &row_sum[i * gw], j0, std::min(n_prefix, j0 + prefix_per_chunk),
            raw + (first + i) * n_prefix + j0, row_store(i), row_shifts(i));
      }
    });
  }
}

// Unpooled, group-reduced scores of every row into raw[row * (N - W) + j], with the fastest
// window-attention kernel this CPU runs.
template <typename T>
void snapkv_raw_scores_parallel(const ripplekv::SnapKVScoresParams& p, float* raw) {
  ripplekv::detail::visit_window_attention(
      [&](auto tag) { snapkv_raw_scores_parallel_with<typename decltype(tag)::type, T>(p, raw); });
}

}  // namespace ripplekv_ext
