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


def snapkv_scores(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (rand(1, 4, 4, 16, device=device, dtype=dtype),
                                 rand(1, 2, 40, 16, device=device, dtype=dtype, seed=1), 7, "max", "mean", None)))
    q, k = rand(2, 4, 4, 16, device=device), rand(2, 2, 40, 16, device=device, seed=1)
    out.append(("avg, group max, scale", (q, k, 3, "avg", "max", 0.5)))
    out.append(("no pooling", (q, k, 1, "max", "mean", None)))
    out.append(("bnhd", (bnhd(q), bnhd(k), 5, "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], 7, "max", "mean", None)))
    out.append(("lengths", (q, k, 7, "max", "mean", None, torch.tensor([40, 17], device=device))))
    out.append(("lengths on cpu, short row", (bnhd(q), bnhd(k), 5, "avg", "max", None, torch.tensor([3, 40]))))
    return out


def lengths_and_budgets(lengths, budgets, device):
    return (torch.tensor(budgets, dtype=torch.int64, device=device), torch.tensor(lengths, dtype=torch.int64, device=device))


def snapkv_compress_rows(device):
    out = []
    for dtype in FLOAT_DTYPES:
        q, k, v = (rand(3, 4, 4, 16, device=device, dtype=dtype), rand(3, 2, 40, 16, device=device, dtype=dtype, seed=1),
                   rand(3, 2, 40, 16, device=device, dtype=dtype, seed=2))
        out.append((f"{dtype}", (q, k, v, *lengths_and_budgets([40, 25, 9], [12, 20, 9], device), 7, "max", "mean",
                                 None)))
    q, k, v = (rand(3, 4, 4, 16, device=device), rand(3, 2, 40, 16, device=device, seed=1),
               rand(3, 2, 40, 16, device=device, seed=2))
    out.append(("all-pad and short rows", (q, k, v, *lengths_and_budgets([0, 40, 2], [8, 4, 8], device), 7, "max",
                                           "mean", None)))
    out.append(("avg, group max, scale", (q, k, v, *lengths_and_budgets([40, 30, 20], [10, 10, 10], device), 3, "avg",
                                          "max", 0.5)))
    out.append(("bnhd", (bnhd(q), bnhd(k), bnhd(v), *lengths_and_budgets([33, 40, 12], [10, 9, 8], device), 7,
                         "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], v[:0], *lengths_and_budgets([], [], device), 7, "max", "mean", None)))
    return out


def snapkv_compress(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (rand(1, 4, 4, 16, device=device, dtype=dtype),
                                 rand(1, 2, 40, 16, device=device, dtype=dtype, seed=1),
                                 rand(1, 2, 40, 16, device=device, dtype=dtype, seed=2), 12, 7, "max", "mean", None)))
    q, k, v = (rand(2, 4, 4, 16, device=device), rand(2, 2, 40, 16, device=device, seed=1),
               rand(2, 2, 40, 16, device=device, seed=2))
    for budget in (4, 39, 40, 100):  # window only, just compressing, N, above N
        out.append((f"budget {budget}", (q, k, v, budget, 7, "max", "mean", None)))
    out.append(("avg, group max, scale", (q, k, v, 10, 3, "avg", "max", 0.5)))
    out.append(("bnhd", (bnhd(q), bnhd(k), bnhd(v), 10, 7, "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], v[:0], 10, 7, "max", "mean", None)))
    return out


def h2o_scores(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (rand(1, 4, 24, 8, device=device, dtype=dtype),
                                 rand(1, 2, 24, 8, device=device, dtype=dtype, seed=1), 1024, None, "mean")))
    q, k = rand(2, 4, 24, 8, device=device), rand(2, 2, 24, 8, device=device, seed=1)
    out.append(("chunks, scale, group max", (q, k, 5, 0.3, "max")))
    out.append(("bnhd", (bnhd(q), bnhd(k), 8, None, "mean")))
    out.append(("empty batch", (q[:0], k[:0], 8, None, "mean")))
    out.append(("lengths", (q, k, 5, None, "mean", torch.tensor([24, 9], device=device))))
    out.append(("lengths, all-pad row", (bnhd(q), bnhd(k), 8, 0.3, "max", torch.tensor([0, 24]))))
    return out


SAMPLES = {f.__name__: f for f in (snapkv_scores, snapkv_compress, h2o_scores, snapkv_compress_rows)}


def samples(op: str, device):
    return SAMPLES[op](device)
