#include <torch/library.h>

#include "../select_topk_rows.h"
#include "launchers.h"

namespace ripplekv_ext {

// One select_topk launch per compressed row, each followed by its NaN-flag read (a sync): lengths and budgets are
// read on the host first (another sync), so the op cannot be captured in a CUDA graph.
TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("select_topk_rows", &select_topk_rows_op<run_select_topk_cuda>); }

}  // namespace ripplekv_ext
