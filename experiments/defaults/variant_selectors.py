"""The selectors the default was chosen against, kept where the experiments that measured them live.

``RecentSnapKVSelector`` (a fixed recent share) and ``AdaptiveRecentSelector`` (each head's recent share read off its
window's attention, SnapKV's scores for the rest) lost to ``PeakSpanSelector`` (notebook.md: "The selector", rounds
one to four); ``peak_span_unweighted`` is the default before value weighting won (round five). They are built from the
package's public selectors, so they select exactly what they did when they were measured, and ``METHODS`` gives the
names the experiment scripts and the notebook use (``ALLOCATOR+NAME``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ripplekv_ext import PeakSpanSelector, ScoredSelector, SnapKVSelector, select_topk, select_topk_rows
from ripplekv_ext.checks import check_fraction, check_int
from ripplekv_ext.selection.selectors import DEFAULT_PEAK_SHARE, free_slots_and_starts

# The recent share RecentSnapKVSelector was measured with by default: chosen on calibration text of two domains at 10,
# 20 and 30% retention (notebook.md, "The selector, first round").
DEFAULT_RECENT_FRACTION = 0.75


class _RankedSelector(ScoredSelector):
    """SnapKV's scores (``self.snapkv``) with the positions a subclass protects (``_protected``) raised to ``+inf``,
    then the top ones: what both variants do, each protecting its own positions."""

    needs_values = property(lambda self: self.snapkv.needs_values)

    def score(self, queries, keys, window, scale=None, lengths=None, values=None) -> Tensor:
        return self.snapkv.score(queries, keys, window, scale, lengths, values)

    def _ranking(self, queries, keys, window, scale, budgets, lengths=None, values=None) -> Tensor:
        scores = self.score(queries, keys, window, scale, lengths, values)
        # Protected positions outrank every score (they never exceed the free slots).
        return scores.masked_fill(self._protected(scores, *free_slots_and_starts(keys, budgets, window, lengths)),
                                  math.inf)

    def select(self, queries, keys, budget, window, scale=None, values=None) -> Tensor:
        return select_topk(self._ranking(queries, keys, window, scale, budget, values=values), budget, window)

    def select_rows(self, queries, keys, budgets, lengths, window, scale=None, values=None) -> Tensor:
        return select_topk_rows(self._ranking(queries, keys, window, scale, budgets, lengths, values), budgets,
                                window, lengths)


class RecentSnapKVSelector(_RankedSelector):
    """SnapKV with attention sinks and a recent region kept by position: of a layer's ``budget - window`` slots, the
    first ``sink`` go to the first positions, ``floor(recent_fraction * (budget - window - sink))`` to the positions
    just before the window, and the rest to the best SnapKV scores in between. ``1.0`` is StreamingLLM plus the
    window, ``0`` SnapKV with sinks."""

    name = "recent-snapkv"

    def __init__(self, recent_fraction: float = DEFAULT_RECENT_FRACTION, sink: int = 4, kernel_size: int = 7,
                 pooling: str = "max", group_reduce: str = "mean", value_weighted: bool = False):
        self.snapkv = SnapKVSelector(kernel_size, pooling, group_reduce, value_weighted)
        self.recent_fraction = check_fraction("recent_fraction", recent_fraction)
        self.sink = check_int("sink", sink, 0)

    def _protected(self, scores, free, start) -> Tensor:
        """The sinks and a recent region of ``floor(recent_fraction * (free - sinks))`` positions, every head alike."""
        sink = free.clamp(max=self.sink)
        recent = torch.floor(self.recent_fraction * (free - sink).double()).long()
        position = torch.arange(scores.shape[-1], device=scores.device)[None, :]
        protected = (((position >= start[:, None]) & (position < (start + sink)[:, None]))
                     | (position >= (scores.shape[-1] - recent)[:, None]))
        return protected[:, None, :]

    def __repr__(self):
        options = repr(self.snapkv)[len("SnapKVSelector("):-1]
        return f"RecentSnapKVSelector(recent_fraction={self.recent_fraction:g}, sink={self.sink}, {options})"


class AdaptiveRecentSelector(_RankedSelector):
    """``PeakSpanSelector``'s sinks and recent region, with SnapKV's scores (``pooling``) for every other slot."""

    name = "adaptive-recent"

    def __init__(self, sink: int = 4, kernel_size: int = 7, pooling: str = "max", group_reduce: str = "mean",
                 value_weighted: bool = False):
        self.snapkv = SnapKVSelector(kernel_size, pooling, group_reduce, value_weighted)
        self.protection = PeakSpanSelector(sink=sink, kernel_size=kernel_size, group_reduce=group_reduce,
                                           value_weighted=value_weighted)
        self.sink = sink

    def _protected(self, scores, free, start) -> Tensor:
        return self.protection.protected_positions(scores, free, start)

    def __repr__(self):
        return f"AdaptiveRecentSelector(sink={self.sink}, {repr(self.snapkv)[len('SnapKVSelector('):-1]})"


# The default's selector as it was before value weighting was chosen.
peak_span_unweighted = functools.partial(PeakSpanSelector, DEFAULT_PEAK_SHARE, value_weighted=False)

METHODS = {"recent-snapkv": RecentSnapKVSelector, "adaptive-recent": AdaptiveRecentSelector,
           "peak-span-unweighted": peak_span_unweighted}
