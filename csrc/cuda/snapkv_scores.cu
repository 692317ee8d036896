#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../select_topk.h"
#include "../snapkv_scores.h"
#include "cuda_types.cuh"
#include "ripplekv/gather_kv.cuh"
#include "ripplekv/snapkv_scores.cuh"

namespace ripplekv_ext {

// Defined in select_topk.cu.
void run_select_topk_packed_cuda(const at::Tensor& scores4, const std::vector<int64_t>& budgets,
                                 const std::vector<int64_t>& offsets, int64_t window, at::Tensor& indices,
                                 const char* op);

namespace {

void run_snapkv_scores(const ripplekv::SnapKVScoresParams& p, at::ScalarType dtype, const at::Tensor& like) {
  at::Tensor workspace = at::empty({ripplekv::cuda::snapkv_scores_workspace(p)}, like.options().dtype(at::kFloat));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  visit_cuda_float_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    C10_CUDA_CHECK(ripplekv::cuda::launch_snapkv_scores<T>(p, workspace.data_ptr<float>(), stream));
  });
}

at::Tensor snapkv_scores_cuda(const at::Tensor& q_window, const at::Tensor& keys, int64_t kernel_size,
                              c10::string_view pooling, c10::string_view group_reduce, std::optional<double> scale) {
  constexpr const char* op = "snapkv_scores";
  check_window_inputs(q_window, keys, op);
  check_window_below_n(q_window, keys, op);
  check_kernel_size(kernel_size, op);
  const c10::cuda::CUDAGuard guard(keys.device());
  auto scores = at::empty({keys.size(0), keys.size(1), keys.size(2) - q_window.size(2)},
                          keys.options().dtype(at::kFloat));
  run_snapkv_scores(make_snapkv_scores_params(q_window, keys, scores.data_ptr<float>(), strides3(scores), kernel_size,
                                              pooling, group_reduce, scale, op),
                    keys.scalar_type(), keys);
  return scores;
}

// Scores into a [B, H_kv, N - W] scratch, select, gather: the probabilities are never formed, so the
// scratch is the split statistics (O(B * H_q * W)) plus O(B * H_kv * N).
std::tuple<at::Tensor, at::Tensor, at::Tensor> snapkv_compress_cuda(
    const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values, int64_t budget,
    int64_t kernel_size, c10::string_view pooling, c10::string_view group_reduce, std::optional<double> scale) {
  constexpr const char* op = "snapkv_compress";
  check_snapkv_compress_inputs(q_window, keys, values, budget, kernel_size, pooling, group_reduce, op);
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2), W = q_window.size(2);
  const c10::cuda::CUDAGuard guard(keys.device());
  if (N <= budget) {
    return {keys.contiguous().clone(), values.contiguous().clone(),
            at::arange(N, keys.options().dtype(at::kLong)).expand({B, H, N}).contiguous()};
  }
  auto scores = at::empty({B, H, N - W}, keys.options().dtype(at::kFloat));
  run_snapkv_scores(make_snapkv_scores_params(q_window, keys, scores.data_ptr<float>(), strides3(scores), kernel_size,
                                              pooling, group_reduce, scale, op),
                    keys.scalar_type(), keys);
  auto indices = at::empty({B, H, budget}, keys.options().dtype(at::kLong));
  run_select_topk_packed_cuda(scores.unsqueeze(0), {budget}, {0, budget}, W, indices, op);
  auto [keys_out, values_out] = empty_gather_kv_outputs(keys, indices);
  const auto p = make_gather_kv_params(keys, values, indices, keys_out, values_out);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(keys.element_size() == 4 ? ripplekv::launch_gather_kv<uint32_t>(p, stream)
                                          : ripplekv::launch_gather_kv<uint16_t>(p, stream));
  return {keys_out, values_out, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) {
  m.impl("snapkv_scores", &snapkv_scores_cuda);
  m.impl("snapkv_compress", &snapkv_compress_cuda);
}

}  // namespace ripplekv_ext
