#include <torch/library.h>

#include "../snapkv_compress_rows.h"
#include "runners.h"
#include "select_rows.h"

namespace ripplekv_ext {

TORCH_LIBRARY_IMPL(ripplekv, CPU, m) {
  m.impl("snapkv_compress_rows",
         &snapkv_compress_rows_op<run_snapkv_scores_cpu, run_select_topk_cpu, run_gather_kv_cpu>);
}

}  // namespace ripplekv_ext
