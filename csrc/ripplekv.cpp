// The single schema block for every ripplekv op. Backends register in csrc/cpu and csrc/cuda.
#include <torch/library.h>

TORCH_LIBRARY(ripplekv, m) {
  // keys, values: [B, H_kv, N, D]; indices: int64 [B, H_kv, C] -> K_c, V_c: [B, H_kv, C, D].
  m.def("gather_kv(Tensor keys, Tensor values, Tensor indices) -> (Tensor, Tensor)");
  // The same gather into caller-provided compact buffers (e.g. an engine's preallocated cache).
  m.def(
      "gather_kv_into(Tensor keys, Tensor values, Tensor indices, Tensor(a!) keys_out, "
      "Tensor(b!) values_out) -> ()");
}
