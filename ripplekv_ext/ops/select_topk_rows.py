"""select_topk_rows: per-row budgets for a left-padded batch (docs/design.md §4, "Batches")."""

from typing import Sequence, Union

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int, check_row_device, row_tensor


def select_topk_rows(scores: Tensor, budgets: Union[Tensor, Sequence[int]], window: int,
                     lengths: Union[Tensor, Sequence[int]]) -> Tensor:
    """``select_topk`` applied to each row of a left-padded batch alone, in one call.

    Args:
        scores: float32 ``[B, H_kv, N - W]`` (``N = scores.shape[-1] + window``). Row ``b``'s real tokens are
            positions ``[N - n_b, N)``; only its real prefix scores ``[N - n_b, N - W)`` are read (pads may hold
            anything, e.g. the ``-inf`` of ``snapkv_scores(..., lengths=...)``). NaN in a compressed row's real scores
            is an error naming the row.
        budgets: int64 ``[B]`` (or ints): tokens kept per KV head of each row, window included; a row with
            ``n_b > budgets[b]`` needs ``budgets[b] >= window``.
        window: ``W``, each compressed row's trailing positions ``[N - W, N)``, always kept.
        lengths: int64 ``[B]`` (or ints), ``n_b`` real tokens of each row, ``0 <= n_b <= N``; on the device of
            ``scores`` or the CPU.

    Returns:
        int64 ``[B, H_kv, C_max]`` with ``C_b = min(budgets[b], n_b)`` and ``C_max = max_b C_b``: row ``b``'s kept
        positions (absolute, ascending) in its last ``C_b`` slots and ``-1`` in the first ``C_max - C_b``
        (``gather_kv`` writes zeros for them). A row with ``n_b <= budgets[b]`` keeps every real position; otherwise
        its ``budgets[b] - W`` best real prefix scores (ties to the lower position) plus the window.

    Lengths and budgets are read on the host (on CUDA one synchronisation: not capturable in a CUDA graph), and each
    compressed row is one selection call (on CUDA one launch and one NaN-flag read per row).
    """
    window = check_int("select_topk_rows", "window", window)
    return torch.ops.ripplekv.select_topk_rows(scores, row_tensor("select_topk_rows", "budgets", budgets), window,
                                               row_tensor("select_topk_rows", "lengths", lengths))


@torch.library.register_fake("ripplekv::select_topk_rows")
def _(scores, budgets, window, lengths):
    check_row_device("select_topk_rows", scores, budgets=budgets, lengths=lengths)
    torch._check(scores.dim() == 3, lambda: f"select_topk_rows: scores must be 3-D, got {scores.dim()}-D")
    c_max = torch.library.get_ctx().new_dynamic_size()  # max_b min(budget_b, n_b): data-dependent
    return scores.new_empty((scores.shape[0], scores.shape[1], c_max), dtype=torch.int64)
