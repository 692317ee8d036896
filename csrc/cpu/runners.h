// The CPU runners one binding file lends another (snapkv_compress_rows scores, selects and gathers through the
// same code as snapkv_scores, select_topk and gather_kv). The selection runner lives in select_rows.h.
#pragma once

#include "../aten.h"

#include "ripplekv/gather_kv.h"
#include "ripplekv/snapkv_scores.h"

namespace ripplekv_ext {

// snapkv_scores.cpp: pooled scores into p.scores.
void run_snapkv_scores_cpu(const ripplekv::SnapKVScoresParams& p, at::ScalarType dtype);

// gather_kv.cpp: the gather of validated indices.
void run_gather_kv_cpu(const ripplekv::GatherKVParams& p, int64_t element_size);

}  // namespace ripplekv_ext
