"""h2o_scores as torch calls: the causal attention of every prompt query, summed per key, in chunks of queries."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.ops.composite._checks import check_lengths
from ripplekv_ext.ops.composite._group import reduce_group


def h2o_scores(queries: Tensor, keys: Tensor, chunk_size: int = 1024, scale: Optional[float] = None,
               group_reduce: str = "mean", lengths: Optional[Tensor] = None) -> Tensor:
    """``ripplekv_ext.ops.h2o_scores``, the same arguments and result."""
    torch.ops.ripplekv.h2o_scores(queries[:0], keys[:0], chunk_size, scale, group_reduce,
                                  None if lengths is None else lengths[:0])  # the kernel's checks
    if lengths is None:
        return _scores(queries, keys, chunk_size, scale, group_reduce)
    n = keys.shape[2]
    scores = torch.full((keys.shape[0], keys.shape[1], n), float("-inf"), device=keys.device)
    # each row alone on its real queries and keys
    for row, n_b in enumerate(check_lengths("h2o_scores", lengths, keys.shape[0], n)):
        if n_b > 0:
            scores[row:row + 1, :, n - n_b:] = _scores(queries[row:row + 1, :, n - n_b:],
                                                       keys[row:row + 1, :, n - n_b:], chunk_size, scale, group_reduce)
    return scores


def _scores(queries: Tensor, keys: Tensor, chunk_size: int, scale: Optional[float], group_reduce: str) -> Tensor:
    b, h_q, n, d = queries.shape
    k = keys.float().repeat_interleave(h_q // keys.shape[1], dim=1)
    s = 1.0 / d ** 0.5 if scale is None else float(scale)
    key_pos = torch.arange(n, device=keys.device)
    total = torch.zeros(b, h_q, n, dtype=torch.float32, device=keys.device)
    for start in range(0, n, chunk_size):  # memory O(chunk x N) per head, never O(N^2)
        stop = min(start + chunk_size, n)
        logits = s * (queries[:, :, start:stop].float() @ k.transpose(-1, -2))  # [B, H_q, chunk, N]
        query_pos = torch.arange(start, stop, device=keys.device).unsqueeze(-1)
        total += torch.softmax(logits.masked_fill(key_pos > query_pos, float("-inf")), dim=-1).sum(dim=-2)
    return reduce_group(total, keys.shape[1], group_reduce)
