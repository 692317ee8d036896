"""Input checks shared by the reference ops: plain Python errors naming the argument, expected and actual value."""

import numbers

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_int(name: str, value, minimum: int = 0) -> int:
    # bool is an int subclass, and a float budget would be silently truncated: both are caller bugs.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_rank(name: str, t: Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got {t.dim()}-D")


def check_float(name: str, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_group(q_name: str, h_q: int, h_kv: int) -> int:
    if h_kv == 0 or h_q == 0 or h_q % h_kv != 0:
        raise ValueError(f"{q_name} heads (H_q = {h_q}) must be a positive multiple of the key heads (H_kv = {h_kv})")
    return h_q // h_kv


def check_head_dim(name: str, t: Tensor) -> None:
    # The default scale is 1/sqrt(D): D = 0 has none (and no logits to score).
    if t.shape[-1] < 1:
        raise ValueError(f"{name} head dimension D (dim 3) must be >= 1, got {t.shape[-1]}")


def resolve_scale(scale, head_dim: int) -> float:
    return 1.0 / head_dim ** 0.5 if scale is None else float(scale)


def reduce_group(per_query_head: Tensor, h_kv: int, group_reduce: str) -> Tensor:
    """``[B, H_q, ...]`` -> ``[B, H_kv, ...]`` over the ``G`` consecutive query heads of each KV head."""
    b, h_q = per_query_head.shape[:2]
    grouped = per_query_head.reshape(b, h_kv, h_q // h_kv, *per_query_head.shape[2:])
    if group_reduce == "mean":
        return grouped.mean(dim=2)
    if group_reduce == "max":
        return grouped.amax(dim=2)
    raise ValueError(f"group_reduce must be 'mean' or 'max', got {group_reduce!r}")


def check_row_values(name: str, t, b: int) -> list[int]:
    """An int64 ``[B]`` tensor (per-row lengths or budgets) as a list of ints."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be an int64 tensor [B], got {type(t).__name__}")
    check_rank(name, t, 1, "[B]")
    if t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {t.dtype}")
    if t.shape[0] != b:
        raise ValueError(f"{name} must have B = {b} entries, got {t.shape[0]}")
    return [int(v) for v in t.tolist()]


def check_lengths(lengths, b: int, n: int) -> list[int]:
    """Left padding: row ``b``'s ``n_b`` real tokens are positions ``[N - n_b, N)``, ``0 <= n_b <= N``."""
    values = check_row_values("lengths", lengths, b)
    for row, n_b in enumerate(values):
        if not 0 <= n_b <= n:
            raise ValueError(f"lengths[{row}] (real tokens of row {row}) must be in [0, N] = [0, {n}], got {n_b}")
    return values
