#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "launchers.h"
#include "ripplekv/gather_kv.cuh"

namespace ripplekv_ext {

void run_gather_kv_cuda(const ripplekv::GatherKVParams& p, int64_t element_size) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The gather copies bits, so the element width is all the kernel needs to know.
  C10_CUDA_CHECK(element_size == 4 ? ripplekv::cuda::launch_gather_kv<uint32_t>(p, stream)
                                   : ripplekv::cuda::launch_gather_kv<uint16_t>(p, stream));
}

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) {
  m.impl("gather_kv", &gather_kv_op<run_gather_kv_cuda>);
  m.impl("gather_kv_into", &gather_kv_into_op<run_gather_kv_cuda>);
}

}  // namespace ripplekv_ext
