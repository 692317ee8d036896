"""select_topk: the tokens to keep per KV head under a budget, window included (docs/design.md §4)."""

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int
from ripplekv_ext.ops.cuda_path import torch_composite


def select_topk(scores: Tensor, budget: int, window: int) -> Tensor:
    """Indices of the ``budget - window`` best prefix scores plus the window, ascending.

    Args:
        scores: float32 ``[B, H_kv, N - W]`` prefix scores (``N = scores.shape[-1] + window``); NaN is an error
            naming the row, whatever the budget (``budget == window`` too), unless ``N <= budget``.
        budget: tokens kept per KV head, window included; must be ``>= window`` unless ``N <= budget``.
        window: ``W``, trailing positions always kept.

    Returns:
        int64 ``[B, H_kv, min(budget, N)]``, ascending. Equal scores go to the lower position, so results are
        identical across backends. ``N <= budget`` keeps every position.
    """
    budget = check_int("select_topk", "budget", budget)
    window = check_int("select_topk", "window", window)
    composite = torch_composite("select_topk", scores, 3, window)
    if composite is not None:
        return composite(scores, budget, window)
    return torch.ops.ripplekv.select_topk(scores, budget, window)


@torch.library.register_fake("ripplekv::select_topk")
def _(scores, budget, window):
    torch._check(scores.dim() == 3, lambda: f"select_topk: scores must be 3-D, got {scores.dim()}-D")
    n = scores.shape[2] + window
    return scores.new_empty((scores.shape[0], scores.shape[1], torch.sym_min(n, budget)), dtype=torch.int64)
