"""The profiler's noise: relative Gaussian perturbations of cached vectors, one seeded stream per draw."""

from __future__ import annotations

import math

import numpy as np
import torch

# The `which` stream of noise_seed: the noise on Keys, on Values, and the Fisher estimator's token samples.
KEYS, VALUES, FISHER_SAMPLES = 0, 1, 2


def noise_seed(seed: int, example: int, layer: int, draw: int, which: int) -> int:
    """The seed of one (seed, example, layer, draw, stream) draw."""
    # One independent stream per (seed, example, layer, draw, K/V): results do not depend on run order,
    # on resuming, or on the reuse optimisation.
    return int(np.random.SeedSequence([seed, example, layer, draw, which]).generate_state(1, np.uint64)[0] >> 1)


def perturb(x: torch.Tensor, sigma: float, seed: int, sign: float = 1.0) -> torch.Tensor:
    """`x + sign * sigma * ||x|| / sqrt(D) * eps` per vector (last dim), eps ~ N(0, I), computed in fp32 or wider.

    `sign=-1` gives the antithetic twin of the same draw (the same eps, negated)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    eps = torch.randn(x.shape, generator=g, dtype=torch.float32).to(x.device)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    norm = xf.norm(dim=-1, keepdim=True)
    return (xf + sign * sigma * norm / math.sqrt(x.shape[-1]) * eps).to(x.dtype)


def perturber(target: str, sigma: float, seed: int, example: int, layer: int, draw: int, sign: float = 1.0):
    """A `modify(cache_layer)` for ContinuationRunner.run: perturbs that layer's Values, Keys or both in place
    with draw `draw` of (`seed`, `example`, `layer`)."""
    def modify(cache_layer):
        if target in ("values", "both"):
            cache_layer.values = perturb(cache_layer.values, sigma, noise_seed(seed, example, layer, draw, VALUES),
                                         sign)
        if target in ("keys", "both"):
            cache_layer.keys = perturb(cache_layer.keys, sigma, noise_seed(seed, example, layer, draw, KEYS), sign)
    return modify
