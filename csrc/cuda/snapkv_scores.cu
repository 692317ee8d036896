#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include "../snapkv_scores.h"
#include "cuda_types.cuh"
#include "launchers.h"
#include "ripplekv/snapkv_scores.cuh"

namespace ripplekv_ext {

void check_window_attention_smem(int64_t D, const char* op) {
  const size_t needed = ripplekv::cuda::window_attention_smem(D);
  const size_t available = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(needed <= available, op, ": head dimension D = ", D, " needs ", needed,
              " bytes of shared memory per block on CUDA, but this device allows ", available,
              " (D up to about ", (available / sizeof(float) - 32 * 33 - 32) / 64, " fits)");
}

// Workspace from the caching allocator and one stream: no host synchronisation, so the scoring can be
// captured in a CUDA graph.
void run_snapkv_scores_cuda(const ripplekv::SnapKVScoresParams& p, at::ScalarType dtype) {
  check_window_attention_smem(p.D, "snapkv_scores");
  at::Tensor workspace = at::empty({ripplekv::cuda::snapkv_scores_workspace(p)},
                                   at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device()));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  visit_cuda_float_type(dtype, [&](auto tag) {
    C10_CUDA_CHECK(ripplekv::cuda::launch_snapkv_scores<decltype(tag)>(p, workspace.data_ptr<float>(), stream));
  });
}

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("snapkv_scores", &snapkv_scores_op<run_snapkv_scores_cuda>); }

}  // namespace ripplekv_ext
