"""snapkv_compress: score, select and gather in one op (the fused SnapKV path)."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int, check_one_device
from ripplekv_ext.ops.cuda_path import torch_composite


def snapkv_compress(q_window: Tensor, keys: Tensor, values: Tensor, budget: int, kernel_size: int = 7,
                    pooling: str = "max", group_reduce: str = "mean",
                    scale: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Keep ``budget`` tokens per KV head (window included): ``(k_c, v_c, idx)``.

    Same result as ``select_topk(snapkv_scores(...), budget, W)`` followed by ``gather_kv``, but the scratch
    memory beyond inputs and outputs is ``O(B * H_q * W + B * H_kv * N)``: the ``[B, H_q, W, N]`` probabilities
    are never formed. ``k_c, v_c`` are ``[B, H_kv, C, D]`` and ``idx`` int64 ``[B, H_kv, C]`` ascending, with
    ``C = min(budget, N)``; when ``N <= budget`` they are copies of the inputs and ``arange(N)``.
    """
    budget = check_int("snapkv_compress", "budget", budget)
    kernel_size = check_int("snapkv_compress", "kernel_size", kernel_size)
    composite = torch_composite("snapkv_compress", keys, 4)
    if composite is not None:
        return composite(q_window, keys, values, budget, kernel_size, pooling, group_reduce, scale)
    return torch.ops.ripplekv.snapkv_compress(q_window, keys, values, budget, kernel_size, pooling, group_reduce,
                                              scale)


@torch.library.register_fake("ripplekv::snapkv_compress")
def _(q_window, keys, values, budget, kernel_size=7, pooling="max", group_reduce="mean", scale=None):
    check_one_device("snapkv_compress", q_window=q_window, keys=keys, values=values)
    torch._check(keys.dim() == 4, lambda: f"snapkv_compress: keys must be 4-D, got {keys.dim()}-D")
    b, h, n, d = keys.shape
    c = torch.sym_min(n, budget)
    return keys.new_empty((b, h, c, d)), values.new_empty((b, h, c, d)), keys.new_empty((b, h, c), dtype=torch.int64)
