// The CUDA runners one binding file lends another (snapkv_compress scores, selects and gathers through
// the same code as snapkv_scores, select_topk and gather_kv), and the device limits they share.
#pragma once

#include "../aten.h"
#include <ATen/cuda/CUDAContext.h>

#include <vector>

#include "ripplekv/gather_kv.h"
#include "ripplekv/snapkv_scores.h"

namespace ripplekv_ext {

// select_topk.cu: rows of scores4 [L, B, H, N - W] into indices at host offsets; raises on a NaN score
// (except while the stream is being captured into a CUDA graph, where the host cannot look).
void run_select_topk_cuda(const at::Tensor& scores4, const std::vector<int64_t>& budgets,
                          const std::vector<int64_t>& offsets, int64_t window, at::Tensor& indices, const char* op);

// gather_kv.cu: the gather of validated indices.
void run_gather_kv_cuda(const ripplekv::GatherKVParams& p, int64_t element_size);

// snapkv_scores.cu: pooled scores into p.scores.
void run_snapkv_scores_cuda(const ripplekv::SnapKVScoresParams& p, at::ScalarType dtype);

// The window-attention kernels keep a query block and a key tile of D floats in shared memory: say so
// when the device has too little for this D, instead of a generic launch error.
void check_window_attention_smem(int64_t D, const char* op);

}  // namespace ripplekv_ext
