"""Reference gather: plain advanced indexing."""

import torch
from torch import Tensor


def gather_kv(keys: Tensor, values: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """``K_c[b, g, t] = K[b, g, indices[b, g, t]]`` (same for ``V``); outputs are contiguous.

    An index of ``-1`` (a pad slot of the per-row ops) gives zeros; any other index outside ``[0, N)`` raises.
    """
    n = keys.shape[2]
    if indices.numel() > 0 and (indices.min() < -1 or indices.max() >= n):
        raise IndexError(f"indices must lie in [0, N) = [0, {n}) or be -1 (a pad slot)")
    pad = indices.eq(-1).unsqueeze(-1)
    index = indices.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    if n == 0:  # only pad slots: nothing to read
        shape = (*indices.shape, keys.shape[-1])
        return keys.new_zeros(shape), values.new_zeros(shape)
    return (torch.gather(keys, 2, index).masked_fill(pad, 0), torch.gather(values, 2, index).masked_fill(pad, 0))
