// Torch-free tests of the CPU selection and scoring kernels in include/ripplekv/: hand-worked rows
// (ties, -inf, N <= C, budget == W) and a brute-force comparison, as an engine embedding the headers
// without libtorch would rely on.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "ripplekv/numeric.h"
#include "ripplekv/select_topk.h"
#include "ripplekv/snapkv_scores.h"

#include "expect.h"

static std::vector<int64_t> select_row(const std::vector<float>& scores, int64_t w, int64_t budget) {
  const int64_t n = static_cast<int64_t>(scores.size()) + w;
  std::vector<int64_t> out(std::min(n, budget), -1);
  const ripplekv::SelectTopKParams p{scores.data(), out.data(), 1, 1, n, w, budget,
                                     ripplekv::Strides3{0, 0, 1}, ripplekv::Strides3{0, 0, 1}};
  EXPECT(ripplekv::select_topk_rows(p, 0, 1).ok());
  return out;
}

// Independent oracle: stable sort of positions by descending score, keep the first budget - w.
static std::vector<int64_t> brute_force(const std::vector<float>& scores, int64_t w, int64_t budget) {
  const int64_t n_prefix = static_cast<int64_t>(scores.size()), n = n_prefix + w;
  std::vector<int64_t> order(n_prefix);
  std::iota(order.begin(), order.end(), 0);
  if (n <= budget) {
    std::vector<int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  order.resize(budget - w);
  for (int64_t j = n_prefix; j < n; ++j) order.push_back(j);
  std::sort(order.begin(), order.end());
  return order;
}

int main() {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT((select_row({3, 1, 3, 2, 0}, 2, 4) == std::vector<int64_t>{0, 2, 5, 6}));
  EXPECT((select_row({1, 1, 1, 1}, 1, 3) == std::vector<int64_t>{0, 1, 4}));        // ties: lower wins
  EXPECT((select_row({-inf, 0.5f, -inf}, 1, 3) == std::vector<int64_t>{0, 1, 3}));  // -inf is just low
  EXPECT((select_row({5, 4}, 2, 2) == std::vector<int64_t>{2, 3}));                 // budget == W
  EXPECT((select_row({5, 4}, 2, 9) == std::vector<int64_t>{0, 1, 2, 3}));           // N <= C
  EXPECT((select_row({2, 7}, 0, 1) == std::vector<int64_t>{1}));                    // W = 0

  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n_prefix = 1 + rng() % 60, w = rng() % 5, budget = w + rng() % (n_prefix + 3);
    std::vector<float> scores(n_prefix);
    for (float& s : scores) s = static_cast<float>(rng() % 6);  // few distinct values: many ties
    EXPECT(select_row(scores, w, budget) == brute_force(scores, w, budget));
  }

  // NaN is reported with its position; a budget below the window is rejected.
  std::vector<float> with_nan{1, std::nanf(""), 2};
  std::vector<int64_t> out(3);
  ripplekv::SelectTopKParams p{with_nan.data(), out.data(), 1, 1, 4, 1, 2, {0, 0, 1}, {0, 0, 1}};
  ripplekv::Status s = ripplekv::select_topk_rows(p, 0, 1);
  EXPECT(s.code == ripplekv::StatusCode::kNaN && s.value == 1);
  p.W = 3;
  p.N = 6;
  EXPECT(ripplekv::select_topk_rows(p, 0, 1).code == ripplekv::StatusCode::kInvalidArgument);

  // The vectorizable exp against libm over the softmax range, and the fp16/bf16 decoders.
  for (float x = -100.0f; x <= 0.0f; x += 0.037f) {
    const float expected = std::exp(x), got = ripplekv::exp_nonpositive(x);
    EXPECT(x < -87.0f ? got == 0.0f : std::fabs(got - expected) <= 3e-7f * expected);
  }
  EXPECT(ripplekv::exp_nonpositive(-inf) == 0.0f && ripplekv::exp_nonpositive(0.0f) == 1.0f);
  EXPECT(ripplekv::to_float(ripplekv::Half{0x3c00}) == 1.0f);
  EXPECT(ripplekv::to_float(ripplekv::Half{0xc000}) == -2.0f);
  EXPECT(ripplekv::to_float(ripplekv::Half{0x0001}) == 5.9604644775390625e-8f);  // smallest subnormal
  EXPECT(std::isinf(ripplekv::to_float(ripplekv::Half{0x7c00})));
  EXPECT(ripplekv::to_float(ripplekv::BFloat16{0x3f80}) == 1.0f);

  // Pooling by hand: max pads with -inf, avg counts the zero padding.
  const float raw[5] = {1, 5, 2, 0, 3};
  float pooled[5];
  ripplekv::detail::pool_row(raw, 5, 3, ripplekv::Pooling::kMax, pooled, 1);
  EXPECT(pooled[0] == 5 && pooled[1] == 5 && pooled[2] == 5 && pooled[3] == 3 && pooled[4] == 3);
  ripplekv::detail::pool_row(raw, 5, 3, ripplekv::Pooling::kAvg, pooled, 1);
  EXPECT(pooled[0] == 2.0f && pooled[4] == 1.0f);

  // SnapKV with zero queries: uniform attention, query 0 sees 3 keys and query 1 sees 4.
  std::vector<float> q(2 * 2, 0.0f), k(4 * 2, 1.0f), scores(2, 0.0f);
  ripplekv::SnapKVScoresParams sp{};
  sp.q_window = q.data();
  sp.keys = k.data();
  sp.scores = scores.data();
  sp.B = sp.H_kv = sp.G = 1;
  sp.W = 2;
  sp.N = 4;
  sp.D = 2;
  sp.q = {4, 4, 2, 1};
  sp.k = {8, 8, 2, 1};
  sp.s = {2, 2, 1};
  sp.scale = 1.0f;
  sp.kernel_size = 1;
  EXPECT(ripplekv::snapkv_scores_rows<float>(sp, 0, 1).ok());
  EXPECT(std::fabs(scores[0] - (1.0f / 3 + 1.0f / 4)) < 1e-6f && std::fabs(scores[1] - scores[0]) < 1e-7f);
  std::printf("select_topk_rows, exp_nonpositive, pool_row, snapkv_scores_rows: ok\n");
  return 0;
}
