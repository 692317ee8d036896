"""Pure-PyTorch reference of every ripplekv op, written for clarity, not speed.

It is the oracle the tests compare the extension against and the baseline the benchmarks time.
"""

from ripplekv_ref.gather_kv import gather_kv
from ripplekv_ref.h2o_scores import h2o_scores
from ripplekv_ref.packed import gather_kv_packed, select_topk_packed
from ripplekv_ref.rows import select_topk_rows, snapkv_compress_rows
from ripplekv_ref.select_topk import select_topk
from ripplekv_ref.snapkv_compress import snapkv_compress
from ripplekv_ref.snapkv_scores import snapkv_scores
from ripplekv_ref.streaming_indices import streaming_indices

__all__ = ["gather_kv", "gather_kv_packed", "h2o_scores", "select_topk", "select_topk_packed", "select_topk_rows",
           "snapkv_compress", "snapkv_compress_rows", "snapkv_scores", "streaming_indices"]
