#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../select_topk.h"
#include "launchers.h"
#include "ripplekv/select_topk.cuh"

namespace ripplekv_ext {

// One layer (select_topk, snapkv_compress) passes its budget by value: no host-to-device copy, no sync
// while capturing, so the call can be captured in a CUDA graph. Several layers copy budgets and offsets
// to the device. Reading the NaN flag back costs one sync outside capture: NaN is a caller bug that must
// not turn into a silently wrong selection.
void run_select_topk_cuda(const at::Tensor& scores4, const std::vector<int64_t>& budgets,
                          const std::vector<int64_t>& offsets, int64_t window, at::Tensor& indices, const char* op) {
  const c10::cuda::CUDAGuard guard(scores4.device());
  const bool single = budgets.size() == 1;
  at::Tensor budgets_d, offsets_d;
  if (!single) {
    budgets_d = at::tensor(budgets, at::kLong).to(scores4.device());
    offsets_d = at::tensor(offsets, at::kLong).to(scores4.device());
  }
  at::Tensor nan_row = at::full({1}, -1, scores4.options().dtype(at::kLong));  // ~0ull: no NaN
  ripplekv::cuda::SelectTopKLaunch launch{};
  launch.p = make_select_topk_params(scores4, single ? nullptr : budgets_d.data_ptr<int64_t>(),
                                     single ? nullptr : offsets_d.data_ptr<int64_t>(), window, indices);
  launch.budget = budgets.front();
  launch.nan_row = reinterpret_cast<unsigned long long*>(nan_row.data_ptr<int64_t>());
  C10_CUDA_CHECK(ripplekv::cuda::launch_select_topk(launch, at::cuda::getCurrentCUDAStream()));
  if (at::cuda::currentStreamCaptureStatus() != at::cuda::CaptureStatus::None) return;
  const int64_t row = nan_row.item<int64_t>();
  if (row != -1) fail_nan_score(op, row, -1, launch.p.B, launch.p.H);
}

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("select_topk", &select_topk_op<run_select_topk_cuda>); }

}  // namespace ripplekv_ext
