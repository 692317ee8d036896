// Causal softmax attention mass of a block of queries, CPU, AVX2 + FMA + F16C.
//
// The same two passes and interface as WindowAttention (window_attention.h), laid out for 8-wide
// vectors. Pass 1 finds each query's softmax max and normalizer tile by tile, pass 2 recomputes a key
// tile's logits and adds the normalized probabilities into per-head sums; scratch stays
// O(queries * (D + tile)).
//
// Optionally pass 1 also keeps what it computed (see compute_normalizers' `store`), and pass 2 then
// reads it back (accumulate_stored) instead of recomputing the logits: one GEMM instead of two, for
// O(queries * keys) scratch that the caller sizes and bounds.
//
// Layout, chosen so no step needs a transpose in the inner loops:
// - queries are stored transposed, [D][rows], scaled; head h owns rows [h * Qp, h * Qp + Q) with Qp
//   = Q rounded up to 8, so every 8-row vector belongs to one head (pad rows are zero and get zero
//   weight);
// - a key tile is converted to fp32 [tile][D] (F16C for fp16);
// - logits are [tile][rows]: the GEMM micro-kernel keeps 6 keys x 16 rows of accumulators in
//   registers and broadcasts one key element per multiply-add pair, and the per-row softmax
//   statistics are plain vertical max / add over keys.
//
// Compiled with per-function target attributes so the rest of the build stays baseline x86-64;
// `window_attention_avx2_enabled()` checks the CPU once at run time. A GCC/Clang x86-64 feature
// (not nvcc, which also parses this header through the CUDA scoring files).
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__CUDACC__) && (defined(__GNUC__) || defined(__clang__))
#define RIPPLEKV_HAS_AVX2_KERNELS 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ripplekv/numeric.h"

#define RIPPLEKV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ripplekv {
namespace detail {

// True when the CPU has AVX2, FMA and F16C, unless RIPPLEKV_DISABLE_AVX2 is set to a non-empty value
// other than "0" (to compare against, or fall back to, the portable kernel). Read once per process.
inline bool window_attention_avx2_enabled() {
  static const bool enabled = [] {
    const char* off = std::getenv("RIPPLEKV_DISABLE_AVX2");
    if (off != nullptr && off[0] != '\0' && std::strcmp(off, "0") != 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return enabled;
}

// Vector form of exp_nonpositive (numeric.h): the same Cody-Waite reduction and polynomial; 0 below
// the fp32 range and for -inf; NaN in, NaN out (every clamp is written so a NaN falls through).
RIPPLEKV_AVX2 inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_blendv_ps(x, _mm256_set1_ps(-87.0f), underflow);
  x = _mm256_min_ps(_mm256_setzero_ps(), x);  // min(a, b) returns b when either is NaN
  const __m256 fn = _mm256_fmsub_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  const __m256i n = _mm256_cvttps_epi32(fn);
  const __m256 nf = _mm256_cvtepi32_ps(n);
  __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, scale));
}

// [s(v0), ..., s(v7)] where s is the sum of a vector's 8 lanes.
RIPPLEKV_AVX2 inline __m256 lane_sums8(const __m256 v[8]) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// n elements of a key row (stride `dim_stride`) as fp32.
RIPPLEKV_AVX2 inline void load_key_row(const float* k, int64_t dim_stride, int64_t n, float* out) {
  if (dim_stride == 1) {
    std::memcpy(out, k, n * sizeof(float));
    return;
  }
  for (int64_t d = 0; d < n; ++d) out[d] = k[d * dim_stride];
}
RIPPLEKV_AVX2 inline void load_key_row(const Half* k, int64_t dim_stride, int64_t n, float* out) {
  int64_t d = 0;
  if (dim_stride == 1)
    for (; d + 8 <= n; d += 8)
      _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + d))));
  for (; d < n; ++d) out[d] = _cvtsh_ss(k[d * dim_stride].bits);
}
RIPPLEKV_AVX2 inline void load_key_row(const BFloat16* k, int64_t dim_stride, int64_t n, float* out) {
  int64_t d = 0;
  if (dim_stride == 1)
    for (; d + 8 <= n; d += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + d)));
      _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
  for (; d < n; ++d) out[d] = to_float(k[d * dim_stride]);
}

class WindowAttentionAvx2 {
 public:
  static constexpr int64_t kKeyTile = 48;  // a multiple of the micro-kernel's 6 keys and of 8

  // G query heads x Q queries each; query i of every head sits at absolute position pos0 + i and
  // sees keys [0, pos0 + i]. Queries are read through strides and pre-multiplied by the scale.
  template <typename T>
  RIPPLEKV_AVX2 WindowAttentionAvx2(const T* q, int64_t head_stride, int64_t query_stride, int64_t dim_stride,
                                    int64_t G, int64_t Q, int64_t D, int64_t pos0, float scale)
      : G_(G), Q_(Q), D_(D), pos0_(pos0), Qp_((Q + 7) / 8 * 8), rows_((G * Qp_ + 15) / 16 * 16),
        qt_(D * rows_, 0.0f), key_tile_(kKeyTile * D, 0.0f), logits_(kKeyTile * rows_),
        max_(rows_, -std::numeric_limits<float>::infinity()), sum_(rows_, 0.0f), inv_sum_(rows_, 0.0f),
        weights_(rows_, 0.0f) {
    for (int64_t h = 0; h < G; ++h)
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t d = 0; d < D; ++d)
          qt_[d * rows_ + h * Qp_ + i] = scale * to_float(q[h * head_stride + i * query_stride + d * dim_stride]);
  }

  // Floats per key (and per key tile) of a probability store: one per (padded) query row.
  static int64_t store_width(int64_t G, int64_t Q) { return (G * ((Q + 7) / 8 * 8) + 15) / 16 * 16; }

  // Pass 1 over keys [j_begin, j_end) clipped to the visible [0, pos0 + Q): softmax max and normalizer
  // per query (online update). A sub-range gives partial statistics that merge_softmax_stats combines
  // (then import_stats); the default range gives the final ones.
  //
  // With `store` (j_begin a multiple of kKeyTile), it also keeps, for accumulate_stored, each visible
  // key's exp(logit - shift) at store[j * store_width + row] and each tile's shift (the running max it
  // was taken against) at tile_shifts[(j / kKeyTile) * store_width + row]: key j's absolute position
  // indexes both, so any tile-aligned sub-range writes its own part.
  template <typename T>
  RIPPLEKV_AVX2 void compute_normalizers(const T* keys, int64_t key_stride, int64_t dim_stride, int64_t j_begin = 0,
                                         int64_t j_end = std::numeric_limits<int64_t>::max(), float* store = nullptr,
                                         float* tile_shifts = nullptr) {
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const int64_t n_visible = std::min(pos0_ + Q_, j_end);
    for (int64_t j0 = j_begin; j0 < n_visible; j0 += kKeyTile) {
      const int64_t tile = std::min(kKeyTile, n_visible - j0);
      compute_logits(keys, key_stride, dim_stride, j0, tile, n_visible);
      for (int64_t r = 0; r < rows_; r += 8) {
        __m256 tile_max = neg_inf;
        for (int64_t t = 0; t < tile; ++t) tile_max = _mm256_max_ps(tile_max, _mm256_loadu_ps(&logits_[t * rows_ + r]));
        const __m256 old_max = _mm256_loadu_ps(&max_[r]);
        const __m256 new_max = _mm256_max_ps(old_max, tile_max);
        // A row with every key so far masked keeps max -inf: subtract 0 instead so exp sees -inf, not NaN.
        const __m256 shift = _mm256_andnot_ps(_mm256_cmp_ps(new_max, neg_inf, _CMP_EQ_OQ), new_max);
        __m256 tile_sum = _mm256_setzero_ps();
        if (store != nullptr) {
          _mm256_storeu_ps(&tile_shifts[(j0 / kKeyTile) * rows_ + r], shift);
          for (int64_t t = 0; t < tile; ++t) {
            const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(&logits_[t * rows_ + r]), shift));
            _mm256_storeu_ps(&store[(j0 + t) * rows_ + r], e);
            tile_sum = _mm256_add_ps(tile_sum, e);
          }
        } else {
          for (int64_t t = 0; t < tile; ++t)
            tile_sum = _mm256_add_ps(tile_sum, exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(&logits_[t * rows_ + r]), shift)));
        }
        const __m256 rescale = exp_nonpositive_avx2(_mm256_sub_ps(old_max, shift));
        _mm256_storeu_ps(&sum_[r], _mm256_fmadd_ps(_mm256_loadu_ps(&sum_[r]), rescale, tile_sum));
        _mm256_storeu_ps(&max_[r], new_max);
      }
    }
    set_weights();
  }

  // The statistics of query i of head h at [h * Q + i] (what compute_normalizers found).
  void export_stats(float* max, float* sum) const {
    for (int64_t h = 0; h < G_; ++h)
      for (int64_t i = 0; i < Q_; ++i) {
        max[h * Q_ + i] = max_[h * Qp_ + i];
        sum[h * Q_ + i] = sum_[h * Qp_ + i];
      }
  }

  // Replaces the statistics (e.g. merged from key sub-ranges), in export_stats's layout.
  void import_stats(const float* max, const float* sum) {
    for (int64_t h = 0; h < G_; ++h)
      for (int64_t i = 0; i < Q_; ++i) {
        max_[h * Qp_ + i] = max[h * Q_ + i];
        sum_[h * Qp_ + i] = sum[h * Q_ + i];
      }
    set_weights();
  }

  // Pass 2 over keys [j_begin, j_end): head_sums[h * head_stride + (j - j_begin)] += sum over the
  // head's queries of p(query, j). Needs compute_normalizers first.
  template <typename T>
  RIPPLEKV_AVX2 void accumulate(const T* keys, int64_t key_stride, int64_t dim_stride, int64_t j_begin,
                                int64_t j_end, float* head_sums, int64_t head_stride) {
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
      const int64_t tile = std::min(kKeyTile, j_end - j0);
      compute_logits(keys, key_stride, dim_stride, j0, tile, j_end);
      // p = exp(logit - max) / sum; keys past `tile` are zero-padded logit rows.
      add_head_sums(tile, head_sums + (j0 - j_begin), head_stride, [&](__m256 acc, int64_t t, int64_t r) RIPPLEKV_AVX2 {
        const __m256 p = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(&logits_[t * rows_ + r]),
                                                            _mm256_loadu_ps(&max_[r])));
        return _mm256_fmadd_ps(p, _mm256_loadu_ps(&inv_sum_[r]), acc);
      });
    }
  }

  // Pass 2 from what compute_normalizers kept in `store` / `tile_shifts` (same layout; j_begin a
  // multiple of kKeyTile), with the final statistics: no logits are recomputed. Key j's probability is
  // its stored exp(logit - shift) times exp(shift - max) / sum, a weight per query and tile.
  RIPPLEKV_AVX2 void accumulate_stored(const float* store, const float* tile_shifts, int64_t j_begin, int64_t j_end,
                                       float* head_sums, int64_t head_stride) {
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
      const int64_t tile = std::min(kKeyTile, j_end - j0);
      const float* shift = &tile_shifts[(j0 / kKeyTile) * rows_];
      for (int64_t r = 0; r < rows_; r += 8) {  // pad rows: shift 0, max 0, 1 / sum 0 -> weight 0
        const __m256 rescale = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(shift + r), _mm256_loadu_ps(&max_[r])));
        _mm256_storeu_ps(&weights_[r], _mm256_mul_ps(rescale, _mm256_loadu_ps(&inv_sum_[r])));
      }
      const float* e = store + j0 * rows_;
      add_head_sums(tile, head_sums + (j0 - j_begin), head_stride, [&](__m256 acc, int64_t t, int64_t r) RIPPLEKV_AVX2 {
        // Keys past `tile` may lie outside the store: they add nothing.
        return t < tile ? _mm256_fmadd_ps(_mm256_loadu_ps(e + t * rows_ + r), _mm256_loadu_ps(&weights_[r]), acc) : acc;
      });
    }
  }

 private:
  // 1 / normalizer of every real query. Pad rows keep weight 0, and a max of 0 so their (zero) logits
  // give exp(0) * 0 = 0 in pass 2.
  void set_weights() {
    std::fill(inv_sum_.begin(), inv_sum_.end(), 0.0f);
    for (int64_t h = 0; h < G_; ++h) {
      for (int64_t i = 0; i < Q_; ++i) inv_sum_[h * Qp_ + i] = 1.0f / sum_[h * Qp_ + i];
      std::fill(max_.begin() + h * Qp_ + Q_, max_.begin() + (h + 1) * Qp_, 0.0f);
    }
    std::fill(max_.begin() + G_ * Qp_, max_.end(), 0.0f);
  }

  // out[h * head_stride + t] += sum over head h's (padded) query rows r of p(t, r), for keys t < tile
  // of the current tile; add_prob(acc, t, r) returns acc plus p of rows [r, r + 8) as a vector.
  template <typename AddProb>
  RIPPLEKV_AVX2 void add_head_sums(int64_t tile, float* out, int64_t head_stride, const AddProb& add_prob) {
    const int64_t vectors_per_head = Qp_ / 8;
    for (int64_t h = 0; h < G_; ++h, out += head_stride) {
      for (int64_t t0 = 0; t0 < tile; t0 += 8) {
        __m256 key_sums[8];  // key t0 + x: the head's probabilities, still 8 lanes wide
        for (int x = 0; x < 8; ++x) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t v = 0; v < vectors_per_head; ++v) acc = add_prob(acc, t0 + x, h * Qp_ + 8 * v);
          key_sums[x] = acc;
        }
        const __m256 sums = lane_sums8(key_sums);
        if (t0 + 8 <= tile) {
          _mm256_storeu_ps(out + t0, _mm256_add_ps(_mm256_loadu_ps(out + t0), sums));
        } else {
          float tail[8];
          _mm256_storeu_ps(tail, sums);
          for (int64_t x = 0; t0 + x < tile; ++x) out[t0 + x] += tail[x];
        }
      }
    }
  }

  // logits_[t][r] = <q_r, k_{j0 + t}> for t < tile, -inf where key j0 + t is in the future of query
  // r; rows t in [tile, kKeyTile) come from zeroed keys and are never read as real keys. Keys from
  // j0 + kKeyTile up to prefetch_end (exclusive) are the next tile's, and are prefetched.
  template <typename T>
  RIPPLEKV_AVX2 void compute_logits(const T* keys, int64_t key_stride, int64_t dim_stride, int64_t j0, int64_t tile,
                                    int64_t prefetch_end) {
    // A whole tile of fp32 keys with contiguous dims is read in place; anything else is converted
    // into key_tile_, zero-padded to the tile so the micro-kernel's last 6 keys stay in bounds.
    const float* k = key_tile_.data();
    int64_t k_stride = D_;
    if constexpr (std::is_same_v<T, float>) {
      if (dim_stride == 1 && tile == kKeyTile) k = keys + j0 * key_stride, k_stride = key_stride;
    }
    // Ask for the next tile's keys now: rows of a [B, N, H, D] tensor viewed as [B, H, N, D] lie a
    // whole token apart, a stride the hardware prefetchers do not follow from one row to the next.
    if (dim_stride == 1)
      for (int64_t t = 0; t < std::min(kKeyTile, prefetch_end - j0 - kKeyTile); ++t) {
        const char* row = reinterpret_cast<const char*>(keys + (j0 + kKeyTile + t) * key_stride);
        for (int64_t byte = 0; byte < D_ * static_cast<int64_t>(sizeof(T)); byte += 64)
          _mm_prefetch(row + byte, _MM_HINT_T0);
      }
    if (k == key_tile_.data()) {
      for (int64_t t = 0; t < tile; ++t) load_key_row(keys + (j0 + t) * key_stride, dim_stride, D_, &key_tile_[t * D_]);
      std::fill(key_tile_.begin() + tile * D_, key_tile_.end(), 0.0f);
    }
    for (int64_t t0 = 0; t0 < tile; t0 += 6)
      for (int64_t r0 = 0; r0 < rows_; r0 += 16) logits_6x16(k + t0 * k_stride, k_stride, t0, r0);
    if (pos0_ < j0 + tile - 1) {  // some query precedes some key of this tile
      for (int64_t h = 0; h < G_; ++h)
        for (int64_t i = 0; i < Q_; ++i)
          for (int64_t t = std::max<int64_t>(0, pos0_ + i + 1 - j0); t < tile; ++t)
            logits_[t * rows_ + h * Qp_ + i] = -std::numeric_limits<float>::infinity();
    }
  }

  // Keys [t0, t0 + 6) (fp32 rows at k, k + k_stride, ...) x rows [r0, r0 + 16): 12 accumulators stay
  // in registers for the whole reduction over D; each step loads 16 query values and broadcasts 6
  // key values for 12 FMAs.
  RIPPLEKV_AVX2 void logits_6x16(const float* k, int64_t k_stride, int64_t t0, int64_t r0) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float* q = &qt_[r0];
    for (int64_t d = 0; d < D_; ++d, q += rows_, ++k) {
      const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
      __m256 b = _mm256_broadcast_ss(k);
      a00 = _mm256_fmadd_ps(q0, b, a00), a01 = _mm256_fmadd_ps(q1, b, a01);
      b = _mm256_broadcast_ss(k + k_stride);
      a10 = _mm256_fmadd_ps(q0, b, a10), a11 = _mm256_fmadd_ps(q1, b, a11);
      b = _mm256_broadcast_ss(k + 2 * k_stride);
      a20 = _mm256_fmadd_ps(q0, b, a20), a21 = _mm256_fmadd_ps(q1, b, a21);
      b = _mm256_broadcast_ss(k + 3 * k_stride);
      a30 = _mm256_fmadd_ps(q0, b, a30), a31 = _mm256_fmadd_ps(q1, b, a31);
      b = _mm256_broadcast_ss(k + 4 * k_stride);
      a40 = _mm256_fmadd_ps(q0, b, a40), a41 = _mm256_fmadd_ps(q1, b, a41);
      b = _mm256_broadcast_ss(k + 5 * k_stride);
      a50 = _mm256_fmadd_ps(q0, b, a50), a51 = _mm256_fmadd_ps(q1, b, a51);
    }
    float* l = &logits_[t0 * rows_ + r0];
    const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    for (int x = 0; x < 6; ++x) {
      _mm256_storeu_ps(l + x * rows_, acc[x][0]);
      _mm256_storeu_ps(l + x * rows_ + 8, acc[x][1]);
    }
  }

  int64_t G_, Q_, D_, pos0_, Qp_, rows_;
  std::vector<float> qt_, key_tile_, logits_, max_, sum_, inv_sum_, weights_;
};

}  // namespace detail
}  // namespace ripplekv

#endif
