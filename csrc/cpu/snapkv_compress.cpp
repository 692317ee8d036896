#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../select_topk.h"
#include "../snapkv_scores.h"
#include "ripplekv/snapkv_compress.h"
#include "snapkv_parallel.h"

namespace ripplekv_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> snapkv_compress_cpu(
    const at::Tensor& q_window, const at::Tensor& keys, const at::Tensor& values, int64_t budget,
    int64_t kernel_size, c10::string_view pooling, c10::string_view group_reduce, std::optional<double> scale) {
  constexpr const char* op = "snapkv_compress";
  check_snapkv_compress_inputs(q_window, keys, values, budget, kernel_size, pooling, group_reduce, op);
  const int64_t B = keys.size(0), H = keys.size(1), N = keys.size(2);
  if (N <= budget) {  // nothing to compress: the whole cache, as fresh contiguous buffers
    return {keys.contiguous().clone(), values.contiguous().clone(),
            at::arange(N, keys.options().dtype(at::kLong)).expand({B, H, N}).contiguous()};
  }
  auto indices = at::empty({B, H, budget}, keys.options().dtype(at::kLong));
  auto [keys_out, values_out] = empty_gather_kv_outputs(keys, indices);
  ripplekv::SnapKVCompressParams p{};
  p.score = make_snapkv_scores_params(q_window, keys, nullptr, {0, 0, 0}, kernel_size, pooling, group_reduce, scale,
                                      op);
  p.gather = make_gather_kv_params(keys, values, indices, keys_out, values_out);
  p.indices = indices.data_ptr<int64_t>();
  p.idx = strides3(indices);
  p.budget = budget;
  std::vector<float> raw(B * H * (N - q_window.size(2)));
  visit_float_type(keys.scalar_type(), [&](auto type_tag) {
    using T = decltype(type_tag);
    snapkv_raw_scores_parallel<T>(p.score, raw.data());
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      check_status(ripplekv::snapkv_select_gather_rows<T>(p, raw.data(), begin, end), op, "scores",
                   "must not be NaN (check q_window and keys for NaN/inf)");
    });
  });
  return {keys_out, values_out, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("snapkv_compress", &snapkv_compress_cpu); }

}  // namespace ripplekv_ext
