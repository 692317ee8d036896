// The CPU SnapKV driver an engine embedding only include/ gets (ripplekv/snapkv_parallel.h), torch-free:
// with a plain-loop parallel-for, with and without the exp store, and with store budgets that force row
// groups, its scores equal the one-row-at-a-time kernel's; an empty batch does nothing (it used to
// divide by a zero group size).
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "ripplekv/snapkv_parallel.h"

#include "expect.h"

namespace {

// Runs body over [begin, end) in pieces of 3, as a thread pool would hand out ranges.
struct PiecewiseFor {
  template <typename Body>
  void operator()(int64_t begin, int64_t end, const Body& body) const {
    for (int64_t b = begin; b < end; b += 3) body(b, std::min(end, b + 3));
  }
};

ripplekv::SnapKVScoresParams params(const std::vector<float>& q, const std::vector<float>& k, float* scores,
                                    int64_t B, int64_t H, int64_t G, int64_t W, int64_t N, int64_t D) {
  ripplekv::SnapKVScoresParams p{};
  p.q_window = q.data();
  p.keys = k.data();
  p.scores = scores;
  p.B = B, p.H_kv = H, p.G = G, p.W = W, p.N = N, p.D = D;
  p.q = {H * G * W * D, W * D, D, 1};
  p.k = {H * N * D, N * D, D, 1};
  p.s = {H * (N - W), N - W, 1};
  p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  p.kernel_size = 5;
  p.pooling = ripplekv::Pooling::kMax;
  p.group_reduce = ripplekv::GroupReduce::kMean;
  return p;
}

}  // namespace

int main() {
  const int64_t B = 2, H = 3, G = 2, W = 5, N = 1300, D = 16;
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<float> q(B * H * G * W * D), k(B * H * N * D);
  for (float& x : q) x = normal(gen);
  for (float& x : k) x = normal(gen);

  std::vector<float> expected(B * H * (N - W));
  auto p = params(q, k, expected.data(), B, H, G, W, N, D);
  EXPECT(ripplekv::snapkv_scores_rows<float>(p, 0, B * H).ok());

  // Store off, a budget that fits one row's store at a time, and one that fits them all.
  for (const int64_t budget : {int64_t{0}, int64_t{400} << 10, int64_t{64} << 20}) {
    for (const int64_t threads : {int64_t{1}, int64_t{8}}) {
      std::vector<float> raw(B * H * (N - W), std::nanf("")), scores(B * H * (N - W));
      p.scores = scores.data();
      ripplekv::snapkv_raw_scores_parallel<float>(p, raw.data(), {threads, budget}, PiecewiseFor{});
      ripplekv::pool_scores_rows(p, raw.data(), 0, B * H);
      for (size_t i = 0; i < scores.size(); ++i)
        EXPECT(std::fabs(scores[i] - expected[i]) <= 1e-5f * std::fabs(expected[i]) + 1e-7f);
    }
  }

  // An empty batch: nothing scored, nothing divided by zero.
  auto empty = params(q, k, nullptr, 0, H, G, W, N, D);
  ripplekv::snapkv_raw_scores_parallel<float>(empty, nullptr, {4, int64_t{16} << 20}, PiecewiseFor{});
  std::printf("snapkv_parallel: ok\n");
  return 0;
}
