"""Typed wrappers and fake (meta) kernels for every torch.ops.ripplekv op; one op per file."""

from ripplekv_ext.ops.gather_kv import gather_kv
from ripplekv_ext.ops.h2o_scores import h2o_scores
from ripplekv_ext.ops.packed import gather_kv_packed, select_topk_packed
from ripplekv_ext.ops.select_topk import select_topk
from ripplekv_ext.ops.select_topk_rows import select_topk_rows
from ripplekv_ext.ops.snapkv_compress import snapkv_compress
from ripplekv_ext.ops.snapkv_compress_rows import snapkv_compress_rows
from ripplekv_ext.ops.snapkv_scores import snapkv_scores
from ripplekv_ext.ops.streaming_indices import streaming_indices

__all__ = ["gather_kv", "gather_kv_packed", "h2o_scores", "select_topk", "select_topk_packed", "select_topk_rows",
           "snapkv_compress", "snapkv_compress_rows", "snapkv_scores", "streaming_indices"]
