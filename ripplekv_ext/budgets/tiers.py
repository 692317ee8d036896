"""Budget tiers: per-layer budgets rounded to ``T`` levels, for engines that page layers in lock-step
(docs/design.md §4).

A paged engine gives every layer of a cache group one page at a time, so all layers of a group hold the same
number of tokens. ``TieredAllocator`` wraps any allocator and groups the compressible layers into ``T`` tiers of
equal size; every layer of a tier keeps the tier's budget. Tier membership is fixed (it never depends on the prompt
length), so an engine can give each tier its own block tables once, at start-up.

Budgets for an ``N``-token prompt: the wrapped allocator's per-layer budgets, summed per tier, become the tier
weights of the shared integer routine (``integer_budgets``) over the ``T`` tiers at the same average budget. With
tiers of equal size ``L / T`` the total is then exactly ``L * avg``, the memory of uniform SnapKV. ``T = L`` gives
back the wrapped allocator's budgets, ``T = 1`` gives uniform budgets.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ripplekv_ext.budgets.allocators import Allocator, integer_budgets
from ripplekv_ext.checks import check_int
from ripplekv_ext.policies import DEFAULT_WINDOW

__all__ = ["TieredAllocator", "tier_counts"]

# Tier membership is read off the wrapped allocator's budgets for a long reference prompt (2^20 tokens at 20%):
# long enough that integer rounding cannot reorder layers whose weights differ, and independent of any request.
_REFERENCE_TOKENS = 1 << 20
_REFERENCE_RETENTION = 0.2


def tier_counts(num_layers: int) -> list[int]:
    """The tier counts ``T`` that split ``num_layers`` layers into equal tiers (the divisors of ``num_layers``)."""
    return [t for t in range(1, num_layers + 1) if num_layers % t == 0]


class TieredAllocator(Allocator):
    """``base``'s per-layer budgets, rounded to ``num_tiers`` levels over tiers of equal size.

    Args:
        base: any allocator (``RippleKVAllocator(profile)``, ``PyramidKVAllocator()``, ...).
        num_tiers: ``T``; it must divide the number of compressible layers.

    ``tiers(layers)`` gives the tiers (lists of layer indices, the most generous tier first); ``budgets`` follows
    the allocator protocol of ``Policy``.
    """

    def __init__(self, base, num_tiers: int):
        num_tiers = check_int("num_tiers", num_tiers, 1)
        if not isinstance(base, Allocator):
            raise TypeError(f"base must be a ripplekv_ext.Allocator, got {type(base).__name__}")
        self.base = base
        self.num_tiers = num_tiers
        self.name = f"{base.name}-t{num_tiers}"
        self._tiers_cache: dict = {}  # membership depends on the layers and window only

    def _base_budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                      layers: Optional[Sequence[int]]) -> list[int]:
        return list(self.base.budgets(num_layers, n_tokens, avg_budget, window,
                                      layers=None if layers is None else list(layers)))

    def tiers(self, layers: Sequence[int], window: int = DEFAULT_WINDOW) -> list[list[int]]:
        """The compressible ``layers`` (ascending indices) cut into ``num_tiers`` equal groups, the layers with
        the largest budgets first; each group ascending."""
        layers = [int(x) for x in layers]
        cached = self._tiers_cache.get((tuple(layers), window))
        if cached is not None:
            return [list(tier) for tier in cached]
        num_layers = len(layers)
        if num_layers % self.num_tiers:
            raise ValueError(f"num_tiers must divide the {num_layers} compressible layers into equal tiers (equal "
                             f"tiers share one block size in a paged engine), got {self.num_tiers}; choose one of "
                             f"{tier_counts(num_layers)}")
        n_ref = _REFERENCE_TOKENS
        reference = self._base_budgets(num_layers, n_ref, round(_REFERENCE_RETENTION * n_ref), window, layers)
        # Largest budget first; equal budgets keep layer order, so a uniform base gives contiguous tiers.
        order = sorted(range(num_layers), key=lambda i: (-reference[i], i))
        size = num_layers // self.num_tiers
        tiers = [sorted(layers[i] for i in order[t * size:(t + 1) * size]) for t in range(self.num_tiers)]
        self._tiers_cache[(tuple(layers), window)] = tiers
        return [list(tier) for tier in tiers]

    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Optional[Sequence[int]] = None) -> list[int]:
        layers = list(range(num_layers)) if layers is None else [int(x) for x in layers]
        if len(layers) != num_layers:
            raise ValueError(f"layers must name {num_layers} layers, got {layers}")
        base = self._base_budgets(num_layers, n_tokens, avg_budget, window, layers)
        slot = {layer: i for i, layer in enumerate(layers)}
        tiers = self.tiers(layers, window)
        tier_weights = [float(sum(base[slot[layer]] for layer in tier)) for tier in tiers]
        # One integer routine for every method: the tiers' budgets sum to T * avg, so the layers' to L * avg.
        tier_budgets = integer_budgets(tier_weights, n_tokens, avg_budget, window, priority=tier_weights)
        out = [0] * num_layers
        for tier, budget in zip(tiers, tier_budgets):
            for layer in tier:
                out[slot[layer]] = budget
        return out

    def __repr__(self):
        return f"TieredAllocator({self.base!r}, num_tiers={self.num_tiers})"
