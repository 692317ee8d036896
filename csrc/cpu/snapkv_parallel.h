// SnapKV window scoring on CPU threads, split over (row, key range) tasks instead of rows alone.
//
// A row is one (b, g) pair; with few rows (SmolLM2 has 3 KV heads, a Llama layer at batch 1 has 8) and
// more threads than rows, or a row count that does not divide by the thread count, rows alone leave
// threads idle. Pass 1 computes partial softmax statistics per key range, which are merged per row;
// pass 2 scores each prefix key range against the merged statistics. Scratch: the [rows, N - W] raw
// scores plus O(rows * chunks * G * W) statistics, within the O(B * H_q * W + B * H_kv * N) bound.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ripplekv/snapkv_scores.h"

namespace ripplekv_ext {

// Unpooled, group-reduced scores of every row into raw[row * (N - W) + j].
template <typename T>
void snapkv_raw_scores_parallel(const ripplekv::SnapKVScoresParams& p, float* raw) {
  const int64_t rows = p.B * p.H_kv, gw = p.G * p.W, n_prefix = p.N - p.W;
  // About 8 tasks per thread, none under 512 keys (the statistics and query setup are per task).
  constexpr int64_t kMinKeysPerChunk = 512;
  const int64_t wanted = (8 * at::get_num_threads() + rows - 1) / rows;
  const int64_t chunks = std::max<int64_t>(1, std::min(wanted, n_prefix / kMinKeysPerChunk));
  std::vector<float> chunk_max(rows * chunks * gw), chunk_sum(rows * chunks * gw);
  std::vector<float> row_max(rows * gw), row_sum(rows * gw);

  const int64_t keys_per_chunk = (p.N + chunks - 1) / chunks;  // pass 1 sees all N keys
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks, c = task % chunks;
      ripplekv::detail::snapkv_window_stats<T>(p, row, c * keys_per_chunk, (c + 1) * keys_per_chunk,
                                               &chunk_max[task * gw], &chunk_sum[task * gw]);
    }
  });
  for (int64_t row = 0; row < rows; ++row)
    ripplekv::detail::merge_softmax_stats(&chunk_max[row * chunks * gw], &chunk_sum[row * chunks * gw], chunks, gw,
                                          &row_max[row * gw], &row_sum[row * gw]);

  const int64_t prefix_per_chunk = (n_prefix + chunks - 1) / chunks;  // pass 2 scores the prefix only
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks, j0 = (task % chunks) * prefix_per_chunk;
      if (j0 >= n_prefix) continue;
      ripplekv::detail::snapkv_raw_scores<T>(p, row, &row_max[row * gw], &row_sum[row * gw], j0,
                                             std::min(n_prefix, j0 + prefix_per_chunk), raw + row * n_prefix + j0);
    }
  });
}

}  // namespace ripplekv_ext
