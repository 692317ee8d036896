"""Which implementation a call on CUDA tensors runs: the fused CUDA kernel or the torch composite.

On an H200 (the developers' runs on a torch 2.11 image, bf16, Llama-3.1-8B shapes: H_q=32, H_kv=8, D=128, W=32; the
numbers are in the GPU-kernel issue's text, no per-shape JSON is committed yet) the fused kernels lose to the torch
reference at the long contexts KV compression is for. Until new kernels measure faster, ``auto`` runs the torch
composite beyond each op's crossover below. The composite is the package's reference implementation
(``ripplekv_ref``): the code those ratios were measured against, with the same tie rule (equal scores go to the
lower position), the same ascending order and the same NaN refusal, so both paths select the same tokens from the
same scores (tests/test_cuda_path.py checks it on the CPU). It materialises what the fused kernels avoid (the
``[B, H_q, W, N]`` probabilities: 389 MiB against 14 MiB for ``snapkv_compress`` at 16K).

``RIPPLEKV_CUDA_PATH=fused|torch|auto`` (default ``auto``) forces either path. It is read at every eager call; a
``torch.compile``d graph keeps the path it was traced with. Calls on CPU tensors always run the CPU kernels.
"""

from __future__ import annotations

import os

import torch

# Per op: the longest sequence (N, keys per head) the fused kernel runs at under ``auto``; ``None``: every length.
FUSED_UP_TO = {
    # 1.8x the reference at N=2K (SmolLM2), 1.0x at 4K, 0.5x at 16K and 0.4x at 32K (Llama-3.1-8B).
    "snapkv_compress": 4096,
    # 0.5x at long N; it is snapkv_compress's first step and crosses where that op does.
    "snapkv_scores": 4096,
    # 0.3-0.7x at every measured length.
    "h2o_scores": 0,
    # 0.7x at N=16K, the one length measured: the fused kernel keeps the lengths below it.
    "select_topk": 16384 - 1,
    # 2.5-4.9x at every measured length.
    "gather_kv": None,
}

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
    import ripplekv_ref  # only here: importing ripplekv_ext loads no reference module

    return getattr(ripplekv_ref, op)
