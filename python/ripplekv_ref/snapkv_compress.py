"""Reference SnapKV compression pipeline: score, select, gather, as three plain steps."""

import torch
from torch import Tensor

from ripplekv_ref._checks import check_group, check_head_dim, check_int, check_rank
from ripplekv_ref.gather_kv import gather_kv
from ripplekv_ref.select_topk import select_topk
from ripplekv_ref.snapkv_scores import snapkv_scores


def snapkv_compress(q_window: Tensor, keys: Tensor, values: Tensor, budget: int, kernel_size: int = 7,
                    pooling: str = "max", group_reduce: str = "mean", scale=None) -> tuple[Tensor, Tensor, Tensor]:
    """Keep ``budget`` tokens per KV head (window included) and return ``(k_c, v_c, idx)``.

    ``k_c, v_c`` are ``[B, H_kv, C, D]`` with ``C = min(budget, N)``; ``idx`` is int64 ``[B, H_kv, C]`` ascending.
    When ``N <= budget`` nothing is scored: the result is contiguous copies of the inputs and ``arange(N)``.
    """
    check_rank("keys", keys, 4, "[B, H_kv, N, D]")
    check_rank("q_window", q_window, 4, "[B, H_q, W, D]")
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {list(keys.shape)}, got {list(values.shape)}")
    check_head_dim("keys", keys)
    check_group("q_window", q_window.shape[1], keys.shape[1])
    budget = check_int("budget", budget)
    b, h_kv, n, _ = keys.shape
    w = q_window.shape[2]
    if w > n:
        raise ValueError(f"window W (q_window dim 2) must be <= N = {n}, got {w}")
    if n <= budget:
        idx = torch.arange(n, device=keys.device).expand(b, h_kv, n).contiguous()
        return keys.contiguous().clone(), values.contiguous().clone(), idx
    if budget < w:
        raise ValueError(f"budget must be >= window ({w}) when compressing (N = {n}), got {budget}")
    scores = snapkv_scores(q_window, keys, kernel_size, pooling, group_reduce, scale)
    idx = select_topk(scores, budget, w)
    k_c, v_c = gather_kv(keys, values, idx)
    return k_c, v_c, idx
