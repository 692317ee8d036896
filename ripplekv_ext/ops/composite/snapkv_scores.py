"""snapkv_scores as torch calls: the ``[B, H_q, W, N]`` window probabilities materialised (docs/design.md §4)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ripplekv_ext.ops.composite._checks import check_lengths
from ripplekv_ext.ops.composite._group import reduce_group


def snapkv_scores(q_window: Tensor, keys: Tensor, kernel_size: int = 7, pooling: str = "max",
                  group_reduce: str = "mean", scale: Optional[float] = None,
                  lengths: Optional[Tensor] = None) -> Tensor:
    """``ripplekv_ext.ops.snapkv_scores``, the same arguments and result."""
    torch.ops.ripplekv.snapkv_scores(q_window[:0], keys[:0], kernel_size, pooling, group_reduce, scale,
                                     None if lengths is None else lengths[:0])  # the kernel's checks
    n, w = keys.shape[2], q_window.shape[2]
    if lengths is None:
        return _scores(q_window, keys, kernel_size, pooling, group_reduce, scale)
    scores = torch.full((keys.shape[0], keys.shape[1], n - w), float("-inf"), device=keys.device)
    # each row alone on its real tokens
    for row, n_b in enumerate(check_lengths("snapkv_scores", lengths, keys.shape[0], n)):
        if n_b > w:
            scores[row:row + 1, :, n - n_b:] = _scores(q_window[row:row + 1], keys[row:row + 1, :, n - n_b:],
                                                       kernel_size, pooling, group_reduce, scale)
    return scores


def _scores(q_window: Tensor, keys: Tensor, kernel_size: int, pooling: str, group_reduce: str,
            scale: Optional[float]) -> Tensor:
    b, h_q, w, d = q_window.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)  # query head h reads KV head h // G
    logits = (1.0 / d ** 0.5 if scale is None else float(scale)) * (q_window.float() @ k.transpose(-1, -2))
    query_pos = torch.arange(n - w, n, device=keys.device).unsqueeze(-1)
    logits = logits.masked_fill(torch.arange(n, device=keys.device) > query_pos, float("-inf"))
    per_head = torch.softmax(logits, dim=-1)[..., : n - w].sum(dim=-2)  # [B, H_q, N - W]
    scores = reduce_group(per_head, h_kv, group_reduce)
    if kernel_size == 1:
        return scores.contiguous()
    flat, pad = scores.reshape(b * h_kv, 1, n - w), kernel_size // 2
    if pooling == "max":
        pooled = F.max_pool1d(F.pad(flat, (pad, pad), value=float("-inf")), kernel_size, stride=1)
    else:
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return pooled.reshape(b, h_kv, n - w)
