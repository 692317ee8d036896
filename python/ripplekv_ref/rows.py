"""Reference per-row ops for left-padded batches (docs/design.md §4, "Batches"): a Python loop over rows calling the
single-call reference ops on each row's real tokens.

Row ``b``'s ``n_b = lengths[b]`` real tokens are positions ``[N - n_b, N)``. Row ``b`` keeps
``C_b = min(budget_b, n_b)`` tokens; the outputs are padded to ``C_max = max_b C_b`` with the row's kept positions
(ascending, absolute) in its last ``C_b`` slots and ``-1`` (zero keys and values) in the first ``C_max - C_b``.
"""

import torch
from torch import Tensor

from ripplekv_ref._checks import check_int, check_lengths, check_rank, check_row_values
from ripplekv_ref.select_topk import select_topk
from ripplekv_ref.snapkv_compress import snapkv_compress


def _row_budgets(budgets, lengths: list[int], window: int) -> list[int]:
    values = check_row_values("budgets", budgets, len(lengths))
    for row, (budget, n_b) in enumerate(zip(values, lengths)):
        if budget < 0:
            raise ValueError(f"budgets[{row}] must be a non-negative number of tokens, got {budget}")
        if n_b > budget and budget < window:
            raise ValueError(f"budgets[{row}] must be >= window ({window}) when row {row} is compressed "
                             f"(n_b = {n_b}), got {budget}")
    return values


def select_topk_rows(scores: Tensor, budgets: Tensor, window: int, lengths: Tensor) -> Tensor:
    """Per-row ``select_topk`` of a left-padded batch.

    Args:
        scores: float32 ``[B, H_kv, N - W]``; only row ``b``'s real prefix ``[N - n_b, N - W)`` is read.
        budgets: int64 ``[B]``, tokens kept per KV head of each row, window included.
        window: ``W``; a row with ``n_b <= budget_b`` keeps everything, otherwise its ``budget_b - W`` best real
            prefix scores (ties to the lower position) plus ``[N - W, N)``.
        lengths: int64 ``[B]`` real tokens per row.

    Returns:
        int64 ``[B, H_kv, C_max]`` (module docstring). NaN in a compressed row's real scores raises, naming the row.
    """
    check_rank("scores", scores, 3, "[B, H_kv, N - W]")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    window = check_int("window", window)
    b, h, n_prefix = scores.shape
    n = n_prefix + window
    n_rows = check_lengths(lengths, b, n)
    budget_rows = _row_budgets(budgets, n_rows, window)
    kept = [min(budget, n_b) for budget, n_b in zip(budget_rows, n_rows)]
    c_max = max(kept, default=0)
    out = torch.full((b, h, c_max), -1, dtype=torch.int64, device=scores.device)
    for row, (n_b, budget, c_b) in enumerate(zip(n_rows, budget_rows, kept)):
        if c_b == 0:
            continue
        if n_b <= budget:
            out[row, :, c_max - c_b:] = torch.arange(n - n_b, n, device=scores.device)
            continue
        row_scores = scores[row:row + 1, :, n - n_b:]
        if torch.isnan(row_scores).any():
            raise ValueError(f"scores must not contain NaN, got NaN in batch row {row}")
        out[row:row + 1, :, c_max - c_b:] = select_topk(row_scores, budget, window) + (n - n_b)
    return out


def snapkv_compress_rows(q_window: Tensor, keys: Tensor, values: Tensor, budgets: Tensor, lengths: Tensor,
                         kernel_size: int = 7, pooling: str = "max", group_reduce: str = "mean",
                         scale=None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``snapkv_compress`` of a left-padded batch: ``(k_c, v_c, idx)``.

    Row ``b`` is compressed alone (``snapkv_compress`` of ``keys[b:b+1, :, N - n_b:]`` with ``budgets[b]``), its window
    the last ``W`` positions. ``k_c, v_c`` are ``[B, H_kv, C_max, D]`` with zeros in the pad slots, ``idx`` as
    ``select_topk_rows`` returns it.
    """
    check_rank("keys", keys, 4, "[B, H_kv, N, D]")
    check_rank("q_window", q_window, 4, "[B, H_q, W, D]")
    snapkv_compress(q_window[:0], keys[:0], values[:0], keys.shape[2], kernel_size, pooling, group_reduce,
                    scale)  # checks every other argument
    b, h, n, d = keys.shape
    w = q_window.shape[2]
    n_rows = check_lengths(lengths, b, n)
    budget_rows = _row_budgets(budgets, n_rows, w)
    kept = [min(budget, n_b) for budget, n_b in zip(budget_rows, n_rows)]
    c_max = max(kept, default=0)
    idx = torch.full((b, h, c_max), -1, dtype=torch.int64, device=keys.device)
    k_c = keys.new_zeros((b, h, c_max, d))
    v_c = values.new_zeros((b, h, c_max, d))
    for row, (n_b, budget, c_b) in enumerate(zip(n_rows, budget_rows, kept)):
        if c_b == 0:
            continue
        if n_b <= budget:  # nothing to compress (also when n_b < W, which the row alone could not score)
            k_c[row, :, c_max - c_b:] = keys[row, :, n - n_b:]
            v_c[row, :, c_max - c_b:] = values[row, :, n - n_b:]
            idx[row, :, c_max - c_b:] = torch.arange(n - n_b, n, device=keys.device)
            continue
        row_k, row_v, row_idx = snapkv_compress(q_window[row:row + 1], keys[row:row + 1, :, n - n_b:],
                                                values[row:row + 1, :, n - n_b:], budget, kernel_size, pooling,
                                                group_reduce, scale)
        k_c[row:row + 1, :, c_max - c_b:] = row_k
        v_c[row:row + 1, :, c_max - c_b:] = row_v
        idx[row:row + 1, :, c_max - c_b:] = row_idx + (n - n_b)
    return k_c, v_c, idx
