"""ripplekv_ext: per-layer KV-cache budgets (RippleKV) and fused SnapKV compression ops for PyTorch."""

import importlib.abc
import sys

from ripplekv_ext._library import build_report, cuda_built, cuda_version
from ripplekv_ext.ops import gather_kv
from ripplekv_ext.ops import (gather_kv_packed, h2o_scores, select_topk, select_topk_packed, select_topk_rows,
                              snapkv_compress, snapkv_compress_rows, snapkv_scores, streaming_indices)
from ripplekv_ext.allocation import (Allocator, PyramidKVAllocator, RippleKVAllocator, RippleKVRatioAllocator,
                                     UniformAllocator)
from ripplekv_ext.selectors import (H2OSelector, KeyNormSelector, PeakSpanSelector, ScoredSelector, Selector,
                                    SnapKVSelector, StreamingLLMSelector)
from ripplekv_ext.cake import CakeAllocator, CakeSelector
from ripplekv_ext.headwise import AdaKVSelector
from ripplekv_ext.policies import Policy
from ripplekv_ext.tiers import TieredAllocator, tier_counts
from ripplekv_ext.compressor import CompressionStep, KVCompressor
from ripplekv_ext.compress_block import compress
from ripplekv_ext.context import compress_context, continue_context, load_context

# Modules the package renamed: importing an old name fails with the new one named (a finder consulted after every
# real one, so it never shadows a module that exists).
RENAMED_MODULES = {
    "ripplekv_ext.hook": "ripplekv_ext.compress_block (compress: also ripplekv_ext.compress)",
    "ripplekv_ext.rolling": "ripplekv_ext.bounded_prefill",
    "ripplekv_ext._jsonio": "ripplekv_ext.jsonio",
}


class _RenamedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in RENAMED_MODULES:
            raise ModuleNotFoundError(f"No module named {name!r}: it was renamed {RENAMED_MODULES[name]}", name=name)
        return None


if not any(isinstance(finder, _RenamedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_RenamedModuleFinder())

__version__ = "0.1.0"

__all__ = ["build_report", "cuda_built", "cuda_version", "gather_kv", "gather_kv_packed", "h2o_scores", "select_topk",
           "select_topk_packed", "select_topk_rows", "snapkv_compress", "snapkv_compress_rows", "snapkv_scores",
           "streaming_indices", "Allocator", "UniformAllocator", "PyramidKVAllocator", "RippleKVAllocator",
           "RippleKVRatioAllocator", "CakeAllocator", "TieredAllocator", "tier_counts", "Policy", "Selector",
           "ScoredSelector", "SnapKVSelector", "PeakSpanSelector", "KeyNormSelector", "H2OSelector",
           "StreamingLLMSelector", "CakeSelector", "AdaKVSelector", "KVCompressor", "CompressionStep", "compress",
           "compress_context", "continue_context", "load_context"]
