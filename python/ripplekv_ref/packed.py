"""Reference multi-layer selection and gather into one packed buffer (cu_seqlens-style offsets).

Layout: layer ``l``'s kept tokens occupy ``[..., offsets[l]:offsets[l + 1]]`` of the token dimension of a single
``[B, H_kv, sum_l C_l, (D)]`` buffer, ``C_l = min(budgets[l], N)``. Every layer shares ``B`` and ``H_kv`` so the
segment boundaries are the same for every row, which is what lets one launch serve all layers.
"""

from typing import Sequence, Union

import torch
from torch import Tensor

from ripplekv_ref._checks import check_int, check_rank
from ripplekv_ref.gather_kv import gather_kv
from ripplekv_ref.select_topk import select_topk


def _budget_list(budgets: Union[Tensor, Sequence[int]], layers: int) -> list[int]:
    if isinstance(budgets, Tensor):
        if budgets.dim() != 1 or budgets.dtype != torch.int64:
            raise ValueError(f"budgets must be a 1-D int64 tensor [L], got {budgets.dim()}-D {budgets.dtype}")
        budgets = budgets.tolist()
    budgets = [check_int(f"budgets[{i}]", x) for i, x in enumerate(budgets)]
    if len(budgets) != layers:
        raise ValueError(f"budgets must have L = {layers} entries (scores dim 0), got {len(budgets)}")
    return budgets


def select_topk_packed(scores: Tensor, budgets: Union[Tensor, Sequence[int]], window: int) -> tuple[Tensor, Tensor]:
    """Per-layer ``select_topk`` with per-layer budgets, packed.

    Args:
        scores: float32 ``[L, B, H_kv, N - W]`` (each layer's prefix scores, stacked).
        budgets: ``[L]`` int64 tensor or a sequence of ints: tokens kept per KV head in each layer, window included.
        window: ``W``.

    Returns:
        ``(indices_flat, offsets)``: int64 ``[B, H_kv, sum_l C_l]`` and int64 ``[L + 1]`` (``offsets[0] = 0``),
        both on the device of ``scores``.
    """
    check_rank("scores", scores, 4, "[L, B, H_kv, N - W]")
    budgets = _budget_list(budgets, scores.shape[0])
    per_layer = [select_topk(scores[l], budgets[l], window) for l in range(scores.shape[0])]
    sizes = [0] + [p.shape[-1] for p in per_layer]
    offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(scores.device)
    if not per_layer:
        return torch.empty(0, 0, 0, dtype=torch.int64, device=scores.device), offsets
    return torch.cat(per_layer, dim=-1), offsets


def gather_kv_packed(keys, values, indices_flat: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """Gather every layer's kept K/V rows into one packed pair of buffers.

    Args:
        keys, values: ``[L, B, H_kv, N, D]`` stacked, or a sequence of ``L`` tensors ``[B, H_kv, N, D]``
            (an engine's per-layer cache, no stacking copy needed).
        indices_flat, offsets: as returned by ``select_topk_packed``.

    Returns:
        ``(k_flat, v_flat)``, each ``[B, H_kv, sum_l C_l, D]``; segment ``l`` comes from layer ``l``.
    """
    check_rank("indices_flat", indices_flat, 3, "[B, H_kv, total]")
    bounds = [int(x) for x in offsets.tolist()]
    if len(bounds) != len(keys) + 1:
        raise ValueError(f"offsets must have L + 1 = {len(keys) + 1} entries, got {len(bounds)}")
    parts = [gather_kv(keys[l], values[l], indices_flat[..., bounds[l]:bounds[l + 1]]) for l in range(len(keys))]
    return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)
