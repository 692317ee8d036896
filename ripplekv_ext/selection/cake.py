"""CAKE's token score (Qin et al., ICLR 2025): which tokens a layer keeps. Each prefix position's window
attention, mean plus ``gamma`` x variance over the window queries, average-pooled over ``POOL_SIZE`` positions and
averaged over the query heads of each KV head (``eviction_scores``). How much each layer keeps is CAKE's other half,
``ripplekv_ext.budgets.cake``, which reads the same ``window_attention``.

Every definition follows the authors' code (antgroup/cakekv at c4675ce: ``cake/model/modify_llama.py`` and
``cake/utils.py``), in fp32; ``gamma = 200`` is their script's default.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ripplekv_ext.selection.selectors import ScoredSelector

__all__ = ["CakeSelector", "window_attention", "eviction_scores", "DEFAULT_GAMMA", "POOL_SIZE"]

DEFAULT_GAMMA = 200.0
POOL_SIZE = 5  # the eviction score's average pooling (the authors' kernel_size=5, zero padding counted)


def window_attention(queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None) -> Tensor:
    """float32 ``[B, H_q, W, N]``: the softmax attention of the last ``window`` queries over all ``N`` keys, causal
    inside the window (query ``i`` of the window sees keys up to its own position). ``queries`` ``[B, H_q, W', D]``
    post-RoPE, ``W' >= window``; ``keys`` ``[B, H_kv, N, D]``."""
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries and keys must be 4-D ([B, H_q, W, D] and [B, H_kv, N, D]), got "
                         f"{queries.dim()}-D and {keys.dim()}-D")
    b, h_q, _, d = queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    if not 1 <= window < n or queries.shape[2] < window:
        raise ValueError(f"window must be in [1, N = {n}) and at most the queries given ({queries.shape[2]}), "
                         f"got {window}")
    q = queries[:, :, -window:].float()
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)
    logits = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d) if scale is None else float(scale))
    query_pos = torch.arange(n - window, n, device=keys.device)[:, None]
    logits = logits.masked_fill(torch.arange(n, device=keys.device) > query_pos, float("-inf"))
    return torch.softmax(logits, dim=-1)


def eviction_scores(attention: Tensor, kv_heads: int, gamma: float = DEFAULT_GAMMA) -> Tensor:
    """float32 ``[B, H_kv, N - W]``: CAKE's score of each prefix position, the window queries' mean attention plus
    ``gamma`` x its variance across them (unbiased), average-pooled over ``POOL_SIZE`` positions (zero padding
    counted) and averaged over the query heads of each KV head."""
    b, h_q, w, n = attention.shape
    scores = attention.mean(dim=-2) + gamma * attention.var(dim=-2)
    scores = F.avg_pool1d(scores[..., : n - w], POOL_SIZE, stride=1, padding=POOL_SIZE // 2)
    return scores.reshape(b, kv_heads, h_q // kv_heads, n - w).mean(dim=2)


class CakeSelector(ScoredSelector):
    """CAKE's token score (``eviction_scores``): window attention mean + ``gamma`` x variance, finite and >= 0."""

    name = "cake"

    def __init__(self, gamma: float = DEFAULT_GAMMA):
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma < 0:
            raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
        self.gamma = float(gamma)

    def score(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None,
              lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        if lengths is None:
            return eviction_scores(window_attention(queries, keys, window, scale), keys.shape[1], self.gamma)
        # A left-padded batch: each row scored alone on its real tokens, its pad positions -inf.
        b, h_kv, n, _ = keys.shape
        scores = torch.full((b, h_kv, n - window), float("-inf"), device=keys.device)
        for row, length in enumerate(lengths.tolist()):
            if length > window:
                row_keys = keys[row:row + 1, :, n - length:]
                scores[row:row + 1, :, n - length:] = self.score(queries[row:row + 1], row_keys, window, scale)
        return scores

    def __repr__(self):
        return f"CakeSelector(gamma={self.gamma:g})"
