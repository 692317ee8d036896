#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../packed.h"
#include "ripplekv/select_topk.h"

namespace ripplekv_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> select_topk_packed_cpu(const at::Tensor& scores, at::IntArrayRef budgets,
                                                          int64_t window) {
  constexpr const char* op = "select_topk_packed";
  const std::vector<int64_t> offsets = packed_offsets(scores, budgets, window, op);
  const int64_t L = scores.size(0), B = scores.size(1), H = scores.size(2), N = scores.size(3) + window;
  auto indices = at::empty({B, H, offsets.back()}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  int64_t* out = indices.data_ptr<int64_t>();
  // One task per (layer, b, h) row: every layer is selected in this single call.
  at::parallel_for(0, L * B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t l = r / (B * H), b = r / H % B, h = r % H;
      const ripplekv::Status st = ripplekv::detail::select_topk_row(
          s + l * scores.stride(0) + b * scores.stride(1) + h * scores.stride(2), scores.stride(3), N, window,
          budgets[l], out + b * indices.stride(0) + h * indices.stride(1) + offsets[l] * indices.stride(2),
          indices.stride(2), r, scratch);
      TORCH_CHECK(st.ok(), op, ": scores must not contain NaN, got NaN at position ", st.value, " of layer ", l,
                  ", row ", b * H + h, " (row = b * H_kv + h)");
    }
  });
  return {indices, at::tensor(offsets, at::kLong).to(scores.device())};
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("select_topk_packed", &select_topk_packed_cpu); }

}  // namespace ripplekv_ext
