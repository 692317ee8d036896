"""gather_kv as torch calls: advanced indexing, a ``-1`` slot written with zeros."""

from __future__ import annotations

import torch
from torch import Tensor

from ripplekv_ext.ops.composite._checks import check_indices


def gather_kv(keys: Tensor, values: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """``ripplekv_ext.ops.gather_kv`` without ``out``, the same arguments and result."""
    torch.ops.ripplekv.gather_kv(keys[:0], values[:0], indices[:0])  # the kernel's checks
    n = keys.shape[2]
    check_indices("gather_kv", indices, n)
    pad = indices.eq(-1).unsqueeze(-1)
    if n == 0:  # only pad slots: nothing to read
        shape = (*indices.shape, keys.shape[-1])
        return keys.new_zeros(shape), values.new_zeros(shape)
    index = indices.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    return torch.gather(keys, 2, index).masked_fill(pad, 0), torch.gather(values, 2, index).masked_fill(pad, 0)
