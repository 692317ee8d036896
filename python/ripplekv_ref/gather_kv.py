"""Reference gather: plain advanced indexing."""

import torch
from torch import Tensor


def gather_kv(keys: Tensor, values: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """``K_c[b, g, t] = K[b, g, indices[b, g, t]]`` (same for ``V``); outputs are contiguous."""
    index = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    return torch.gather(keys, 2, index), torch.gather(values, 2, index)
