#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../h2o_scores.h"
#include "cuda_types.cuh"
#include "ripplekv/h2o_scores.cuh"

namespace ripplekv_ext {
namespace {

at::Tensor h2o_scores_cuda(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size,
                           std::optional<double> scale, c10::string_view group_reduce) {
  constexpr const char* op = "h2o_scores";
  check_h2o_inputs(queries, keys, chunk_size, op);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2);
  auto scores = at::empty({B, H, N}, keys.options().dtype(at::kFloat));
  const auto p = make_h2o_scores_params(queries, keys, scores, chunk_size, scale, group_reduce, op);
  at::Tensor workspace = at::empty({ripplekv::cuda::h2o_scores_workspace(p)}, scores.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  visit_cuda_float_type(keys.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    C10_CUDA_CHECK(ripplekv::cuda::launch_h2o_scores<T>(p, workspace.data_ptr<float>(), stream));
  });
  return scores;
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("h2o_scores", &h2o_scores_cuda); }

}  // namespace ripplekv_ext
