"""The perturbation estimator: each layer's KL measured by perturbing its prefix cache and running the
continuation, once per layer and noise draw."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

from ripplekv_ext.profiler.noise import perturber
from ripplekv_ext.profiler.runner import ContinuationRunner


def perturbation_example(model, ids: torch.Tensor, prefix_len: int, layers: Sequence[int], *, sigma: float,
                         seed: int, draws: int, target: str, example_index: int, reuse: bool = True,
                         progress: Callable[[], None] | None = None, antithetic: bool = False,
                         batch_rows: int = 1) -> tuple[list[float], bool]:
    """Per-layer mean KL for one example; also whether hidden states were reused.

    `antithetic`: every draw also runs its negated noise (the mean of the pair cancels the odd-order terms of
    the KL's expansion). `batch_rows`: perturbed runs done per batched continuation (1 = one at a time; the
    numbers are the same either way, to rounding). `progress` is called once per finished layer.
    """
    signs = (1.0, -1.0) if antithetic else (1.0,)
    with torch.inference_mode():
        runner = ContinuationRunner(model, ids, prefix_len, reuse=reuse)
        if runner.reuse and not runner.check_reuse(max(layers)):
            warnings.warn(f"{type(model).__name__}: replaying recorded layer outputs does not reproduce the "
                          "reference; falling back to full forward passes", RuntimeWarning)
            runner.reuse = False
        runs = [(layer, perturber(target, sigma, seed, example_index, layer, d, sign))
                for layer in layers for d in range(draws) for sign in signs]
        per_layer = draws * len(signs)
        kls = []
        for start in range(0, len(runs), batch_rows):
            chunk = runs[start:start + batch_rows]
            if batch_rows == 1:
                kls.append(runner.kl_from_ref(runner.run(*chunk[0])))
            else:
                kls.extend(runner.kl_rows(chunk).mean(-1).clamp_min(0.0).tolist())
            if progress:
                for _ in range(len(kls) // per_layer - (len(kls) - len(chunk)) // per_layer):
                    progress()
        return [sum(kls[i:i + per_layer]) / per_layer for i in range(0, len(kls), per_layer)], runner.reuse
