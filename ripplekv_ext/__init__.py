"""ripplekv_ext: per-layer KV-cache budgets (RippleKV) and fused SnapKV compression ops for PyTorch."""

from ripplekv_ext._library import build_report, cuda_built, cuda_version
from ripplekv_ext.ops import gather_kv
from ripplekv_ext.ops import (gather_kv_packed, h2o_scores, select_topk, select_topk_packed, select_topk_rows,
                              snapkv_compress, snapkv_compress_rows, snapkv_scores, streaming_indices)
from ripplekv_ext.budgets.allocators import (Allocator, PyramidKVAllocator, RippleKVAllocator, RippleKVRatioAllocator,
                                             UniformAllocator)
from ripplekv_ext.selection.selectors import (H2OSelector, KeyNormSelector, PeakSpanSelector, ScoredSelector, Selector,
                                              SnapKVSelector, StreamingLLMSelector)
from ripplekv_ext.budgets.cake import CakeAllocator
from ripplekv_ext.selection.cake import CakeSelector
from ripplekv_ext.selection.adakv import AdaKVSelector
from ripplekv_ext.policies import Policy
from ripplekv_ext.budgets.tiers import TieredAllocator, tier_counts
from ripplekv_ext.budgets.plan import BudgetPlan
from ripplekv_ext.selection.compressor import CompressionStep, KVCompressor
from ripplekv_ext.transformers_front.compress_block import compress
from ripplekv_ext.transformers_front.context import compress_context, continue_context, load_context

# Old module names: a renamed one fails naming the new; a moved one imports with a FutureWarning (tables public).
from ripplekv_ext._old_names import MOVED_MODULES, RENAMED_MODULES, install_old_module_names  # noqa: F401

install_old_module_names()

__version__ = "0.1.0"

__all__ = ["build_report", "cuda_built", "cuda_version", "gather_kv", "gather_kv_packed", "h2o_scores", "select_topk",
           "select_topk_packed", "select_topk_rows", "snapkv_compress", "snapkv_compress_rows", "snapkv_scores",
           "streaming_indices", "Allocator", "UniformAllocator", "PyramidKVAllocator", "RippleKVAllocator",
           "RippleKVRatioAllocator", "CakeAllocator", "TieredAllocator", "tier_counts", "Policy", "Selector",
           "ScoredSelector", "SnapKVSelector", "PeakSpanSelector", "KeyNormSelector", "H2OSelector",
           "StreamingLLMSelector", "CakeSelector", "AdaKVSelector", "BudgetPlan", "KVCompressor", "CompressionStep",
           "compress",
           "compress_context", "continue_context", "load_context"]
