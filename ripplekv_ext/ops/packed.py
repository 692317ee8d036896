"""Multi-layer selection and gather into one packed buffer: compress every layer in two launches.

Layout: layer ``l``'s kept tokens occupy ``[..., offsets[l]:offsets[l + 1]]`` of the token dimension of one
``[B, H_kv, sum_l C_l, (D)]`` buffer, ``C_l = min(budgets[l], N)`` (cu_seqlens-style offsets). Every layer shares
``B``, ``H_kv`` and ``N``, so the segment boundaries are the same for every row.
"""

from typing import List, Sequence, Tuple, Union

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int, check_one_device, int_list


def _budget_list(budgets) -> List[int]:
    if isinstance(budgets, Tensor):
        if budgets.dim() != 1 or budgets.dtype != torch.int64:
            raise ValueError(f"select_topk_packed: budgets must be a 1-D int64 tensor [L], "
                             f"got {budgets.dim()}-D {budgets.dtype}")
        budgets = budgets.tolist()  # sizes of the output: needed on the host anyway
    return int_list("select_topk_packed", "budgets", budgets, "L", "layer")


def select_topk_packed(scores: Tensor, budgets: Union[Tensor, Sequence[int]], window: int) -> Tuple[Tensor, Tensor]:
    """``select_topk`` for every layer in one call, with per-layer budgets.

    Args:
        scores: float32 ``[L, B, H_kv, N - W]``.
        budgets: int64 tensor ``[L]`` or a sequence of ``L`` ints (a list keeps ``torch.compile`` graphs whole).
        window: ``W``.

    Returns:
        ``(indices_flat, offsets)``: int64 ``[B, H_kv, sum_l C_l]`` and int64 ``[L + 1]``, on the device of scores.
    """
    window = check_int("select_topk_packed", "window", window)
    return torch.ops.ripplekv.select_topk_packed(scores, _budget_list(budgets), window)


def gather_kv_packed(keys: Union[Tensor, Sequence[Tensor]], values: Union[Tensor, Sequence[Tensor]],
                     indices_flat: Tensor, offsets: Tensor) -> Tuple[Tensor, Tensor]:
    """Gather every layer's kept K/V rows into one packed pair ``[B, H_kv, sum_l C_l, D]`` in one launch.

    ``keys``/``values`` are ``[L, B, H_kv, N, D]`` stacked or a sequence of ``L`` tensors ``[B, H_kv, N, D]`` (an
    engine's per-layer cache: no stacking copy).
    """
    keys = list(keys.unbind(0)) if isinstance(keys, Tensor) else list(keys)
    values = list(values.unbind(0)) if isinstance(values, Tensor) else list(values)
    return torch.ops.ripplekv.gather_kv_packed(keys, values, indices_flat, offsets)


@torch.library.register_fake("ripplekv::select_topk_packed")
def _(scores, budgets, window):
    torch._check(scores.dim() == 4, lambda: f"select_topk_packed: scores must be 4-D, got {scores.dim()}-D")
    n = scores.shape[3] + window
    total = sum(torch.sym_min(n, b) for b in budgets)
    indices = scores.new_empty((scores.shape[1], scores.shape[2], total), dtype=torch.int64)
    return indices, scores.new_empty((len(budgets) + 1,), dtype=torch.int64)


@torch.library.register_fake("ripplekv::gather_kv_packed")
def _(keys, values, indices_flat, offsets):
    check_one_device("gather_kv_packed", indices_flat=indices_flat, offsets=offsets,
                     **{f"keys[{i}]": k for i, k in enumerate(keys)},
                     **{f"values[{i}]": v for i, v in enumerate(values)})
    torch._check(len(keys) > 0, lambda: "gather_kv_packed: keys must hold at least one layer")
    b, h, _, d = keys[0].shape
    shape = (b, h, indices_flat.shape[2], d)
    return keys[0].new_empty(shape), values[0].new_empty(shape)
