"""What a profile costs, counted in the profiler's unit: token-layers of work in whole-model tokens."""

from __future__ import annotations

# A backward pass costs about twice its forward pass (two matrix products per weight instead of one).
BACKWARD_COST = 2.0


def tokens_processed(n, prefix_len, cont_len, layers, draws, num_layers, reused_flags, *,
                     estimator="perturbation", antithetic=False) -> int:
    """Token-layer work of the first `n` examples in units of full-model tokens: prefix + reference + perturbed
    continuations. `reused_flags` says per example whether the layers below the perturbed one were replayed.

    Perturbation: per example P + T + draws * (2 if antithetic) * T * sum_l (L - l) / L with reuse (T * L_p
    without). Fisher: P + T + draws * BACKWARD_COST * T (one forward, one backward per sampled token set).
    """
    total = 0.0
    for reused in reused_flags[:n]:
        total += prefix_len + cont_len
        if estimator == "fisher":
            total += draws * BACKWARD_COST * cont_len
            continue
        for l in layers:
            frac = (num_layers - l) / num_layers if reused else 1.0
            total += draws * (2 if antithetic else 1) * cont_len * frac
    return int(round(total))
