#include <torch/library.h>

#include "../packed.h"
#include "launchers.h"

namespace ripplekv_ext {

TORCH_LIBRARY_IMPL(ripplekv, CUDA, m) { m.impl("select_topk_packed", &select_topk_packed_op<run_select_topk_cuda>); }

}  // namespace ripplekv_ext
