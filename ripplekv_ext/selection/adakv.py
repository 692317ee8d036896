"""AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"; kvpress's
``AdaKVPress``): head-wise budgets inside each layer's budget.

A layer's budget ``C`` (tokens per KV head, window included) is ``H x (C - W)`` prefix slots over its ``H`` KV heads.
AdaKV gives each head a floor of its own best positions, ``alpha x C`` tokens with the window counted in (kvpress's
``alpha_safeguard = 0.2`` of a head's average), and the rest of the layer's slots to the best scores across all its
heads, so a head whose attention is spread takes slots from one whose attention is peaked. The scores are any
``ScoredSelector``'s (SnapKV's by default, as kvpress pairs them).

Heads then hold different counts. A compact cache keeps them padded to the longest head, with a per-head key mask
(``KVCompressor.compress_heads``), so the same kept tokens cost ``H x max_h c_h`` slots instead of ``H x C``. Two
modes say which budget is equal to the other methods':

* ``padded=False`` (``"adakv"``): equal *kept tokens*, what AdaKV's paper and kvpress report; the padded layout holds
  more than the budget.
* ``padded=True`` (``"adakv-padded"``): equal *bytes* in that layout: the layer's slots are given out in the same
  order, but only until some head would hold more than ``C`` (its share of the bytes), so no head exceeds the
  budget and the layout holds ``H x C`` slots, as every other method's does.

Each head keeps a prefix of its own ranking, so at equal bytes AdaKV keeps a subset of what the same scores keep
with a uniform count per head (SnapKV): it can only keep less.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.selection.selectors import ScoredSelector, Selector, SnapKVSelector

__all__ = ["AdaKVSelector", "headwise_selection", "DEFAULT_ALPHA"]

DEFAULT_ALPHA = 0.2  # kvpress's AdaKVPress alpha_safeguard


def headwise_selection(scores: Tensor, budget: int, window: int, alpha: float = DEFAULT_ALPHA,
                       padded: bool = False) -> Tensor:
    """int64 ``[B, H, C_max]``: each KV head's kept positions under AdaKV's head-wise budgets, ascending, right-aligned
    (a head keeping ``c_h`` positions fills its last ``c_h`` slots, ``-1`` before them), the window
    ``[P, P + window)`` last. ``scores`` float32 ``[B, H, P]`` are the prefix positions' scores (``P = N - window``);
    ``budget`` (window included, ``window <= budget <= N``) is the layer's tokens per head on average. Equal scores go
    to the lower position, and across heads to the lower head."""
    if scores.dim() != 3:
        raise ValueError(f"scores must be 3-D [B, H, N - window], got {scores.dim()}-D")
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN (NaN or inf in the model's queries or keys): nothing can be ranked")
    b, h, p = scores.shape
    slots = budget - window  # prefix slots per head, on average
    if not 0 <= slots <= p:
        raise ValueError(f"budget must be in [window, N] = [{window}, {p + window}], got {budget}")
    device = scores.device
    positions = torch.arange(p, device=device)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, positions.expand(b, h, p))
    floor = min(max(int(alpha * budget) - window, 0), slots)
    priority = scores.masked_fill(rank < floor, math.inf).reshape(b, h * p)
    flat_order = priority.argsort(dim=-1, descending=True, stable=True)
    take = torch.full((b, 1), h * slots, device=device)
    if padded and slots < p:
        # The first slot in that order that would be some head's (slots + 1)-th: the layer stops just before it.
        place = torch.empty_like(flat_order).scatter_(-1, flat_order, torch.arange(h * p, device=device).expand(b, -1))
        first_over = place.masked_fill(rank.reshape(b, h * p) != slots, h * p).amin(dim=-1, keepdim=True)
        take = torch.minimum(take, first_over)
    kept = torch.zeros(b, h * p, dtype=torch.bool, device=device)
    kept.scatter_(-1, flat_order, torch.arange(h * p, device=device).expand(b, -1) < take)
    kept = kept.reshape(b, h, p)
    longest = int(kept.sum(dim=-1).max()) if kept.numel() else 0
    # Unkept positions sort first as -1; each head's kept ones follow, ascending.
    ranked = torch.where(kept, positions, -1).sort(dim=-1).values[..., p - longest:]
    tail = torch.arange(p, p + window, device=device).expand(b, h, window)
    return torch.cat([ranked, tail], dim=-1)


class AdaKVSelector(Selector):
    """AdaKV's head-wise budgets over ``scorer``'s scores (a ``ScoredSelector``, SnapKV's by default).

    ``alpha``: each head's floor, a fraction in ``[0, 1]`` of the layer budget (window counted in). ``padded``: equal
    bytes in a padded per-head layout instead of equal kept tokens (the module docstring says both). Its selections
    hold a different count per head: ``KVCompressor.compress_heads`` keeps them with a per-head key mask; the engines
    and bounded prefill, which hold one count per head, refuse it.
    """

    head_wise = True

    def __init__(self, scorer: Optional[ScoredSelector] = None, alpha: float = DEFAULT_ALPHA, padded: bool = False):
        scorer = SnapKVSelector() if scorer is None else scorer
        if not isinstance(scorer, ScoredSelector):
            raise TypeError(f"scorer must be a ripplekv_ext.ScoredSelector (its scores are ranked), got "
                            f"{type(scorer).__name__}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be a fraction in [0, 1] (each head's floor), got {alpha!r}")
        if not isinstance(padded, bool):
            raise ValueError(f"padded must be True or False, got {padded!r}")
        self.scorer, self.alpha, self.padded = scorer, float(alpha), padded

    name = property(lambda self: "adakv-padded" if self.padded else "adakv")
    needs_all_queries = property(lambda self: self.scorer.needs_all_queries)
    needs_values = property(lambda self: self.scorer.needs_values)

    def select(self, queries: Tensor, keys: Tensor, budget: int, window: int,
               scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        extra = {"values": values} if self.scorer.needs_values else {}
        scores = self.scorer.score(queries, keys, window, scale, **extra)
        return headwise_selection(scores, budget, window, self.alpha, self.padded)

    def select_rows(self, queries: Tensor, keys: Tensor, budgets: Tensor, lengths: Tensor, window: int,
                    scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        raise ValueError(f"{self!r} holds a different count per head: a left-padded batch (one count per row) "
                         "cannot carry it; run its prompts one at a time or unpadded")

    def __repr__(self):
        return f"AdaKVSelector({self.scorer!r}, alpha={self.alpha:g}, padded={self.padded})"
