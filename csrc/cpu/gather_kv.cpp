#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../gather_kv.h"

namespace ripplekv_ext {
namespace {

template <typename T>
void run_gather_kv(const ripplekv::GatherKVParams& p) {
  // Each row copies C * D elements twice; a grain of a few rows keeps small calls single-threaded.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, p.C * p.D));
  at::parallel_for(0, p.B * p.H, grain, [&](int64_t begin, int64_t end) {
    check_status(ripplekv::gather_kv_rows<T>(p, begin, end), "gather_kv", "indices",
                 "must lie in [0, N) = [0, " + std::to_string(p.N) + ")");
  });
}

void gather_kv_into_cpu(const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& indices, at::Tensor& keys_out, at::Tensor& values_out) {
  check_gather_kv_inputs(keys, values, indices, "gather_kv_into");
  check_gather_kv_outputs(keys, indices, keys_out, values_out, "gather_kv_into");
  const auto p = make_gather_kv_params(keys, values, indices, keys_out, values_out);
  if (keys.element_size() == 4) {
    run_gather_kv<uint32_t>(p);
  } else {
    run_gather_kv<uint16_t>(p);
  }
}

std::tuple<at::Tensor, at::Tensor> gather_kv_cpu(const at::Tensor& keys, const at::Tensor& values,
                                                 const at::Tensor& indices) {
  check_gather_kv_inputs(keys, values, indices, "gather_kv");
  auto [keys_out, values_out] = empty_gather_kv_outputs(keys, indices);
  gather_kv_into_cpu(keys, values, indices, keys_out, values_out);
  return {keys_out, values_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) {
  m.impl("gather_kv", &gather_kv_cpu);
  m.impl("gather_kv_into", &gather_kv_into_cpu);
}

}  // namespace ripplekv_ext
