"""The Fisher estimator: every layer's expected KL under the profiler's noise from one backward pass."""

from __future__ import annotations

from typing import Sequence

import torch

from ripplekv_ext.profiler.noise import FISHER_SAMPLES, noise_seed
from ripplekv_ext.profiler.runner import log_probs


def fisher_example(model, ids: torch.Tensor, prefix_len: int, layers: Sequence[int], *, sigma: float, seed: int,
                   samples: int, target: str, example_index: int) -> list[float]:
    """Every layer's expected KL under the profiler's noise from one backward pass (the Fisher estimate).

    For small sigma, KL(P_ref || P_delta) = 1/2 delta^T F delta + O(sigma^3), F the Fisher information of the
    continuation's next-token distributions with respect to the prefix cache. Averaged over the noise
    delta = s * eps (s = sigma * ||v|| / sqrt(D) per cached vector) that is 1/2 sum_rows s^2 * E_y ||d log p(y) /
    d v_row||^2 with y drawn from P_ref. One y per position is drawn; the gradient of sum_t log p_t(y_t) gives
    that for every layer at once (cross-position terms have expectation zero: each position's score has mean
    zero and the draws are independent). `samples` draws average several such backward passes.
    """
    from ripplekv_ext.integrations.transformers import cache_argument, input_device, layer_at, output_cache
    device = input_device(model)
    ids = ids.to(device).view(1, -1)
    prefix, cont = ids[:, :prefix_len], ids[:, prefix_len:]
    with torch.no_grad():
        cache = output_cache(model(input_ids=prefix, use_cache=True, logits_to_keep=1))
    kinds = [k for k in ("values", "keys") if target in (k, "both")]
    leaves, scales = [], []
    for layer in layers:
        for kind in kinds:
            entry = layer_at(cache, layer)
            x = getattr(entry, kind).detach().clone().requires_grad_(True)
            setattr(entry, kind, x)
            leaves.append(x)
            xf = x.detach().to(torch.promote_types(x.dtype, torch.float32))
            scales.append(sigma ** 2 * xf.pow(2).sum(-1) / x.shape[-1])  # s^2 per cached vector
    position_ids = torch.arange(prefix_len, ids.shape[1], device=device).unsqueeze(0)
    generator = torch.Generator().manual_seed(noise_seed(seed, example_index, 0, 0, FISHER_SAMPLES))
    with torch.enable_grad():
        logits = model(input_ids=cont, position_ids=position_ids, use_cache=True,
                       **{cache_argument(): cache}).logits[0]
        logp = log_probs(logits)
        totals = torch.zeros(len(leaves), dtype=torch.float64)
        for s in range(samples):
            y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=generator).to(device)
            grads = torch.autograd.grad(logp.gather(-1, y).sum(), leaves, retain_graph=s + 1 < samples)
            for i, (g, scale) in enumerate(zip(grads, scales)):
                totals[i] += float((scale * g.float().pow(2).sum(-1)).sum())
    per_leaf = (0.5 * totals / (samples * cont.shape[1])).tolist()
    return [sum(per_leaf[i:i + len(kinds)]) for i in range(0, len(per_leaf), len(kinds))]
