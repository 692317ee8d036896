"""The kernels' checks that read the data, which an empty batch cannot make: raised as the kernels raise them
(``RuntimeError``, the same words as ``csrc/``), so a call is refused the same way on either path."""

from __future__ import annotations

import torch
from torch import Tensor


def check_lengths(op: str, lengths: Tensor, batch: int, n: int) -> list[int]:
    """``lengths`` (int64 ``[B]``, its type checked by the kernel) as ints, one per row, each in ``[0, N]``."""
    if lengths.shape[0] != batch:
        raise RuntimeError(f"{op}: lengths dim 0 (B) must be {batch}, got {lengths.shape[0]}")
    values = lengths.tolist()
    for row, n_b in enumerate(values):
        if not 0 <= n_b <= n:
            raise RuntimeError(f"{op}: lengths[{row}] (real tokens of row {row}) must be in [0, N] = [0, {n}], "
                               f"got {n_b}")
    return values


def check_no_nan(op: str, scores: Tensor) -> None:
    """``scores`` ``[B, H_kv, P]`` without NaN, else the first NaN's row ``b * H_kv + h`` and position."""
    nan = torch.isnan(scores)
    if bool(nan.any()):
        row, position = (int(i) for i in nan.reshape(-1, scores.shape[-1]).nonzero()[0])
        raise RuntimeError(f"{op}: scores must not contain NaN, got NaN at position {position} of row {row} (row = "
                           "b * H_kv + h) (NaN or inf in q_window/queries or keys gives NaN scores)")


def check_indices(op: str, indices: Tensor, n: int) -> None:
    """Every index in ``[0, N)`` or ``-1`` (a pad slot), else the first offender and where it is."""
    if indices.numel() == 0:
        return
    bad = (indices < -1) | (indices >= n)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise RuntimeError(f"{op}: indices must lie in [0, N) = [0, {n}) or be -1 (a pad slot, written with zeros), "
                           f"got {int(indices[tuple(where)])} at [{', '.join(map(str, where))}] (nothing was written)")
