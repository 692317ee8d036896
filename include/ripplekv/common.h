// Shared definitions for the torch-free kernels. Everything under include/ripplekv/ compiles with a
// plain C++17 compiler (and nvcc for the .cuh files) so other engines can embed the kernels without
// libtorch; the torch bindings in csrc/ own validation, threading and memory.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RIPPLEKV_HOST_DEVICE __host__ __device__
#else
#define RIPPLEKV_HOST_DEVICE
#endif

namespace ripplekv {

// Kernels report what went wrong instead of throwing: the caller decides how to surface it
// (TORCH_CHECK in the bindings, an assertion in the C++ tests, an error code in an engine).
enum class StatusCode : int {
  kOk = 0,
  kIndexOutOfRange = 1,  // an index outside [0, N)
  kNaN = 2,              // a NaN score where an ordering is needed
  kInvalidArgument = 3,  // a size or budget the kernel cannot honour
};

struct Status {
  StatusCode code = StatusCode::kOk;
  int64_t row = -1;    // flattened row (e.g. b * H + h) where the problem was found
  int64_t value = 0;   // offending value (the bad index, the position of the NaN, ...)

  RIPPLEKV_HOST_DEVICE bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return Status{}; }
  static Status Error(StatusCode code, int64_t row, int64_t value) {
    Status s;
    s.code = code;
    s.row = row;
    s.value = value;
    return s;
  }
};

inline const char* status_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kIndexOutOfRange: return "index out of range";
    case StatusCode::kNaN: return "NaN";
    case StatusCode::kInvalidArgument: return "invalid argument";
  }
  return "unknown";
}

// Element strides of a 4-D [B, H, N, D] tensor and a 3-D [B, H, C] tensor. Strides are in
// elements, as torch reports them, so non-contiguous views (slices, transposes) need no copy.
struct Strides4 {
  int64_t b, h, n, d;
};
struct Strides3 {
  int64_t b, h, c;
};

// Whether a pointer allows 16-byte vector loads and stores.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace ripplekv
