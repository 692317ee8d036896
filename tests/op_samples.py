"""Sample inputs of every ripplekv op, shared by the opcheck test and anything else that wants to run each op over
its interesting cases: every float dtype, budgets below, at and above N, the window-only budget, an empty batch,
non-contiguous inputs (a transposed [B, N, H, D] cache, strided slices) and the optional arguments.

`samples(op, device)` returns a list of (id, args) for `torch.ops.ripplekv.<op>.default(*args)`.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rand(*shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _bnhd(t):
    # The same values laid out [B, N, H, D] and seen as [B, H, N, D], as many engines keep their cache.
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _indices(b, h, c, n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (b, h, c), generator=g).to(device)


def gather_kv(device):
    out = []
    for dtype in FLOAT_DTYPES:
        k, v = _rand(2, 3, 20, 8, device=device, dtype=dtype), _rand(2, 3, 20, 8, device=device, dtype=dtype, seed=1)
        out.append((f"{dtype}", (k, v, _indices(2, 3, 7, 20, device))))
    k, v = _rand(2, 3, 20, 8, device=device), _rand(2, 3, 20, 8, device=device, seed=1)
    out.append(("bnhd", (_bnhd(k), _bnhd(v), _indices(2, 3, 7, 20, device))))
    out.append(("strided indices", (k, v, _indices(2, 3, 14, 20, device)[:, :, ::2])))
    out.append(("empty batch", (k[:0], v[:0], _indices(0, 3, 7, 20, device))))
    out.append(("no index", (k, v, _indices(2, 3, 0, 20, device))))
    out.append(("pad slots (-1)", (k, v, _indices(2, 3, 7, 20, device).index_fill(2, torch.tensor([0, 1], device=device),
                                                                                  -1))))
    return out


def gather_kv_into(device):
    out = []
    for name, (k, v, i) in gather_kv(device):
        shape = (k.shape[0], k.shape[1], i.shape[2], k.shape[3])
        out.append((name, (k, v, i, torch.empty(shape, dtype=k.dtype, device=device),
                           torch.empty(shape, dtype=k.dtype, device=device))))
    k, v = _rand(1, 2, 20, 8, device=device), _rand(1, 2, 20, 8, device=device, seed=1)
    cache = torch.empty(1, 2, 12, 8, device=device)
    out.append(("slice of a larger cache", (k, v, _indices(1, 2, 5, 20, device), cache[:, :, :5],
                                            torch.empty(1, 2, 5, 8, device=device))))
    return out


def snapkv_scores(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (_rand(1, 4, 4, 16, device=device, dtype=dtype),
                                 _rand(1, 2, 40, 16, device=device, dtype=dtype, seed=1), 7, "max", "mean", None)))
    q, k = _rand(2, 4, 4, 16, device=device), _rand(2, 2, 40, 16, device=device, seed=1)
    out.append(("avg, group max, scale", (q, k, 3, "avg", "max", 0.5)))
    out.append(("no pooling", (q, k, 1, "max", "mean", None)))
    out.append(("bnhd", (_bnhd(q), _bnhd(k), 5, "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], 7, "max", "mean", None)))
    out.append(("lengths", (q, k, 7, "max", "mean", None, torch.tensor([40, 17], device=device))))
    out.append(("lengths on cpu, short row", (_bnhd(q), _bnhd(k), 5, "avg", "max", None, torch.tensor([3, 40]))))
    return out


def _lengths_and_budgets(lengths, budgets, device):
    return (torch.tensor(budgets, dtype=torch.int64, device=device), torch.tensor(lengths, dtype=torch.int64, device=device))


def snapkv_compress_rows(device):
    out = []
    for dtype in FLOAT_DTYPES:
        q, k, v = (_rand(3, 4, 4, 16, device=device, dtype=dtype), _rand(3, 2, 40, 16, device=device, dtype=dtype, seed=1),
                   _rand(3, 2, 40, 16, device=device, dtype=dtype, seed=2))
        out.append((f"{dtype}", (q, k, v, *_lengths_and_budgets([40, 25, 9], [12, 20, 9], device), 7, "max", "mean",
                                 None)))
    q, k, v = (_rand(3, 4, 4, 16, device=device), _rand(3, 2, 40, 16, device=device, seed=1),
               _rand(3, 2, 40, 16, device=device, seed=2))
    out.append(("all-pad and short rows", (q, k, v, *_lengths_and_budgets([0, 40, 2], [8, 4, 8], device), 7, "max",
                                           "mean", None)))
    out.append(("avg, group max, scale", (q, k, v, *_lengths_and_budgets([40, 30, 20], [10, 10, 10], device), 3, "avg",
                                          "max", 0.5)))
    out.append(("bnhd", (_bnhd(q), _bnhd(k), _bnhd(v), *_lengths_and_budgets([33, 40, 12], [10, 9, 8], device), 7,
                         "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], v[:0], *_lengths_and_budgets([], [], device), 7, "max", "mean", None)))
    return out


def snapkv_compress(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (_rand(1, 4, 4, 16, device=device, dtype=dtype),
                                 _rand(1, 2, 40, 16, device=device, dtype=dtype, seed=1),
                                 _rand(1, 2, 40, 16, device=device, dtype=dtype, seed=2), 12, 7, "max", "mean", None)))
    q, k, v = (_rand(2, 4, 4, 16, device=device), _rand(2, 2, 40, 16, device=device, seed=1),
               _rand(2, 2, 40, 16, device=device, seed=2))
    for budget in (4, 39, 40, 100):  # window only, just compressing, N, above N
        out.append((f"budget {budget}", (q, k, v, budget, 7, "max", "mean", None)))
    out.append(("avg, group max, scale", (q, k, v, 10, 3, "avg", "max", 0.5)))
    out.append(("bnhd", (_bnhd(q), _bnhd(k), _bnhd(v), 10, 7, "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], v[:0], 10, 7, "max", "mean", None)))
    return out


def select_topk(device):
    s = _rand(2, 3, 30, device=device)
    out = [(f"budget {b}", (s, b, 4)) for b in (4, 5, 20, 34, 50)]
    out.append(("no window", (s, 10, 0)))
    out.append(("strided", (_rand(2, 3, 60, device=device)[:, :, ::2], 10, 4)))
    out.append(("empty batch", (s[:0], 10, 4)))
    return out


def select_topk_rows(device):
    def args(scores, lengths, budgets, where=device):
        return (scores, torch.tensor(budgets, dtype=torch.int64, device=where), 4,
                torch.tensor(lengths, dtype=torch.int64, device=where))

    s = _rand(3, 2, 30, device=device)
    return [("budgets by row", args(s, [34, 20, 10], [10, 15, 10])),
            ("all-pad, whole and short rows", args(s, [0, 12, 3], [10, 34, 8])),
            ("lengths on cpu", args(s, [34, 34, 30], [12, 12, 12], where="cpu")),
            ("strided", args(_rand(3, 2, 60, device=device)[:, :, ::2], [34, 31, 5], [6, 7, 4])),
            ("empty batch", args(s[:0], [], []))]


def h2o_scores(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (_rand(1, 4, 24, 8, device=device, dtype=dtype),
                                 _rand(1, 2, 24, 8, device=device, dtype=dtype, seed=1), 1024, None, "mean")))
    q, k = _rand(2, 4, 24, 8, device=device), _rand(2, 2, 24, 8, device=device, seed=1)
    out.append(("chunks, scale, group max", (q, k, 5, 0.3, "max")))
    out.append(("bnhd", (_bnhd(q), _bnhd(k), 8, None, "mean")))
    out.append(("empty batch", (q[:0], k[:0], 8, None, "mean")))
    out.append(("lengths", (q, k, 5, None, "mean", torch.tensor([24, 9], device=device))))
    out.append(("lengths, all-pad row", (_bnhd(q), _bnhd(k), 8, 0.3, "max", torch.tensor([0, 24]))))
    return out


def select_topk_packed(device):
    s = _rand(3, 2, 2, 30, device=device)
    return [("mixed budgets", (s, [4, 20, 50], 4)), ("one layer", (s[:1], [12], 4)),
            ("strided", (_rand(3, 2, 2, 60, device=device)[..., ::2], [6, 6, 6], 4)),
            ("empty batch", (s[:, :0], [10, 10, 10], 4))]


def gather_kv_packed(device):
    out = []
    for dtype in FLOAT_DTYPES:
        keys = [_rand(2, 2, 20, 8, device=device, dtype=dtype, seed=s) for s in range(3)]
        values = [_rand(2, 2, 20, 8, device=device, dtype=dtype, seed=s + 3) for s in range(3)]
        out.append((f"{dtype}", (keys, values, _indices(2, 2, 9, 20, device), torch.tensor([0, 2, 6, 9], device=device))))
    keys = [_bnhd(_rand(2, 2, 20, 8, device=device, seed=s)) for s in range(2)]
    out.append(("bnhd", (keys, keys[::-1], _indices(2, 2, 5, 20, device), torch.tensor([0, 3, 5], device=device))))
    out.append(("empty batch", ([k[:0] for k in keys], [k[:0] for k in keys], _indices(0, 2, 5, 20, device),
                                torch.tensor([0, 3, 5], device=device))))
    return out


SAMPLES = {f.__name__: f for f in (gather_kv, gather_kv_into, snapkv_scores, snapkv_compress, select_topk, h2o_scores,
                                   select_topk_packed, gather_kv_packed, select_topk_rows, snapkv_compress_rows)}


def samples(op: str, device):
    return SAMPLES[op](device)
