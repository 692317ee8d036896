#include <torch/library.h>

#include "../packed.h"
#include "select_rows.h"

namespace ripplekv_ext {

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) { m.impl("select_topk_packed", &select_topk_packed_op<run_select_topk_cpu>); }

}  // namespace ripplekv_ext
