"""CAKE (Qin et al., ICLR 2025, "Cascading and Adaptive KV cache Eviction with Layer Preferences").

CAKE decides both things at once from the prompt's own attention, read at the end of each layer's prefill:

* **how much each layer keeps** (``CakeAllocator``): the layer's preference ``P = H ** (1/tau1) * V ** (1/tau2)``,
  ``H`` the entropy of its observation window's attention over the prefix (summed over heads and window queries),
  ``V`` the variance of that attention across the window queries (summed over heads and prefix positions); the
  total prefix budget ``(avg - W) x L`` is split in proportion to ``P`` (``cake_budgets``);
* **which tokens** (``CakeSelector``, in ``ripplekv_ext.selection.cake``): each prefix position's window
  attention, mean plus ``gamma`` x variance over the window queries, average-pooled over 5 positions and averaged over
  the query heads of each KV head.

Every definition follows the authors' code (antgroup/cakekv at c4675ce: ``cake/model/modify_llama.py`` and
``cake/utils.py``), in fp32. Their tuned ``tau1, tau2`` (``model2tau.json``) cover five 7-13B models and neither of
ours, so the defaults are their script's own (``tau1 = tau2 = 1``, ``gamma = 200``).

The budgets depend on every layer's attention, so a layer's cut is known only once the last layer has read the
prompt: ``compress(model, Policy.cake(r))`` holds each layer whole until the end of the prefill forward, then cuts
every layer (CAKE's non-cascading form). The authors' cascading form re-cuts the layers read so far by their stored
scores as each layer arrives, against the same total, and ends at the same budgets, with a lower peak during the
prefill. Here a prefill's memory is bounded by bounded prefill (``prefill_chunk``) instead, which needs the budgets
before the prompt is read: a CAKE policy refuses it, and compression during decoding (``decode_every``), whose
budgets are split again as the sequence grows.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ripplekv_ext.budgets.allocators import Allocator, uniform_budgets
from ripplekv_ext.checks import check_int
from ripplekv_ext.selection.cake import window_attention

__all__ = ["CakeAllocator", "cake_budgets", "layer_preference", "DEFAULT_TAU1", "DEFAULT_TAU2"]

DEFAULT_TAU1 = 1.0
DEFAULT_TAU2 = 1.0
_ENTROPY_EPS = 1e-10  # inside the entropy's log, as the authors write it


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def layer_preference(attention: Tensor, tau1: float = DEFAULT_TAU1, tau2: float = DEFAULT_TAU2) -> float:
    """CAKE's layer preference from ``window_attention``'s ``[B, H_q, W, N]``: the entropy ``H`` of the prefix
    columns (``-sum A log(A + 1e-10)`` over all of them) and the variance ``V`` across the window queries (unbiased,
    summed over the rest), as ``H ** (1/tau1) * V ** (1/tau2)``."""
    prefix = attention[..., : attention.shape[3] - attention.shape[2]]
    entropy = float(-(prefix * torch.log(prefix + _ENTROPY_EPS)).sum())
    variance = float(prefix.var(dim=-2).sum())
    try:
        preference = entropy ** (1.0 / tau1) * variance ** (1.0 / tau2)
    except OverflowError:
        preference = math.inf
    if not math.isfinite(preference):
        raise ValueError(f"CAKE's layer preference H ** (1/tau1) x V ** (1/tau2) is not a finite number with "
                         f"tau1={tau1:g}, tau2={tau2:g} (this layer's H = {entropy:.4g}, V = {variance:.4g}): use "
                         "larger tau1 and tau2 (1, the authors' default, or a few tenths)")
    return preference


def cake_budgets(preferences: Sequence[float], n_tokens: int, avg_budget: int, window: int) -> list[int]:
    """Each layer's budget (window included) from its preference, as the authors' ``adjust_budgets`` computes it.

    The prefix total ``T = (avg_budget - window) x L`` is split as ``int(P_l / sum(P) x T)`` (truncated); what
    exceeds a layer's prefix ``N - window``, and what the truncation left short of ``T``, is spread evenly over the
    layers below their prefix (the remainder to the lowest layers first), again until no layer is over. A layer
    keeps at least the window and at most ``N``; the total is exactly ``L x avg_budget``. All preferences zero: equal
    shares. ``N <= avg_budget``: every layer keeps all ``N`` tokens."""
    prefs = [float(p) for p in preferences]
    if not prefs or any(not math.isfinite(p) or p < 0 for p in prefs):
        raise ValueError(f"preferences must be finite numbers >= 0, one per layer, got {prefs}")
    n = check_int("n_tokens", n_tokens, 1)
    avg = check_int("avg_budget", avg_budget, 1)
    window = check_int("window", window, 0)
    layers = len(prefs)
    if n <= avg:
        return [n] * layers
    if avg < window:
        raise ValueError(f"avg_budget must be >= window = {window}, got {avg}")
    prefix, total = n - window, (avg - window) * layers
    weight = sum(prefs)
    budgets = [int(p / weight * total) if weight > 0 else total // layers for p in prefs]
    # The authors spread once; where that pushes a layer past its prefix again their eviction clamps it and the
    # total shrinks. Spreading until nothing is over keeps the total exact (it always can: T < L x (N - W)).
    while True:
        excess = sum(max(b - prefix, 0) for b in budgets)
        budgets = [min(b, prefix) for b in budgets]
        _spread(budgets, excess, [i for i, b in enumerate(budgets) if b < prefix])
        _spread(budgets, total - sum(budgets), [i for i, b in enumerate(budgets) if b < prefix])  # the truncation's
        if all(b <= prefix for b in budgets):
            break
    return [b + window for b in budgets]


def _spread(budgets: list[int], amount: int, layers: list[int]) -> None:
    """Add ``amount`` (negative: take it) evenly over ``layers``, one more to the first ``|amount| % len`` of them."""
    if amount == 0 or not layers:
        return
    share, remainder = divmod(abs(amount), len(layers))
    sign = 1 if amount > 0 else -1
    for k, i in enumerate(layers):
        budgets[i] += sign * (share + (k < remainder))


class CakeAllocator(Allocator):
    """CAKE's layer budgets: each layer's share of the total from its own window attention (``cake_budgets``).

    ``reads_attention``: the budgets come from the prompt (``attention_budgets``, given each layer's preference);
    ``budgets`` is the plan before the prompt is read, the total evenly, what an engine reserves.
    ``tau1``/``tau2``: the exponents' inverses on the entropy and the variance, finite and > 0.
    """

    name = "cake"
    reads_attention = True

    def __init__(self, tau1: float = DEFAULT_TAU1, tau2: float = DEFAULT_TAU2):
        self.tau1, self.tau2 = _positive("tau1", tau1), _positive("tau2", tau2)

    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Optional[Sequence[int]] = None) -> list[int]:
        return uniform_budgets(num_layers, n_tokens, avg_budget, window)

    def preference(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None) -> float:
        """One layer's preference from its window queries and keys (``layer_preference``)."""
        return layer_preference(window_attention(queries, keys, window, scale), self.tau1, self.tau2)

    def attention_budgets(self, preferences: Sequence[float], n_tokens: int, avg_budget: int,
                          window: int) -> list[int]:
        return cake_budgets(preferences, n_tokens, avg_budget, window)

    def __repr__(self):
        return f"CakeAllocator(tau1={self.tau1:g}, tau2={self.tau2:g})"
