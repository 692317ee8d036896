#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../packed.h"
#include "ripplekv/gather_kv.cuh"
#include "ripplekv/gather_kv_packed.cuh"

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

// Layer pointers travel as one small device array, so all layers must share strides (the usual case:
// one cache layout for every layer). Offsets stay on the device: no sync to read them.
std::tuple<at::Tensor, at::Tensor> gather_kv_packed_cuda(at::TensorList keys, at::TensorList values,
                                                         const at::Tensor& indices_flat, const at::Tensor& offsets) {
  constexpr const char* op = "gather_kv_packed";
  check_gather_kv_packed_inputs(keys, values, indices_flat, offsets, op);
  check_same_device(offsets, keys[0], op, "offsets", "keys[0]");
  const c10::cuda::CUDAGuard guard(keys[0].device());
  auto [keys_out, values_out] = empty_packed_outputs(keys[0], indices_flat);
  const int64_t L = keys.size();
  std::vector<int64_t> pointers(2 * L);
  bool aligned = ripplekv::detail::aligned16(keys_out.data_ptr()) && ripplekv::detail::aligned16(values_out.data_ptr());
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(keys[l].strides() == keys[0].strides(), op, ": keys[", l, "] must have the strides of keys[0] ",
                keys[0].strides(), " on CUDA, got ", keys[l].strides());
    TORCH_CHECK(values[l].strides() == values[0].strides(), op, ": values[", l,
                "] must have the strides of values[0] ", values[0].strides(), " on CUDA, got ", values[l].strides());
    pointers[l] = reinterpret_cast<int64_t>(keys[l].data_ptr());
    pointers[L + l] = reinterpret_cast<int64_t>(values[l].data_ptr());
    aligned = aligned && ripplekv::detail::aligned16(keys[l].data_ptr()) &&
              ripplekv::detail::aligned16(values[l].data_ptr());
  }
  const at::Tensor pointers_d = at::tensor(pointers, at::kLong).to(keys[0].device());
  const at::Tensor offsets_c = offsets.contiguous();
  ripplekv::cuda::GatherKVPackedParams p{};
  p.keys = reinterpret_cast<const void* const*>(pointers_d.data_ptr<int64_t>());
  p.values = reinterpret_cast<const void* const*>(pointers_d.data_ptr<int64_t>() + L);
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
  C10_CUDA_CHECK(ripplekv::cuda::launch_gather_kv_packed(p, keys_out.element_size(), aligned,
                                                         at::cuda::getCurrentCUDAStream()));
  return {keys_out, values_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) {
  m.impl("gather_kv_packed", &gather_kv_packed_cuda);
  m.impl("gather_kv", &gather_kv_cuda);
  m.impl("gather_kv_into", &gather_kv_into_cuda);
}

}  // namespace ripplekv_ext
