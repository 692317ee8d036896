// Element types and float helpers for the torch-free kernels: fp16/bf16 storage read as fp32, and
// an exp that the compiler can vectorize (libm's expf is a call per element, which dominated the
// softmax passes).
#pragma once

#include <cstdint>
#include <cstring>

#include "ripplekv/common.h"

namespace ripplekv {

// Storage-only 16-bit types with the bit layout of IEEE binary16 and bfloat16 (and of at::Half /
// at::BFloat16, so the torch bindings can reinterpret pointers).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

RIPPLEKV_HOST_DEVICE inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(Half x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero and subnormals: mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// exp(x) for x <= 0 (softmax arguments after subtracting the max), relative error ~2e-7; exactly 0
// below the fp32 range, including -inf; NaN in, NaN out. Branch-free so loops over it vectorize.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;  // also -inf; NaN stays NaN so a NaN input still shows up downstream
  x = underflow ? -87.0f : (x > 0.0f ? 0.0f : x);
  const float fn = x * 1.44269504088896341f - 0.5f;  // x <= 0: truncation of (t - 0.5) rounds t
  const int32_t n = static_cast<int32_t>(fn);
  const float nf = static_cast<float>(n);
  const float r = x - nf * 0.693359375f - nf * -2.12194440e-4f;  // Cody-Waite: x - n ln2, exactly
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const float scale = bits_to_float(static_cast<uint32_t>(n + 127) << 23);
  return underflow ? 0.0f : y * scale;
}

}  // namespace ripplekv
