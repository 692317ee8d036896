"""snapkv_compress as torch calls: score, select, gather, the three composites in turn."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.ops.composite.gather_kv import gather_kv
from ripplekv_ext.ops.composite.select_topk import select_topk
from ripplekv_ext.ops.composite.snapkv_scores import snapkv_scores


def snapkv_compress(q_window: Tensor, keys: Tensor, values: Tensor, budget: int, kernel_size: int = 7,
                    pooling: str = "max", group_reduce: str = "mean",
                    scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``ripplekv_ext.ops.snapkv_compress``, the same arguments and result."""
    torch.ops.ripplekv.snapkv_compress(q_window[:0], keys[:0], values[:0], budget, kernel_size, pooling,
                                       group_reduce, scale)  # the kernel's checks
    b, h_kv, n, _ = keys.shape
    if n <= budget:
        idx = torch.arange(n, device=keys.device).expand(b, h_kv, n).contiguous()
        return keys.contiguous().clone(), values.contiguous().clone(), idx
    scores = snapkv_scores(q_window, keys, kernel_size, pooling, group_reduce, scale)
    idx = select_topk(scores, budget, q_window.shape[2], op="snapkv_compress")
    k_c, v_c = gather_kv(keys, values, idx)
    return k_c, v_c, idx
