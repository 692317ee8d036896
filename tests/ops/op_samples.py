"""Tensor builders for the ops' sample inputs and bad-input rows (each op's test file lists its own, with these).

Seeded and built on the CPU, then moved: a sample or a row gives the same values on every device.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rand(*shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def idx(*shape, n, device, seed=0):
    """Random indices in [0, n)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, shape, generator=g).to(device)


def bnhd(t):
    # The same values laid out [B, N, H, D] and seen as [B, H, N, D], as many engines keep their cache.
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def nan_at(t, *index):
    t = t.clone()
    t[index] = float("nan")
    return t

