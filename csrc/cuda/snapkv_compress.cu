#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../snapkv_scores.h"
#include "launchers.h"

namespace ripplekv_ext {
namespace {

// Scores into a [B, H_kv, N - W] scratch, select, gather: the probabilities are never formed, so the
// scratch is the split statistics (O(B * H_q * W)) plus O(B * H_kv * N). No host synchronisation but the
// NaN check's, which is skipped while capturing: the call can be captured in a CUDA graph.
void run_snapkv_compress_cuda(const ripplekv::SnapKVScoresParams& score, const at::Tensor& keys,
                              const at::Tensor& values, int64_t budget, at::Tensor& indices, at::Tensor& keys_out,
                              at::Tensor& values_out) {
  const c10::cuda::CUDAGuard guard(keys.device());
  auto scores = at::empty({score.B, score.H_kv, score.N - score.W}, keys.options().dtype(at::kFloat));
  ripplekv::SnapKVScoresParams p = score;
  p.scores = scores.data_ptr<float>();
  p.s = strides3(scores);
  run_snapkv_scores_cuda(p, keys.scalar_type());
  run_select_topk_cuda(scores.unsqueeze(0), {budget}, {0, budget}, score.W, indices, "snapkv_compress");
  run_gather_kv_cuda(make_gather_kv_params(keys, values, indices, keys_out, values_out), keys.element_size());
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("snapkv_compress", &snapkv_compress_op<run_snapkv_compress_cuda>); }

}  // namespace ripplekv_ext
