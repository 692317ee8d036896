"""The torch composites a CUDA call runs instead of the fused kernel where the kernel measured slower
(``ripplekv_ext/ops/cuda_path.py`` decides which): one op per file, each the same torch calls, in the same order, as
the reference implementation the crossovers were measured against (``ripplekv_ref``, which stays the test oracle:
``tests/ops/test_composite.py`` holds each composite to it). Each first runs the kernel's own argument checks on an
empty batch, so a bad call is refused with the same message on either path, then computes on the whole batch.
"""

from ripplekv_ext.ops.composite.gather_kv import gather_kv
from ripplekv_ext.ops.composite.h2o_scores import h2o_scores
from ripplekv_ext.ops.composite.select_topk import select_topk
from ripplekv_ext.ops.composite.snapkv_compress import snapkv_compress
from ripplekv_ext.ops.composite.snapkv_scores import snapkv_scores

__all__ = ["gather_kv", "h2o_scores", "select_topk", "snapkv_compress", "snapkv_scores"]
