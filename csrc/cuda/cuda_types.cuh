// Maps a float dtype to the CUDA element type the kernels are templated over.
#pragma once

#include "../aten.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ripplekv_ext {

template <typename F>
void visit_cuda_float_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "ripplekv: unsupported dtype ", dtype);
  }
}

}  // namespace ripplekv_ext
