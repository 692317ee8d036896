#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "ripplekv/gather_kv.cuh"

namespace ripplekv_ext {
namespace {

void gather_kv_into_cuda(const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& indices, at::Tensor& keys_out, at::Tensor& values_out) {
  check_gather_kv_inputs(keys, values, indices, "gather_kv_into");
  check_gather_kv_outputs(keys, indices, keys_out, values_out, "gather_kv_into");
  const c10::cuda::CUDAGuard guard(keys.device());
  const auto p = make_gather_kv_params(keys, values, indices, keys_out, values_out);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The gather copies bits, so the element width is all the kernel needs to know.
  const cudaError_t err = keys.element_size() == 4 ? ripplekv::launch_gather_kv<uint32_t>(p, stream)
                                                   : ripplekv::launch_gather_kv<uint16_t>(p, stream);
  C10_CUDA_CHECK(err);
}

std::tuple<at::Tensor, at::Tensor> gather_kv_cuda(const at::Tensor& keys,
                                                  const at::Tensor& values,
                                                  const at::Tensor& indices) {
  check_gather_kv_inputs(keys, values, indices, "gather_kv");
  auto [keys_out, values_out] = empty_gather_kv_outputs(keys, indices);
  gather_kv_into_cuda(keys, values, indices, keys_out, values_out);
  return {keys_out, values_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) {
  m.impl("gather_kv", &gather_kv_cuda);
  m.impl("gather_kv_into", &gather_kv_into_cuda);
}

}  // namespace ripplekv_ext
