#include <torch/library.h>

#include "../select_topk_rows.h"
#include "select_rows.h"

namespace ripplekv_ext {

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("select_topk_rows", &select_topk_rows_op<run_select_topk_cpu>); }

}  // namespace ripplekv_ext
