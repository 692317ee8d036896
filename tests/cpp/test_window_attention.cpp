// The AVX2 window-attention kernel against the portable one, torch-free: SnapKV raw scores and H2O
// scores on random rows over shapes that stress its padding (queries per head not a multiple of 8,
// odd D, tails of the key tile), every element type, strided dims, and masked keys.
#include <cmath>
#include <cstring>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "ripplekv/h2o_scores.h"
#include "ripplekv/snapkv_scores.h"

#include "expect.h"

#ifdef RIPPLEKV_HAS_AVX2_KERNELS
using ripplekv::BFloat16;
using ripplekv::Half;

template <typename T>
T from_float(float x);
template <>
float from_float<float>(float x) { return x; }
template <>
BFloat16 from_float<BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return BFloat16{static_cast<uint16_t>(u >> 16)};  // truncation is fine: both kernels read the same bits
}
template <>
Half from_float<Half>(float x) {  // |x| in the normal fp16 range or 0
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t sign = (u >> 16) & 0x8000u;
  const int e = static_cast<int>((u >> 23) & 0xffu) - 127 + 15;
  if (e <= 0) return Half{sign};
  return Half{static_cast<uint16_t>(sign | (e << 10) | ((u >> 13) & 0x3ffu))};
}

static bool close(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= 1e-5f * std::fabs(b[i]) + 1e-7f)) {
      std::fprintf(stderr, "element %zu: avx2 %.9g vs portable %.9g\n", i, a[i], b[i]);
      return false;
    }
  return true;
}

// Scores split over key ranges as the torch binding does for load balance (csrc/cpu/snapkv_parallel.h):
// partial statistics merged, then each prefix range scored on its own, from the keys or (store) from
// the exps pass 1 kept; ranges start on key-tile multiples, as the store needs.
template <typename Attention, typename T>
std::vector<float> chunked_scores(const ripplekv::SnapKVScoresParams& sp, int64_t chunks, bool store) {
  constexpr int64_t tile = Attention::kKeyTile;
  const int64_t gw = sp.G * sp.W, n_prefix = sp.N - sp.W, width = Attention::store_width(sp.G, sp.W);
  std::vector<float> max(chunks * gw), sum(chunks * gw), merged_max(gw), merged_sum(gw), raw(n_prefix);
  // NaN-filled, so a read of anything pass 1 did not write shows up in the scores.
  std::vector<float> kept(store ? (sp.N + (sp.N + tile - 1) / tile) * width : 0, std::nanf(""));
  float* exps = store ? kept.data() : nullptr;
  float* shifts = store ? kept.data() + sp.N * width : nullptr;
  const auto round_up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  const int64_t keys_per_chunk = round_up((sp.N + chunks - 1) / chunks, tile);
  for (int64_t c = 0; c < chunks; ++c)
    ripplekv::detail::snapkv_window_stats_with<Attention, T>(sp, 0, c * keys_per_chunk, (c + 1) * keys_per_chunk,
                                                             &max[c * gw], &sum[c * gw], exps, shifts);
  ripplekv::detail::merge_softmax_stats(max.data(), sum.data(), chunks, gw, merged_max.data(), merged_sum.data());
  const int64_t prefix_per_chunk = round_up((n_prefix + chunks - 1) / chunks, tile);
  for (int64_t j0 = 0; j0 < n_prefix; j0 += prefix_per_chunk)
    ripplekv::detail::snapkv_raw_scores_with<Attention, T>(sp, 0, merged_max.data(), merged_sum.data(), j0,
                                                           std::min(n_prefix, j0 + prefix_per_chunk), &raw[j0],
                                                           exps, shifts);
  return raw;
}

// One row of SnapKV raw scores and of H2O scores, both kernels; dim_stride 2 reads every other
// element of a buffer twice as wide (a non-contiguous head dim).
template <typename T>
void compare(std::mt19937& rng, int64_t G, int64_t W, int64_t D, int64_t N, int64_t dim_stride) {
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<T> q(G * W * D * dim_stride), k(N * D * dim_stride), hq(G * N * D * dim_stride);
  for (auto& x : q) x = from_float<T>(normal(rng));
  for (auto& x : k) x = from_float<T>(normal(rng));
  for (auto& x : hq) x = from_float<T>(normal(rng));

  ripplekv::SnapKVScoresParams sp{};
  sp.q_window = q.data();
  sp.keys = k.data();
  sp.B = sp.H_kv = 1;
  sp.G = G;
  sp.W = W;
  sp.N = N;
  sp.D = D;
  sp.q = {0, W * D * dim_stride, D * dim_stride, dim_stride};
  sp.k = {0, 0, D * dim_stride, dim_stride};
  sp.scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> fast(N - W), slow(N - W);
  ripplekv::detail::snapkv_raw_scores_row_with<ripplekv::detail::WindowAttentionAvx2, T>(sp, 0, fast.data());
  ripplekv::detail::snapkv_raw_scores_row_with<ripplekv::detail::WindowAttention, T>(sp, 0, slow.data());
  EXPECT(close(fast, slow));
  // Split over key ranges, with and without the store: the same scores with either kernel.
  for (int64_t chunks : {1, 2, 3, 7})
    for (bool store : {false, true}) {
      EXPECT(close(chunked_scores<ripplekv::detail::WindowAttentionAvx2, T>(sp, chunks, store), slow));
      EXPECT(close(chunked_scores<ripplekv::detail::WindowAttention, T>(sp, chunks, store), slow));
    }

  ripplekv::H2OScoresParams hp{};
  hp.queries = hq.data();
  hp.keys = k.data();
  hp.B = hp.H_kv = 1;
  hp.G = G;
  hp.N = N;
  hp.D = D;
  hp.chunk_size = 1 + W;  // chunks that split heads' query blocks unevenly
  hp.q = {0, N * D * dim_stride, D * dim_stride, dim_stride};
  hp.k = sp.k;
  hp.s = {0, 0, 1};
  hp.scale = sp.scale;
  std::vector<float> h2o_fast(N), h2o_slow(N);
  hp.scores = h2o_fast.data();
  EXPECT((ripplekv::detail::h2o_scores_rows_with<ripplekv::detail::WindowAttentionAvx2, T>(hp, 0, 1).ok()));
  hp.scores = h2o_slow.data();
  EXPECT((ripplekv::detail::h2o_scores_rows_with<ripplekv::detail::WindowAttention, T>(hp, 0, 1).ok()));
  EXPECT(close(h2o_fast, h2o_slow));
}

// exp_nonpositive_avx2 on 8 floats (intrinsics need a function compiled for AVX2).
RIPPLEKV_AVX2 static void exp8(const float* in, float* out) {
  _mm256_storeu_ps(out, ripplekv::detail::exp_nonpositive_avx2(_mm256_loadu_ps(in)));
}

int main() {
  if (!ripplekv::detail::window_attention_avx2_enabled()) {
    std::printf("this CPU has no AVX2/FMA/F16C: nothing to compare (the portable kernel is used)\n");
    return 0;
  }
  std::mt19937 rng(3);
  const int64_t shapes[][4] = {  // G, W, D, N
      {1, 1, 3, 2},     {1, 5, 16, 40}, {3, 7, 64, 97}, {4, 32, 128, 300}, {8, 9, 100, 49}, {2, 16, 64, 48 + 16 + 1},
      {3, 32, 64, 1000}};
  for (const auto& s : shapes)
    for (int64_t dim_stride : {1, 2}) {
      compare<float>(rng, s[0], s[1], s[2], s[3], dim_stride);
      compare<Half>(rng, s[0], s[1], s[2], s[3], dim_stride);
      compare<BFloat16>(rng, s[0], s[1], s[2], s[3], dim_stride);
    }

  // exp_nonpositive_avx2 against the scalar version over the softmax range, -inf, 0 and NaN.
  for (float x0 = -100.0f; x0 <= 0.0f; x0 += 0.37f) {
    float in[8], out[8];
    for (int i = 0; i < 8; ++i) in[i] = x0 + 0.04f * i > 0.0f ? 0.0f : x0 + 0.04f * i;
    exp8(in, out);
    for (int i = 0; i < 8; ++i) {
      const float expected = ripplekv::exp_nonpositive(in[i]);
      EXPECT(std::fabs(out[i] - expected) <= 3e-7f * expected);
    }
  }
  float special[8] = {-INFINITY, 0.0f, NAN, -88.0f, -1e30f, -0.0f, -87.0f, -1e-30f}, out[8];
  exp8(special, out);
  EXPECT(out[0] == 0.0f && out[1] == 1.0f && std::isnan(out[2]) && out[3] == 0.0f && out[4] == 0.0f && out[5] == 1.0f);
  EXPECT(out[6] > 0.0f && out[7] == 1.0f);
  std::printf("WindowAttentionAvx2 matches WindowAttention (SnapKV and H2O, fp32/fp16/bf16): ok\n");
  return 0;
}
#else
int main() {
  std::printf("not an x86-64 GCC/Clang build: the AVX2 kernel does not exist here\n");
  return 0;
}
#endif
