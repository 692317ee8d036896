#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "../select_topk.h"
#include "../snapkv_scores.h"
#include "ripplekv/snapkv_compress.h"
#include "snapkv_parallel.h"

namespace ripplekv_ext {
namespace {

void run_snapkv_compress_cpu(const ripplekv::SnapKVScoresParams& score, const at::Tensor& keys,
                             const at::Tensor& values, int64_t budget, at::Tensor& indices, at::Tensor& keys_out,
                             at::Tensor& values_out) {
  constexpr const char* op = "snapkv_compress";
  ripplekv::SnapKVCompressParams p{};
  p.score = score;
  p.gather = make_gather_kv_params(keys, values, indices, keys_out, values_out);
  p.indices = indices.data_ptr<int64_t>();
  p.idx = strides3(indices);
  p.budget = budget;
  std::vector<float> raw(score.B * score.H_kv * (score.N - score.W));
  visit_float_type(keys.scalar_type(), [&](auto type_tag) {
    using T = decltype(type_tag);
    snapkv_raw_scores_parallel<T>(p.score, raw.data());
    at::parallel_for(0, score.B * score.H_kv, 1, [&](int64_t begin, int64_t end) {
      const ripplekv::Status s = ripplekv::snapkv_select_gather_rows<T>(p, raw.data(), begin, end);
      if (s.code == ripplekv::StatusCode::kNaN) fail_nan_score(op, s.row, s.value, score.B, score.H_kv);
      check_status(s, op, "arguments", "must be valid");
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("snapkv_compress", &snapkv_compress_op<run_snapkv_compress_cpu>); }

}  // namespace ripplekv_ext
