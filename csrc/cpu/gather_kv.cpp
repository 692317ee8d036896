#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../gather_kv.h"
#include "runners.h"

namespace ripplekv_ext {

// Indices were range-checked by the op: the kernel's own check is a last line of defence.
void run_gather_kv_cpu(const ripplekv::GatherKVParams& p, int64_t element_size) {
  // Each row copies C * D elements twice; a grain of a few rows keeps small calls single-threaded.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, p.C * p.D));
  at::parallel_for(0, p.B * p.H, grain, [&](int64_t begin, int64_t end) {
    const ripplekv::Status s = element_size == 4 ? ripplekv::gather_kv_rows<uint32_t>(p, begin, end)
                                                 : ripplekv::gather_kv_rows<uint16_t>(p, begin, end);
    check_status(s, "gather_kv", "indices", "must lie in [0, N) = [0, " + std::to_string(p.N) + ")");
  });
}

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) {
  m.impl("gather_kv", &gather_kv_op<run_gather_kv_cpu>);
  m.impl("gather_kv_into", &gather_kv_into_op<run_gather_kv_cpu>);
}

}  // namespace ripplekv_ext
