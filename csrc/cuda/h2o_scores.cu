#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include "../h2o_scores.h"
#include "cuda_types.cuh"
#include "launchers.h"
#include "ripplekv/h2o_scores.cuh"

namespace ripplekv_ext {
namespace {

void run_h2o_scores_cuda(const ripplekv::H2OScoresParams& p, at::ScalarType dtype) {
  check_window_attention_smem(p.D, "h2o_scores");
  at::Tensor workspace = at::empty({ripplekv::cuda::h2o_scores_workspace(p)},
                                   at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  visit_cuda_float_type(dtype, [&](auto tag) {
    C10_CUDA_CHECK(ripplekv::cuda::launch_h2o_scores<decltype(tag)>(p, workspace.data_ptr<float>(), stream));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("h2o_scores", &h2o_scores_op<run_h2o_scores_cuda>); }

}  // namespace ripplekv_ext
