"""The reduction over a KV head's query heads, which both scoring composites end with."""

from __future__ import annotations

from torch import Tensor


def reduce_group(per_query_head: Tensor, kv_heads: int, group_reduce: str) -> Tensor:
    """``[B, H_q, ...]`` -> ``[B, H_kv, ...]`` over the ``G`` consecutive query heads of each KV head."""
    b, h_q = per_query_head.shape[:2]
    grouped = per_query_head.reshape(b, kv_heads, h_q // kv_heads, *per_query_head.shape[2:])
    return grouped.mean(dim=2) if group_reduce == "mean" else grouped.amax(dim=2)
