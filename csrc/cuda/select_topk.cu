#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../packed.h"
#include "../select_topk.h"
#include "ripplekv/select_topk.cuh"

namespace ripplekv_ext {

// Shared with snapkv_compress: selects rows of an [L, B, H, N - W] score tensor into indices at the
// given host offsets. Reading the NaN flag back costs one device sync: NaN is a caller bug that
// must not turn into a silently wrong selection.
void run_select_topk_packed_cuda(const at::Tensor& scores4, const std::vector<int64_t>& budgets,
                                 const std::vector<int64_t>& offsets, int64_t window, at::Tensor& indices,
                                 const char* op) {
  const auto device_ints = [&](const std::vector<int64_t>& v) {
    return at::tensor(v, at::kLong).to(scores4.device());
  };
  const at::Tensor budgets_d = device_ints(budgets), offsets_d = device_ints(offsets);
  at::Tensor nan_flag = at::zeros({1}, scores4.options().dtype(at::kInt));
  ripplekv::cuda::SelectTopKPackedParams p{};
  p.scores = scores4.data_ptr<float>();
  p.indices = indices.data_ptr<int64_t>();
  p.budgets = budgets_d.data_ptr<int64_t>();
  p.offsets = offsets_d.data_ptr<int64_t>();
  p.nan_flag = nan_flag.data_ptr<int>();
  p.L = scores4.size(0);
  p.B = scores4.size(1);
  p.H = scores4.size(2);
  p.N = scores4.size(3) + window;
  p.W = window;
  p.s_l = scores4.stride(0);
  p.s = {scores4.stride(1), scores4.stride(2), scores4.stride(3)};
  p.idx = strides3(indices);
  C10_CUDA_CHECK(ripplekv::cuda::launch_select_topk_packed(p, at::cuda::getCurrentCUDAStream()));
  TORCH_CHECK(nan_flag.item<int>() == 0, op, ": scores must not contain NaN, got NaN");
}

namespace {

at::Tensor select_topk_cuda(const at::Tensor& scores, int64_t budget, int64_t window) {
  constexpr const char* op = "select_topk";
  check_scores(scores, 3, "[B, H_kv, N - W]", op);
  check_window_and_budget(scores.size(2), window, budget, op, "budget");
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t N = scores.size(2) + window;
  auto indices = at::empty({scores.size(0), scores.size(1), kept_tokens(N, budget)}, scores.options().dtype(at::kLong));
  run_select_topk_packed_cuda(scores.unsqueeze(0), {budget}, {0, kept_tokens(N, budget)}, window, indices, op);
  return indices;
}

std::tuple<at::Tensor, at::Tensor> select_topk_packed_cuda(const at::Tensor& scores, at::IntArrayRef budgets,
                                                           int64_t window) {
  constexpr const char* op = "select_topk_packed";
  const std::vector<int64_t> offsets = packed_offsets(scores, budgets, window, op);
  const c10::cuda::CUDAGuard guard(scores.device());
  auto indices = at::empty({scores.size(1), scores.size(2), offsets.back()}, scores.options().dtype(at::kLong));
  run_select_topk_packed_cuda(scores, budgets.vec(), offsets, window, indices, op);
  return {indices, at::tensor(offsets, at::kLong).to(scores.device())};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) {
  m.impl("select_topk", &select_topk_cuda);
  m.impl("select_topk_packed", &select_topk_packed_cuda);
}

}  // namespace ripplekv_ext
