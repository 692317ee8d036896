#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../packed.h"
#include "ripplekv/gather_kv_packed.cuh"

namespace ripplekv_ext {
namespace {

// Layer pointers travel as one small device array, so all layers must share strides (the usual case:
// one cache layout for every layer). The op has validated offsets and indices before this runs.
void run_gather_kv_packed_cuda(at::TensorList keys, at::TensorList values, const at::Tensor& indices_flat,
                               const std::vector<int64_t>&, const at::Tensor& offsets, at::Tensor& keys_out,
                               at::Tensor& values_out) {
  constexpr const char* op = "gather_kv_packed";
  const c10::cuda::CUDAGuard guard(keys[0].device());
  const int64_t L = keys.size();
  std::vector<int64_t> pointers(2 * L);
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(keys[l].strides() == keys[0].strides(), op, ": keys[", l, "] must have the strides of keys[0] ",
                keys[0].strides(), " on CUDA, got ", keys[l].strides());
    TORCH_CHECK(values[l].strides() == values[0].strides(), op, ": values[", l,
                "] must have the strides of values[0] ", values[0].strides(), " on CUDA, got ", values[l].strides());
    pointers[l] = reinterpret_cast<int64_t>(keys[l].data_ptr());
    pointers[L + l] = reinterpret_cast<int64_t>(values[l].data_ptr());
  }
  const at::Tensor pointers_d = at::tensor(pointers, at::kLong).to(keys[0].device());
  const at::Tensor offsets_c = offsets.contiguous();
  ripplekv::cuda::GatherKVPackedParams p{};
  p.keys = reinterpret_cast<const void* const*>(pointers_d.data_ptr<int64_t>());
  p.values = reinterpret_cast<const void* const*>(pointers_d.data_ptr<int64_t>() + L);
  p.keys_host = reinterpret_cast<const void* const*>(pointers.data());
  p.values_host = reinterpret_cast<const void* const*>(pointers.data() + L);
  p.indices = indices_flat.data_ptr<int64_t>();
  p.offsets = offsets_c.data_ptr<int64_t>();
  p.keys_out = keys_out.data_ptr();
  p.values_out = values_out.data_ptr();
  p.L = L;
  p.B = keys[0].size(0);
  p.H = keys[0].size(1);
  p.N = keys[0].size(2);
  p.total = indices_flat.size(2);
  p.D_units = keys[0].size(3);
  p.k = strides4(keys[0]);
  p.v = strides4(values[0]);
  p.ko = strides4(keys_out);
  p.vo = strides4(values_out);
  p.idx = strides3(indices_flat);
  C10_CUDA_CHECK(
      ripplekv::cuda::launch_gather_kv_packed(p, keys_out.element_size(), at::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("gather_kv_packed", &gather_kv_packed_op<run_gather_kv_packed_cuda>); }

}  // namespace ripplekv_ext
