"""snapkv_compress_rows: SnapKV compression of a left-padded batch with per-row budgets, in one call."""

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int, check_one_device, check_row_device, row_tensor


def snapkv_compress_rows(q_window: Tensor, keys: Tensor, values: Tensor, budgets: Union[Tensor, Sequence[int]],
                         lengths: Union[Tensor, Sequence[int]], kernel_size: int = 7, pooling: str = "max",
                         group_reduce: str = "mean", scale: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``snapkv_compress`` applied to each row of a left-padded batch alone: ``(k_c, v_c, idx)``.

    Row ``b``'s ``n_b = lengths[b]`` real tokens are positions ``[N - n_b, N)``; it is compressed exactly as
    ``snapkv_compress(q_window[b:b+1], keys[b:b+1, :, N - n_b:], values[b:b+1, :, N - n_b:], budgets[b], ...)``
    would (scored over its real keys only, its window the last ``W`` positions), keeping ``C_b = min(budgets[b], n_b)``
    tokens. ``k_c, v_c`` are ``[B, H_kv, C_max, D]`` and ``idx`` int64 ``[B, H_kv, C_max]``, ``C_max = max_b C_b``:
    row ``b`` in its last ``C_b`` slots (``idx`` absolute and ascending), zeros and ``-1`` in the first
    ``C_max - C_b``. ``budgets`` and ``lengths`` are int64 ``[B]`` (or ints) on the data's device or the CPU; a
    compressed row (``n_b > budgets[b]``) needs ``budgets[b] >= W``. Rows with ``n_b <= budgets[b]`` (all-pad rows
    and rows shorter than the window included) keep every real token.

    Each compressed row is one scoring, selection and gather (a loop over rows in C++, on CUDA a few launches and one
    NaN-flag read per row); lengths and budgets are read on the host first (on CUDA one synchronisation: not
    capturable in a CUDA graph).
    """
    kernel_size = check_int("snapkv_compress_rows", "kernel_size", kernel_size)
    return torch.ops.ripplekv.snapkv_compress_rows(q_window, keys, values,
                                                   row_tensor("snapkv_compress_rows", "budgets", budgets),
                                                   row_tensor("snapkv_compress_rows", "lengths", lengths),
                                                   kernel_size, pooling, group_reduce, scale)


@torch.library.register_fake("ripplekv::snapkv_compress_rows")
def _(q_window, keys, values, budgets, lengths, kernel_size=7, pooling="max", group_reduce="mean", scale=None):
    check_row_device("snapkv_compress_rows", keys, budgets=budgets, lengths=lengths)
    check_one_device("snapkv_compress_rows", q_window=q_window, keys=keys, values=values)
    torch._check(keys.dim() == 4, lambda: f"snapkv_compress_rows: keys must be 4-D, got {keys.dim()}-D")
    b, h, _, d = keys.shape
    c_max = torch.library.get_ctx().new_dynamic_size()  # max_b min(budget_b, n_b): data-dependent
    return (keys.new_empty((b, h, c_max, d)), values.new_empty((b, h, c_max, d)),
            keys.new_empty((b, h, c_max), dtype=torch.int64))
