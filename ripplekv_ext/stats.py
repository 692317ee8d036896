"""Rank statistics of profiles: Spearman's rho (with average ranks for ties), standard errors, split-half stability.

numpy only (no scipy), so the core library needs nothing more than torch and numpy.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["spearman", "standard_errors", "split_half_spearman"]


def _ranks(x: Sequence[float]) -> np.ndarray:
    """Average ranks (ties share the mean rank), as Spearman's rho needs."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation; None when undefined (fewer than 2 points or a constant input)."""
    if len(a) != len(b):
        raise ValueError(f"spearman needs equal lengths, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra ** 2).sum() * (rb ** 2).sum()))
    return None if denom == 0 else float((ra * rb).sum() / denom)


def standard_errors(per_example: Sequence[Sequence[float]]) -> list[float]:
    x = np.asarray(per_example, dtype=np.float64)
    if x.shape[0] < 2:
        return [0.0] * x.shape[1]
    return (x.std(axis=0, ddof=1) / math.sqrt(x.shape[0])).tolist()


def split_half_spearman(per_example: Sequence[Sequence[float]]) -> float | None:
    """Spearman between the profiles of the even- and odd-numbered examples (None with < 2 examples)."""
    x = np.asarray(per_example, dtype=np.float64)
    if x.shape[0] < 2:
        return None
    return spearman(x[0::2].mean(axis=0).tolist(), x[1::2].mean(axis=0).tolist())
