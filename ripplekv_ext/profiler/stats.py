"""Rank statistics of profiles: Spearman's rho (with average ranks for ties), standard errors, split-half stability;
and the confidence intervals of the evaluation report: Wilson's binomial interval, bootstrap intervals of a mean and
of a paired difference.

numpy only (no scipy), so the core library needs nothing more than torch and numpy.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["spearman", "standard_errors", "split_half_spearman", "wilson_interval", "bootstrap_mean_ci",
           "paired_bootstrap_ci"]


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


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence}")


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a binomial proportion (scipy's ``binomtest(...).proportion_ci("wilson")``):
    unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n successes."""
    from statistics import NormalDist

    _check_confidence(confidence)
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need trials >= 1 and 0 <= successes <= trials, got {successes} of {trials}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_mean_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (fixed seed: the same data give the same interval).

    Used for per-example KL, whose distribution is skewed (a few hard examples), where a t interval would be
    symmetric around the mean."""
    _check_confidence(confidence)
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"values must be a non-empty 1-D sequence, got shape {x.shape}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(low), float(high)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of ``mean(a - b)`` resampling whole examples, so each example's pair stays together:
    the example-to-example spread (some texts are hard for every method) cancels in the difference."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    return bootstrap_mean_ci(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64), confidence,
                             resamples, seed)
