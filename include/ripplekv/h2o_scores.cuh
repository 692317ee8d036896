// H2O scores, CUDA: the window-attention passes with every prompt query as the query list
// (positions 0..N-1), so memory is the per-query statistics and the [B, H_kv, N] output: O(H * N).
#pragma once

#include <cuda_runtime.h>

#include "ripplekv/h2o_scores.h"
#include "ripplekv/window_attention.cuh"

namespace ripplekv {
namespace cuda {

inline int64_t h2o_scores_workspace(const H2OScoresParams& p) { return p.B * p.H_kv * p.G * p.N * 2; }

// Query chunking only bounds memory on the CPU; here queries go in fixed blocks of kQueryBlock and
// the result is the same sum.
template <typename T>
cudaError_t launch_h2o_scores(const H2OScoresParams& p, float* workspace, cudaStream_t stream) {
  WindowAttentionParams w{};
  w.queries = p.queries;
  w.keys = p.keys;
  w.stats = workspace;
  w.out = p.scores;
  w.B = p.B;
  w.H_kv = p.H_kv;
  w.G = p.G;
  w.Q = p.N;
  w.D = p.D;
  w.pos0 = 0;
  w.n_out = p.N;
  w.splits = 1;
  w.split_len = p.N;
  w.q = p.q;
  w.k = p.k;
  w.o = p.s;
  w.scale = p.scale;
  w.group_max = p.group_reduce == GroupReduce::kMax;
  if (p.N == 0 || p.B * p.H_kv == 0) return cudaSuccess;  // empty: launch nothing
  return launch_window_attention<T>(w, stream);
}

}  // namespace cuda
}  // namespace ripplekv
