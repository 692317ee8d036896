"""select_topk as torch calls: a stable descending sort, so equal scores go to the lower position."""

from __future__ import annotations

import torch
from torch import Tensor

from ripplekv_ext.ops.composite._checks import check_no_nan


def select_topk(scores: Tensor, budget: int, window: int, op: str = "select_topk") -> Tensor:
    """``ripplekv_ext.ops.select_topk``, the same arguments and result (``op``: the op named in its errors)."""
    torch.ops.ripplekv.select_topk(scores[:0], budget, window)  # the kernel's checks
    b, h, n_prefix = scores.shape
    n = n_prefix + window
    if n <= budget:
        return torch.arange(n, device=scores.device).expand(b, h, n).contiguous()
    check_no_nan(op, scores)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    window_pos = torch.arange(n_prefix, n, device=scores.device).expand(b, h, window)
    return torch.sort(torch.cat([order[..., : budget - window], window_pos], dim=-1), dim=-1).values
