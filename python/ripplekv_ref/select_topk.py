"""Reference top-k selection with the observation window always kept (docs/design.md §4)."""

import torch
from torch import Tensor

from ripplekv_ref._checks import check_int, check_rank


def select_topk(scores: Tensor, budget: int, window: int) -> Tensor:
    """Indices of the tokens to keep per KV head, ascending.

    Args:
        scores: float32 ``[B, H_kv, N - W]`` prefix scores; ``N = scores.shape[-1] + window``. NaN is an error.
        budget: tokens kept per row, window included (``C``).
        window: ``W``, the number of trailing positions always kept.

    Returns:
        int64 ``[B, H_kv, C]`` with ``C = min(budget, N)``: the ``C - W`` best prefix positions (ties go to the
        lower position) plus ``[N - W, N)``, ascending. When ``N <= budget`` every position is kept.
    """
    check_rank("scores", scores, 3, "[B, H_kv, N - W]")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    budget = check_int("budget", budget)
    window = check_int("window", window)
    b, h, n_prefix = scores.shape
    n = n_prefix + window
    if n <= budget:
        return torch.arange(n, device=scores.device).expand(b, h, n).contiguous()
    if budget < window:
        raise ValueError(f"budget must be >= window ({window}) when compressing (N = {n}), got {budget}")
    if torch.isnan(scores).any():
        raise ValueError("scores must not contain NaN, got NaN")
    # A stable descending sort keeps equal scores in position order, so ties go to the lower position.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    kept_prefix = order[..., : budget - window]
    window_pos = torch.arange(n_prefix, n, device=scores.device).expand(b, h, window)
    return torch.sort(torch.cat([kept_prefix, window_pos], dim=-1), dim=-1).values
