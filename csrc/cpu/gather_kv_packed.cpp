#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../packed.h"
#include "ripplekv/gather_kv.h"

namespace ripplekv_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> gather_kv_packed_cpu(at::TensorList keys, at::TensorList values,
                                                        const at::Tensor& indices_flat, const at::Tensor& offsets) {
  constexpr const char* op = "gather_kv_packed";
  check_gather_kv_packed_inputs(keys, values, indices_flat, offsets, op);
  const auto off_cpu = offsets.contiguous();
  const std::vector<int64_t> off(off_cpu.data_ptr<int64_t>(), off_cpu.data_ptr<int64_t>() + off_cpu.numel());
  check_offsets_values(off, indices_flat.size(2), op);
  auto [keys_out, values_out] = empty_packed_outputs(keys[0], indices_flat);
  const int64_t L = keys.size(), BH = keys[0].size(0) * keys[0].size(1);
  // Each layer is an ordinary gather whose index and output pointers start at its segment.
  std::vector<ripplekv::GatherKVParams> layers;
  for (int64_t l = 0; l < L; ++l) {
    auto p = make_gather_kv_params(keys[l], values[l], indices_flat, keys_out, values_out);
    p.indices += off[l] * p.idx.c;
    p.keys_out = static_cast<char*>(p.keys_out) + off[l] * p.ko.n * keys_out.element_size();
    p.values_out = static_cast<char*>(p.values_out) + off[l] * p.vo.n * values_out.element_size();
    p.C = off[l + 1] - off[l];
    layers.push_back(p);
  }
  auto run = [&](auto element) {
    using T = decltype(element);
    at::parallel_for(0, L * BH, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t l = r / BH;
        check_status(ripplekv::gather_kv_rows<T>(layers[l], r % BH, r % BH + 1), op, "indices_flat",
                     "must lie in [0, N) = [0, " + std::to_string(keys[0].size(2)) + ") (layer " + std::to_string(l) +
                         ")");
      }
    });
  };
  if (keys_out.element_size() == 4) {
    run(uint32_t{});
  } else {
    run(uint16_t{});
  }
  return {keys_out, values_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("gather_kv_packed", &gather_kv_packed_cpu); }

}  // namespace ripplekv_ext
