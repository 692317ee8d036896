"""Which implementation a call on CUDA tensors runs: the fused CUDA kernel or the torch composite.

On an H200 (bench/results/gpu_kernels_h200.json: torch 2.11 image, Llama-3.1-8B shapes H_q=32, H_kv=8, D=128,
W=32, 20% kept, bf16 and fp16, medians of 20 CUDA-event timings) the fused kernels lose to the torch reference at the
long contexts KV compression is for. Until new kernels measure faster, ``auto`` runs the torch composite beyond each
op's crossover below (``ripplekv_ext/ops/composite/``): the same torch calls as the reference implementation those
ratios were measured against (``ripplekv_ref``, the test oracle, which tests/ops/test_composite.py holds it to, bit
for bit), with the same tie rule (equal scores go to the lower position), the same ascending order and the kernel's
own argument checks, so both paths select the same tokens from the same scores and refuse the same calls
(tests/ops/test_cuda_path.py checks it on the CPU). It materialises what the fused kernels avoid (the
``[B, H_q, W, N]`` probabilities: 389 MiB against 14 MiB for ``snapkv_compress`` at 16K).

``RIPPLEKV_CUDA_PATH=fused|torch|auto`` (default ``auto``) forces either path. It is read at every eager call; a
``torch.compile``d graph keeps the path it was traced with. Calls on CPU tensors always run the CPU kernels.
"""

from __future__ import annotations

import os

import torch

# Per op: the longest sequence (N, keys per head) the fused kernel runs at under ``auto``; ``None``: every length.
# Written from the committed H200 table by ``crossovers`` (tests/ops/test_cuda_path.py checks that they agree): the
# longest measured N up to which the kernel is at least as fast as the reference in every dtype measured.
FUSED_UP_TO = {
    # 1.09x / 1.15x (bf16 / fp16) at N=2K, 0.93x / 1.05x at 4K, 0.51x / 0.49x at 16K, 0.40x at 32K.
    "snapkv_compress": 2048,
    # 1.00x / 0.93x at 2K, 0.53x / 0.81x at 4K, 0.36-0.37x at 32K.
    "snapkv_scores": 0,
    # 0.32-0.45x at 2K-8K (the reference is quadratic in N and timed up to 8K).
    "h2o_scores": 0,
    # 4.18x / 1.75x at 2K, 1.26x / 1.22x at 8K, 0.70x / 0.73x at 16K, 0.51x at 32K.
    "select_topk": 8192,
    # 2.18-4.25x at every measured length.
    "gather_kv": None,
}


def crossovers(rows) -> dict:
    """``FUSED_UP_TO`` as a kernel table's rows (``bench/gpu_kernels.py``'s JSON: ``op``, ``n``, ``speedup`` =
    reference time / fused time, one row per dtype) say it: per op, the longest measured N up to which the kernel is
    at least as fast in every dtype; ``None`` when it is at every measured N; 0 when it loses at the shortest."""
    by_op: dict = {}
    for row in rows:
        by_op.setdefault(row["op"], {}).setdefault(row["n"], []).append(row["speedup"])
    limits = {}
    for op, by_n in by_op.items():
        first_loss = min((n for n, speedups in by_n.items() if min(speedups) < 1.0), default=None)
        limits[op] = None if first_loss is None else max((n for n in by_n if n < first_loss), default=0)
    return limits


PATHS = ("fused", "torch", "auto")
ENV = "RIPPLEKV_CUDA_PATH"


def forced_path() -> str:
    """``RIPPLEKV_CUDA_PATH``, checked: ``fused``, ``torch`` or ``auto`` (unset)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in PATHS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(PATHS)}")
    return value


def cuda_path(op: str, n: int) -> str:
    """``"fused"`` or ``"torch"``: what a CUDA call of ``op`` over ``n`` keys per head runs."""
    if op not in FUSED_UP_TO:
        raise KeyError(f"no CUDA path rule for op {op!r}; known: {', '.join(sorted(FUSED_UP_TO))}")
    forced = forced_path()
    if forced != "auto":
        return forced
    limit = FUSED_UP_TO[op]
    return "fused" if limit is None or n <= limit else "torch"


def is_cuda_call(tensor) -> bool:
    """Whether a call on ``tensor`` runs on CUDA (the one place the device is asked)."""
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda


def torch_composite(op: str, tensor, rank: int, extra: int = 0):
    """``op``'s torch composite when this call runs it, else None: when ``tensor`` (the call's keys or scores, of
    ``rank`` dimensions, ``[B, H, N, ...]``) is on CUDA and ``op``'s rule picks torch for ``n = N + extra``. A tensor
    of another rank stays on the kernel, whose checks name it."""
    if not (is_cuda_call(tensor) and tensor.dim() == rank):
        return None
    if cuda_path(op, tensor.shape[2] + extra) != "torch":
        return None
    from ripplekv_ext.ops import composite  # only here: a CPU call never needs it

    return getattr(composite, op)
