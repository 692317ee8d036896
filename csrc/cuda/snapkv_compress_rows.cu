#include <torch/library.h>

#include "../snapkv_compress_rows.h"
#include "launchers.h"

namespace ripplekv_ext {

// Per compressed row: one scoring, one selection (its NaN-flag read is a sync) and one gather launch. Lengths and
// budgets are read on the host first (a sync), so the op cannot be captured in a CUDA graph.
TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) {
  m.impl("snapkv_compress_rows",
         &snapkv_compress_rows_op<run_snapkv_scores_cuda, run_select_topk_cuda, run_gather_kv_cuda>);
}

}  // namespace ripplekv_ext
