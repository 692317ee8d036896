// KV gather, CUDA: K_c[b, g, t] = K[b, g, idx[b, g, t]] (and the same for V) in one launch.
//
// The gather is pure data movement, so the kernel copies in 16-byte units (uint4) whenever every
// row is contiguous and 16-byte aligned, which is the common case (D * sizeof(T) = 128 or 256 bytes);
// otherwise it falls back to element-wise copies that honour arbitrary strides.
//
// Indices are the caller's to validate (the torch binding checks them before launching). The kernel
// never reads out of bounds: an out-of-range index leaves its slot unwritten and sets *bad_index when
// the caller passes one. (No __trap: that would poison the CUDA context for the rest of the process.)
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ripplekv/gather_kv.h"

namespace ripplekv {
namespace cuda {
namespace detail {

// Same layout as GatherKVParams, but strides and D are counted in copy units of type Unit.
struct GatherKVUnits {
  const void* __restrict__ keys;        // [B, H, N, D_units]
  const void* __restrict__ values;      // [B, H, N, D_units]
  const int64_t* __restrict__ indices;  // [B, H, C] (element strides)
  void* __restrict__ keys_out;          // [B, H, C, D_units]
  void* __restrict__ values_out;        // [B, H, C, D_units]
  int64_t B, H, N, C, D_units;
  Strides4 k, v, ko, vo;
  Strides3 idx;
  int* bad_index;  // device flag set to 1 on an out-of-range index, or nullptr
};

template <typename Unit>
__global__ void gather_kv_kernel(GatherKVUnits p) {
  const Unit* __restrict__ keys = static_cast<const Unit*>(p.keys);
  const Unit* __restrict__ values = static_cast<const Unit*>(p.values);
  Unit* __restrict__ keys_out = static_cast<Unit*>(p.keys_out);
  Unit* __restrict__ values_out = static_cast<Unit*>(p.values_out);
  const int64_t total = p.B * p.H * p.C * p.D_units;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = i % p.D_units;
    const int64_t rest = i / p.D_units;
    const int64_t t = rest % p.C;
    const int64_t row = rest / p.C;
    const int64_t b = row / p.H;
    const int64_t h = row % p.H;
    const int64_t j = __ldg(p.indices + b * p.idx.b + h * p.idx.h + t * p.idx.c);
    if (j < 0 || j >= p.N) {
      if (p.bad_index != nullptr) *p.bad_index = 1;
      continue;
    }
    keys_out[b * p.ko.b + h * p.ko.h + t * p.ko.n + u * p.ko.d] =
        keys[b * p.k.b + h * p.k.h + j * p.k.n + u * p.k.d];
    values_out[b * p.vo.b + h * p.vo.h + t * p.vo.n + u * p.vo.d] =
        values[b * p.v.b + h * p.v.h + j * p.v.n + u * p.v.d];
  }
}


template <typename Unit>
cudaError_t launch_gather_kv_units(const GatherKVUnits& u, cudaStream_t stream) {
  const int64_t total = u.B * u.H * u.C * u.D_units;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Grid-stride loop: a bounded grid keeps launch cost flat for very long caches.
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65536);
  gather_kv_kernel<Unit><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(u);
  return cudaGetLastError();
}

}  // namespace detail

// Launches the gather for element type T (only its size matters). Returns the launch status.
template <typename T>
cudaError_t launch_gather_kv(const GatherKVParams& p, cudaStream_t stream, int* bad_index = nullptr) {
  detail::GatherKVUnits u{p.keys, p.values, p.indices, p.keys_out, p.values_out,
                          p.B, p.H, p.N, p.C, p.D, p.k, p.v, p.ko, p.vo, p.idx, bad_index};
  constexpr int64_t kVec = 16 / sizeof(T);  // elements per uint4
  const bool rows_contiguous = p.k.d == 1 && p.v.d == 1 && p.ko.d == 1 && p.vo.d == 1;
  const bool vectorizable =
      rows_contiguous && p.D % kVec == 0 && aligned16(p.keys) &&
      aligned16(p.values) && aligned16(p.keys_out) &&
      aligned16(p.values_out) && p.k.b % kVec == 0 && p.k.h % kVec == 0 &&
      p.k.n % kVec == 0 && p.v.b % kVec == 0 && p.v.h % kVec == 0 && p.v.n % kVec == 0 &&
      p.ko.b % kVec == 0 && p.ko.h % kVec == 0 && p.ko.n % kVec == 0 && p.vo.b % kVec == 0 &&
      p.vo.h % kVec == 0 && p.vo.n % kVec == 0;
  if (!vectorizable) {
    return detail::launch_gather_kv_units<T>(u, stream);
  }
  auto to_units = [](Strides4 s) { return Strides4{s.b / kVec, s.h / kVec, s.n / kVec, 1}; };
  u.D_units = p.D / kVec;
  u.k = to_units(p.k);
  u.v = to_units(p.v);
  u.ko = to_units(p.ko);
  u.vo = to_units(p.vo);
  return detail::launch_gather_kv_units<uint4>(u, stream);
}

}  // namespace cuda
}  // namespace ripplekv
