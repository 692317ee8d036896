"""Per-layer KV-cache budgets: RippleKV, uniform and PyramidKV (docs/design.md §4).

RippleKV turns a sensitivity profile into weights in one of two ways, one allocator each: `RippleKVAllocator`,
budgets proportional to a power of the sensitivity (`power_weights`, square root: the default, chosen on calibration
text of two models, docs/defaults.md), and `RippleKVRatioAllocator`, docs/design.md's `R ** z` (`ripplekv_weights`:
the paper's formula, clipped to `[1/R, R]`).

Every allocator only produces *weights*; one shared routine, `integer_budgets`, turns weights into
integer per-layer budgets with an exact total, so all methods are compared at exactly the same memory.
Budgets are tokens kept per KV head, observation window included. A layer whose budget is >= N is not
compressed.
"""

from __future__ import annotations

import abc
import hashlib
import math
from typing import Optional, Sequence

from ripplekv_ext.checks import check_int
from ripplekv_ext.equality import SettingsEquality

__all__ = [
    "average_budget", "integer_budgets", "uniform_budgets", "pyramidkv_schedule", "pyramidkv_budgets",
    "ripplekv_weights", "ripplekv_budgets", "power_weights", "power_budgets", "Allocator", "UniformAllocator",
    "PyramidKVAllocator", "ProfileAllocator", "RippleKVAllocator", "RippleKVRatioAllocator",
]

# The defaults of docs/design.md's `R ** z` weighting (used when a ratio or a normalisation is asked for): the
# budget ratio between the most and the least sensitive layer (R) and the normalisation of the sensitivities.
# Chosen from data (docs/defaults.md) when `R ** z` was RippleKV's default: R = 1.75 with min-max, selected on
# calibration text and confirmed on 8 held-out SmolLM2 prompts at 20% retention (KL -0.013 nats against the
# paper's R = 1.5 z-score, 7 of 8 prompts better); at 10% the two are within noise of each other.
DEFAULT_RATIO = 1.75
DEFAULT_NORMALIZE = "minmax"
# RippleKV's default weighting: budgets proportional to sensitivity ** 0.5. Unlike `R ** z` clipped to [1/R, R],
# it can leave a layer the profile ranks far below the others almost nothing (gemma-3-270m's last global layer,
# 7x below its first) without starving the layers in between; chosen on calibration prompts of SmolLM2 and
# gemma-3-270m over R = 1.75 min-max and exponents 0.35-1 (docs/defaults.md, "The allocation, third round").
DEFAULT_EXPONENT = 0.5


def _check_finite_list(name: str, values) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as e:  # ValueError: a string (a profile's path?) iterates into characters
        raise ValueError(f"{name} must be a sequence of numbers, got {type(values).__name__}") from e
    if not out:
        raise ValueError(f"{name} must not be empty")
    bad = [(i, v) for i, v in enumerate(out) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{name} must be finite, got {bad[0][1]} at index {bad[0][0]}")
    return out


def _check_sensitivity(values) -> list[float]:
    """Sensitivities as floats: finite and >= 0 (each is a KL divergence)."""
    out = _check_finite_list("sensitivity", values)
    negative = [(i, v) for i, v in enumerate(out) if v < 0]
    if negative:
        raise ValueError(f"sensitivity must be >= 0 (a KL divergence is never negative), got {negative[0][1]} "
                         f"at index {negative[0][0]}")
    return out


def average_budget(retention: float, n_tokens: int) -> int:
    """Average per-layer budget `round(retention * N)` for retention in (0, 1]."""
    if not (isinstance(retention, (int, float)) and 0.0 < float(retention) <= 1.0):
        raise ValueError(f"retention must be in (0, 1], got {retention!r}")
    check_int("n_tokens", n_tokens, 1)
    return max(1, round(float(retention) * n_tokens))


def integer_budgets(weights: Sequence[float], n_tokens: int, avg_budget: int, window: int,
                    priority: Sequence[float] | None = None) -> list[int]:
    """Integer budgets proportional to `weights`, summing to exactly `len(weights) * avg_budget`.

    Each budget lies in `[min(N, W + 1), N]`; what a bound removes (or adds) is redistributed over the
    unbounded layers in proportion to their weights. Rounding is by largest remainder; equal remainders go
    to the higher `priority` first (RippleKV passes the raw sensitivity, so layers whose weights were clipped
    to the same value still get budgets monotone in sensitivity), then to the lower layer index.
    If `N <= avg_budget`, every layer keeps all `N` tokens.
    """
    w = _check_finite_list("weights", weights)
    if any(x < 0 for x in w):
        raise ValueError(f"weights must be >= 0, got {min(w)}")
    n = check_int("n_tokens", n_tokens, 1)
    avg = check_int("avg_budget", avg_budget, 1)
    win = check_int("window", window, 0)
    num_layers = len(w)
    prio = [0.0] * num_layers if priority is None else _check_finite_list("priority", priority)
    if len(prio) != num_layers:
        raise ValueError(f"priority must have one entry per layer ({num_layers}), got {len(prio)}")
    if n <= avg:
        return [n] * num_layers
    lower, upper = min(n, win + 1), n
    if avg < lower:
        raise ValueError(f"avg_budget must be >= window + 1 = {lower} (the window plus at least one prefix token), "
                         f"got {avg}")
    total = num_layers * avg

    # Real-valued targets: water-filling. Each round pins the layers that cross the bound on the side that
    # is violated most, then redistributes the rest over the free layers in proportion to their weights.
    # Pinning only one side per round keeps the total exactly reachable.
    target = [0.0] * num_layers
    free = list(range(num_layers))
    pinned_total = 0.0
    while free:
        remaining = total - pinned_total
        wsum = sum(w[i] for i in free)
        for i in free:
            target[i] = remaining * w[i] / wsum if wsum > 0 else remaining / len(free)
        over = [i for i in free if target[i] > upper]
        under = [i for i in free if target[i] < lower]
        if not over and not under:
            break
        excess = sum(target[i] - upper for i in over) - sum(lower - target[i] for i in under)
        pin, bound = (over, upper) if excess >= 0 and over else (under, lower)
        for i in pin:
            target[i] = float(bound)
            pinned_total += bound
        free = [i for i in free if i not in pin]

    # Largest remainder. Snap values within float noise of an integer so equal weights give equal budgets.
    snapped = [round(t) if abs(t - round(t)) < 1e-9 else t for t in target]
    budgets = [int(math.floor(t)) for t in snapped]
    short = total - sum(budgets)
    order = sorted(range(num_layers), key=lambda i: (-(snapped[i] - budgets[i]), -prio[i], i))
    for i in order[:short]:
        budgets[i] += 1
    assert sum(budgets) == total and all(lower <= b <= upper for b in budgets), (budgets, total, lower, upper)
    return budgets


def uniform_budgets(num_layers: int, n_tokens: int, avg_budget: int, window: int) -> list[int]:
    """Every layer gets `avg_budget` (or `N` when nothing needs compressing)."""
    return integer_budgets([1.0] * check_int("num_layers", num_layers, 1), n_tokens, avg_budget, window)


def pyramidkv_schedule(num_layers: int, n_tokens: int, avg_budget: int, window: int, beta: int = 20) -> list[int]:
    """PyramidKV's raw per-layer budgets as published (floored steps: the total overshoots a little)."""
    L = check_int("num_layers", num_layers, 1)
    n = check_int("n_tokens", n_tokens, 1)
    B = check_int("avg_budget", avg_budget, 1)
    W = check_int("window", window, 0)
    check_int("beta", beta, 1)
    if n <= B:
        return [n] * L
    if B <= W:
        raise ValueError(f"avg_budget must be > window = {W} for PyramidKV, got {B}")
    if n < 2 * (B - W) or L == 1:
        return [B] * L
    min_num = (B - W) // beta
    max_num = 2 * (B - W) - min_num
    if max_num >= n - W:
        max_num = n - W
        min_num = 2 * (B - W) - max_num
    steps = (max_num - min_num) // (L - 1)
    return [max_num - l * steps + W for l in range(L)]


def pyramidkv_budgets(num_layers: int, n_tokens: int, avg_budget: int, window: int, beta: int = 20) -> list[int]:
    """PyramidKV's schedule as weights through `integer_budgets`: exact total, same memory as the others."""
    raw = pyramidkv_schedule(num_layers, n_tokens, avg_budget, window, beta)
    return integer_budgets([float(b) for b in raw], n_tokens, avg_budget, window)


def ripplekv_weights(sensitivity: Sequence[float], ratio: float = DEFAULT_RATIO, normalize: str = DEFAULT_NORMALIZE,
                     clip=None) -> list[float]:
    """Per-layer weights `R ** z_l` (z = standardized sensitivity), clipped, with mean exactly 1.

    `clip=None` means `(1/R, R)`; pass `(lo, hi)` with `lo <= 1 <= hi`, or `False` for no clipping.
    All-equal sensitivities (or R = 1) give all-ones weights.
    """
    s = _check_finite_list("sensitivity", sensitivity)
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 1.0):
        raise ValueError(f"ratio must be a finite number >= 1, got {ratio!r}")
    n = len(s)
    # Both normalisations are scale-invariant; dividing by the largest magnitude first keeps sums of squares of
    # huge finite scores (1e308) from overflowing to inf.
    top = max(abs(x) for x in s)
    if top > 0:
        s = [x / top for x in s]
    if normalize == "zscore":
        mean = sum(s) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / n)
        z = [(x - mean) / std if std > 0 else 0.0 for x in s]
    elif normalize == "minmax":
        lo, hi = min(s), max(s)
        z = [2.0 * (x - lo) / (hi - lo) - 1.0 if hi > lo else 0.0 for x in s]
    else:
        raise ValueError(f"normalize must be 'zscore' or 'minmax', got {normalize!r}")
    if clip is None:
        clip = (1.0 / ratio, float(ratio))
    if clip is not False:
        try:
            clip_lo, clip_hi = (float(c) for c in clip)
        except (TypeError, ValueError) as e:
            raise ValueError(f"clip must be None, False or a (low, high) pair, got {clip!r}") from e
        if not (0.0 <= clip_lo <= 1.0 <= clip_hi):
            raise ValueError(f"clip must satisfy 0 <= low <= 1 <= high (weights have mean 1), got {clip!r}")

    w = [float(ratio) ** zi for zi in z]
    mean = sum(w) / n
    w = [x / mean for x in w]
    if clip is not False:
        # Clip then renormalize until the weights stop moving: the fixed point is both clipped and mean 1.
        for _ in range(10_000):
            clipped = [min(max(x, clip_lo), clip_hi) for x in w]
            mean = sum(clipped) / n
            new = [x / mean for x in clipped]
            change = max(abs(a - b) for a, b in zip(new, w))
            w = new
            if change < 1e-13:
                break
    return w


def ripplekv_budgets(sensitivity: Sequence[float], n_tokens: int, avg_budget: int, window: int,
                     ratio: float = DEFAULT_RATIO, normalize: str = DEFAULT_NORMALIZE, clip=None) -> list[int]:
    """RippleKV per-layer budgets: `ripplekv_weights` through the shared integer routine."""
    weights = ripplekv_weights(sensitivity, ratio, normalize, clip)
    return integer_budgets(weights, n_tokens, avg_budget, window, priority=sensitivity)


def power_weights(sensitivity: Sequence[float], exponent: float = DEFAULT_EXPONENT) -> list[float]:
    """Per-layer weights `s_l ** exponent`, rescaled to mean exactly 1 (sensitivities are >= 0).

    Exponent 0 (or all-equal sensitivities) gives all-ones weights, 1 budgets proportional to the sensitivity. A
    layer of sensitivity 0 gets weight 0: `integer_budgets` still gives it the window plus one token.
    """
    s = _check_sensitivity(sensitivity)
    if not (isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and math.isfinite(exponent)
            and exponent >= 0):
        raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")
    top = max(s)
    if top == 0 or exponent == 0:
        return [1.0] * len(s)
    w = [(x / top) ** exponent for x in s]  # scaled by the largest first: no overflow, no underflow of the top
    mean = sum(w) / len(w)
    return [x / mean for x in w]


def power_budgets(sensitivity: Sequence[float], n_tokens: int, avg_budget: int, window: int,
                  exponent: float = DEFAULT_EXPONENT) -> list[int]:
    """RippleKV's default per-layer budgets: `power_weights` through the shared integer routine."""
    return integer_budgets(power_weights(sensitivity, exponent), n_tokens, avg_budget, window, priority=sensitivity)


class Allocator(SettingsEquality, abc.ABC):
    """How many tokens each compressible layer keeps, at a given average: the type every allocator is.

    ``name`` names it in method names (``ALLOCATOR+SELECTOR``). ``reads_attention``: the budgets come from the
    prompt's own attention, read during the prefill (CAKE: ``attention_budgets`` from each layer's ``preference``);
    ``budgets`` is then only the plan before the prompt is read.
    """

    name: str = "custom"
    reads_attention: bool = False

    @abc.abstractmethod
    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Optional[Sequence[int]] = None) -> list[int]:
        """Budgets (tokens per KV head, window included) of ``num_layers`` compressible layers for an
        ``n_tokens`` prompt, summing to ``num_layers * avg_budget`` (each in ``[min(N, window + 1), N]``; an
        engine's wrapper may round them up to its block size, as the vLLM plugin's does).
        ``layers`` names those layers (ascending indices) for allocators that hold per-layer data; None means
        ``0 .. num_layers - 1``."""

    def chunk_budget(self, final_budget: int, n_read: int) -> int:
        """Tokens a layer keeps of the first ``n_read`` tokens of a prompt read in chunks whose whole length is
        known, ``final_budget`` being its budget for the whole prompt (docs/design.md §4, "Bounded (rolling) prefill"):
        every token read up to that budget, so nothing is evicted before it has to be. An engine's wrapper may round
        it (the vLLM plugin's frees whole blocks)."""
        return min(int(final_budget), int(n_read))


class UniformAllocator(Allocator):
    name = "uniform"

    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Optional[Sequence[int]] = None) -> list[int]:
        return uniform_budgets(num_layers, n_tokens, avg_budget, window)

    def __repr__(self):
        return "UniformAllocator()"


class PyramidKVAllocator(Allocator):
    name = "pyramidkv"

    def __init__(self, beta: int = 20):
        self.beta = check_int("beta", beta, 1)

    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Optional[Sequence[int]] = None) -> list[int]:
        return pyramidkv_budgets(num_layers, n_tokens, avg_budget, window, self.beta)

    def __repr__(self):
        return f"PyramidKVAllocator(beta={self.beta})"


class ProfileAllocator(Allocator):
    """Budgets from a sensitivity profile, by weights a subclass computes from it (``weights_of``).

    ``profile_or_sensitivity`` is a loaded profile (anything with ``sensitivity`` and ``layers`` lists, e.g.
    ``ripplekv_ext.budgets.profile_file.Profile``: each sensitivity belongs to the layer listed at the same position, in
    whatever order the file lists them) or a plain list of scores, one per compressible layer in ascending layer
    order.

    A profile may cover only some of the compressible layers: the profiled layers share their weights (mean 1 among
    themselves) and every compressible layer the profile does not cover gets weight 1, i.e. the average budget, so
    the total stays ``L_c * B_avg``. A profiled layer that is not compressible is an error.
    """

    name = "ripplekv"

    def __init__(self, profile_or_sensitivity):
        sensitivity = getattr(profile_or_sensitivity, "sensitivity", profile_or_sensitivity)
        self.profile = profile_or_sensitivity if sensitivity is not profile_or_sensitivity else None
        values = _check_sensitivity(sensitivity)
        layers = getattr(self.profile, "layers", None)
        if layers is not None:
            layers = [int(x) for x in layers]
            if len(layers) != len(values) or len(set(layers)) != len(layers):
                raise ValueError(f"profile layers must be {len(values)} distinct indices (one per sensitivity), "
                                 f"got {layers}")
            order = sorted(range(len(layers)), key=layers.__getitem__)
            layers = [layers[i] for i in order]
            values = [values[i] for i in order]
        # Ascending layer order from here on; `layers` None means "the compressible layers, in order".
        self.layers = layers
        self.sensitivity = values
        self.weights = self.weights_of(self.sensitivity)  # validates the weighting's settings now

    @abc.abstractmethod
    def weights_of(self, sensitivity: list[float]) -> list[float]:
        """One weight per profiled layer (ascending layer order), from their sensitivities."""

    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Sequence[int] | None = None) -> list[int]:
        """Budgets of ``num_layers`` compressible layers; ``layers`` names them (ascending layer indices), so that a
        profile's sensitivities land on the layers they were measured on."""
        if layers is None and self.layers is not None:
            layers = self.layers
        if layers is None or self.layers is None:
            if num_layers != len(self.sensitivity):
                raise ValueError(f"num_layers must match the profile's {len(self.sensitivity)} compressible layers, "
                                 f"got {num_layers}")
            return integer_budgets(self.weights, n_tokens, avg_budget, window, priority=self.sensitivity)
        layers = [int(x) for x in layers]
        if len(layers) != num_layers:
            raise ValueError(f"layers must name {num_layers} layers, got {layers}")
        extra = sorted(set(self.layers) - set(layers))
        if extra:
            raise ValueError(f"the profile covers layers {extra} that are not compressible here (compressible: "
                             f"{layers}): a profile of another model or layer layout")
        weight = dict(zip(self.layers, self.weights))
        priority = dict(zip(self.layers, self.sensitivity))
        mean_priority = sum(x / len(self.sensitivity) for x in self.sensitivity)
        return integer_budgets([weight.get(layer, 1.0) for layer in layers], n_tokens, avg_budget, window,
                               priority=[priority.get(layer, mean_priority) for layer in layers])

    def _repr(self, weighting: str) -> str:
        # The sensitivities' digest tells two profiles apart (a saved result is reused only for its own).
        digest = hashlib.sha256(repr((self.layers, self.sensitivity)).encode()).hexdigest()[:12]
        return f"{type(self).__name__}({len(self.sensitivity)} layers, {weighting}, profile={digest})"


class RippleKVAllocator(ProfileAllocator):
    """RippleKV's budgets: proportional to ``sensitivity ** exponent`` (``power_weights``; square root by default,
    ``DEFAULT_EXPONENT``)."""

    def __init__(self, profile_or_sensitivity, exponent: float = DEFAULT_EXPONENT):
        self.exponent = exponent
        super().__init__(profile_or_sensitivity)

    def weights_of(self, sensitivity: list[float]) -> list[float]:
        return power_weights(sensitivity, self.exponent)

    def __repr__(self):
        return self._repr(f"exponent={self.exponent}")


class RippleKVRatioAllocator(ProfileAllocator):
    """The paper's RippleKV budgets: weights ``R ** z`` of the normalised sensitivity ``z``, clipped to
    ``[1/R, R]`` (``ripplekv_weights``; docs/design.md §4). ``clip``: None for ``(1/R, R)``, False for none, or a
    ``(low, high)`` pair."""

    def __init__(self, profile_or_sensitivity, ratio: float = DEFAULT_RATIO, normalize: str = DEFAULT_NORMALIZE,
                 clip=None):
        self.ratio, self.normalize, self.clip = ratio, normalize, clip
        super().__init__(profile_or_sensitivity)

    def weights_of(self, sensitivity: list[float]) -> list[float]:
        return ripplekv_weights(sensitivity, self.ratio, self.normalize, self.clip)

    def __repr__(self):
        return self._repr(f"ratio={self.ratio}, normalize={self.normalize!r}, clip={self.clip!r}")
