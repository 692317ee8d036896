// Packed multi-layer KV gather, CUDA: every layer's kept rows into one [B, H, total, D] buffer in a
// single launch. Each output slot finds its layer by binary search over the L + 1 offsets.
//
// Indices and offsets are the caller's to validate (the torch binding checks both before launching); an
// out-of-range index leaves its slot unwritten and sets *bad_index when given (never __trap).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ripplekv/common.h"

namespace ripplekv {
namespace cuda {

struct GatherKVPackedParams {
  const void* const* keys;    // device [L] pointers, each [B, H, N, D_units] with strides k (shared by all layers)
  const void* const* values;  // device [L] pointers, strides v
  const void* const* keys_host;    // host [L]: the same pointers, for the launcher's alignment test
  const void* const* values_host;  // host [L]
  const int64_t* indices;     // [B, H, total], strides idx
  const int64_t* offsets;     // device [L + 1]
  void* keys_out;             // [B, H, total, D_units], strides ko
  void* values_out;           // strides vo
  int64_t L, B, H, N, total, D_units;
  Strides4 k, v, ko, vo;
  Strides3 idx;
  int* bad_index;  // device flag set to 1 on an out-of-range index, or nullptr
};

template <typename Unit>
__global__ void gather_kv_packed_kernel(GatherKVPackedParams p) {
  const int64_t count = p.B * p.H * p.total * p.D_units;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = i % p.D_units, rest = i / p.D_units, t = rest % p.total, row = rest / p.total;
    const int64_t b = row / p.H, h = row % p.H;
    int64_t lo = 0, hi = p.L;  // the layer l with offsets[l] <= t < offsets[l + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (__ldg(p.offsets + mid) <= t) lo = mid; else hi = mid;
    }
    const int64_t j = __ldg(p.indices + b * p.idx.b + h * p.idx.h + t * p.idx.c);
    if (j < 0 || j >= p.N) {
      if (p.bad_index != nullptr) *p.bad_index = 1;
      continue;
    }
    const Unit* keys = static_cast<const Unit*>(p.keys[lo]);
    const Unit* values = static_cast<const Unit*>(p.values[lo]);
    static_cast<Unit*>(p.keys_out)[b * p.ko.b + h * p.ko.h + t * p.ko.n + u * p.ko.d] =
        keys[b * p.k.b + h * p.k.h + j * p.k.n + u * p.k.d];
    static_cast<Unit*>(p.values_out)[b * p.vo.b + h * p.vo.h + t * p.vo.n + u * p.vo.d] =
        values[b * p.v.b + h * p.v.h + j * p.v.n + u * p.v.d];
  }
}

// elem_size: bytes per element (2 or 4). Copies 16 bytes at a time when every pointer, stride and D allow.
inline cudaError_t launch_gather_kv_packed(GatherKVPackedParams p, int64_t elem_size, cudaStream_t stream) {
  bool all_aligned16 = aligned16(p.keys_out) && aligned16(p.values_out);
  for (int64_t l = 0; l < p.L; ++l)
    all_aligned16 = all_aligned16 && aligned16(p.keys_host[l]) && aligned16(p.values_host[l]);
  const int64_t vec = 16 / elem_size;
  const bool vectorizable = all_aligned16 && p.k.d == 1 && p.v.d == 1 && p.ko.d == 1 && p.vo.d == 1 &&
                            p.D_units % vec == 0 && p.k.b % vec == 0 && p.k.h % vec == 0 && p.k.n % vec == 0 &&
                            p.v.b % vec == 0 && p.v.h % vec == 0 && p.v.n % vec == 0 && p.ko.b % vec == 0 &&
                            p.ko.h % vec == 0 && p.ko.n % vec == 0 && p.vo.b % vec == 0 && p.vo.h % vec == 0 &&
                            p.vo.n % vec == 0;
  if (vectorizable) {
    auto units = [vec](Strides4 s) { return Strides4{s.b / vec, s.h / vec, s.n / vec, 1}; };
    p.D_units /= vec;
    p.k = units(p.k);
    p.v = units(p.v);
    p.ko = units(p.ko);
    p.vo = units(p.vo);
  }
  const int64_t count = p.B * p.H * p.total * p.D_units;
  if (count == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((count + 255) / 256, 65536));
  if (vectorizable) {
    gather_kv_packed_kernel<uint4><<<blocks, 256, 0, stream>>>(p);
  } else if (elem_size == 4) {
    gather_kv_packed_kernel<uint32_t><<<blocks, 256, 0, stream>>>(p);
  } else {
    gather_kv_packed_kernel<uint16_t><<<blocks, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ripplekv
