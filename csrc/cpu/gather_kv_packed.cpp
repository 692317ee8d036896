#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../packed.h"

namespace ripplekv_ext {
namespace {

// Each layer is an ordinary gather whose index and output pointers start at its segment.
void run_gather_kv_packed_cpu(at::TensorList keys, at::TensorList values, const at::Tensor& indices_flat,
                              const std::vector<int64_t>& off, const at::Tensor&, at::Tensor& keys_out,
                              at::Tensor& values_out) {
  const int64_t L = keys.size(), BH = keys[0].size(0) * keys[0].size(1);
  std::vector<ripplekv::GatherKVParams> layers;
  for (int64_t l = 0; l < L; ++l) {
    auto p = make_gather_kv_params(keys[l], values[l], indices_flat, keys_out, values_out);
    p.indices += off[l] * p.idx.c;
    p.keys_out = static_cast<char*>(p.keys_out) + off[l] * p.ko.n * keys_out.element_size();
    p.values_out = static_cast<char*>(p.values_out) + off[l] * p.vo.n * values_out.element_size();
    p.C = off[l + 1] - off[l];
    layers.push_back(p);
  }
  const bool wide = keys_out.element_size() == 4;
  at::parallel_for(0, L * BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto& p = layers[r / BH];
      const ripplekv::Status s = wide ? ripplekv::gather_kv_rows<uint32_t>(p, r % BH, r % BH + 1)
                                      : ripplekv::gather_kv_rows<uint16_t>(p, r % BH, r % BH + 1);
      check_status(s, "gather_kv_packed", "indices_flat", "must lie in [0, N) = [0, " + std::to_string(p.N) + ")");
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("gather_kv_packed", &gather_kv_packed_op<run_gather_kv_packed_cpu>); }

}  // namespace ripplekv_ext
