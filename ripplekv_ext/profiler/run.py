"""A profiling run: every calibration example through an estimator, with resume and progress.

Sensitivity `s_l` = mean KL(P_ref || P_l) over continuation positions, noise draws and examples, where P_l is the
continuation's next-token distribution once layer `l`'s prefix Values are perturbed (docs/design.md §4). Results are
saved after every example to a partial file, which an interrupted run with the same settings resumes from.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from typing import Callable, Sequence

import numpy as np
import torch

from ripplekv_ext.checks import check_int
from ripplekv_ext.model_info import compressible_layers as model_compressible_layers
from ripplekv_ext.model_info import sliding_window, text_config
from ripplekv_ext.budgets.profile_file import TARGETS, Profile, describe_model, save_profile
from ripplekv_ext.profiler.cost import tokens_processed
from ripplekv_ext.profiler.fisher import fisher_example
from ripplekv_ext.profiler.partial import load_partial, partial_path, save_partial
from ripplekv_ext.profiler.perturbation import perturbation_example
from ripplekv_ext.profiler.stats import split_half_spearman, standard_errors

METRIC = "kl(p_ref || p_perturbed), natural log, mean over continuation positions"
ESTIMATORS = ("perturbation", "fisher")

# What `ripplekv profile` does without options, and with --fast (docs/profiling.md has the measurements behind the
# fast settings; an option given explicitly overrides either).
PLAIN_SETTINGS = {"estimator": "perturbation", "prefix_len": 1024, "cont_len": 64, "num_examples": 8,
                  "until_stable": False, "max_examples": 64}
FAST_SETTINGS = {"estimator": "fisher", "prefix_len": 256, "cont_len": 64, "num_examples": 8,
                 "until_stable": True, "max_examples": 20}  # at most 20 * (256 + 3 * 64) = 8,960 tokens


def sliding_prefix_len(model, prefix_len: int) -> int:
    """``prefix_len``, or twice the model's sliding window where that is longer.

    A prefix the sliding-window layers hold whole measures a model that does not slide, unlike the prompts it
    compresses; twice the window is what gemma-3-270m's profiles were compared at (docs/profiling.md)."""
    window = sliding_window(model)
    return max(prefix_len, 2 * window) if window else prefix_len


def profile_example(model, ids: torch.Tensor, prefix_len: int, layers: Sequence[int], *, sigma: float, seed: int,
                    draws: int, target: str, example_index: int, reuse: bool = True,
                    progress: Callable[[], None] | None = None, antithetic: bool = False, batch_rows: int = 1,
                    estimator: str = "perturbation") -> tuple[list[float], bool]:
    """Per-layer mean KL for one example; also whether hidden states were reused.

    `estimator="perturbation"`: `perturbation_example` (with `antithetic` and `batch_rows`);
    `estimator="fisher"`: `fisher_example`, `draws` token samples per position (no reuse).
    """
    if estimator == "fisher":
        values = fisher_example(model, ids, prefix_len, layers, sigma=sigma, seed=seed, samples=draws,
                                target=target, example_index=example_index)
        if progress:
            for _ in layers:
                progress()
        return values, False
    return perturbation_example(model, ids, prefix_len, layers, sigma=sigma, seed=seed, draws=draws, target=target,
                                example_index=example_index, reuse=reuse, progress=progress,
                                antithetic=antithetic, batch_rows=batch_rows)


def _check_options(prefix_len, cont_len, num_examples, sigma, draws, target, until_stable, stability_threshold,
                   max_examples, estimator="perturbation", antithetic=False, batch_rows=1):
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if antithetic and estimator != "perturbation":
        raise ValueError("antithetic pairs are perturbation draws: pass antithetic=False with estimator='fisher'")
    for name, value, minimum in (("prefix_len", prefix_len, 1), ("cont_len", cont_len, 1),
                                 ("num_examples", num_examples, 1), ("draws", draws, 1),
                                 ("batch_rows", batch_rows, 1)):
        check_int(name, value, minimum)
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if until_stable:
        if not (-1.0 <= stability_threshold <= 1.0):
            raise ValueError(f"stability_threshold must be in [-1, 1], got {stability_threshold!r}")
        if max_examples < num_examples:
            raise ValueError(f"max_examples must be >= num_examples = {num_examples}, got {max_examples}")


def _checked_layers(model, layers, compressible) -> list[int]:
    num_layers = text_config(model).num_hidden_layers
    layers = list(compressible if layers is None else layers)
    if not layers:
        raise ValueError("no layers to profile: " + ("layers is empty; pass at least one layer index" if compressible
                         else "the model has no full-attention layers; pass layers=..."))
    bad = [l for l in layers if not (isinstance(l, int) and 0 <= l < num_layers)]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct indices in [0, {num_layers}), got {layers}")
    return sorted(layers)


def profile_model(model, *, examples: torch.Tensor, prefix_len: int = 1024, cont_len: int = 64,
                  num_examples: int = 8, sigma: float = 0.1, seed: int = 0, draws: int = 1,
                  layers: Sequence[int] | None = None, target: str = "values", reuse: bool = True,
                  until_stable: bool = False, stability_threshold: float = 0.9, max_examples: int = 64,
                  out_path=None, resume: bool = True, progress: bool = True, model_name: str | None = None,
                  source: str | None = None, estimator: str = "perturbation", antithetic: bool = False,
                  batch_rows: int = 1) -> Profile:
    """Measure the sensitivity profile of `model` and return it (and write it to `out_path` if given).

    Calibration input is `examples`, token ids `[n, P + T]` (`ripplekv_ext.eval.corpus.calibration_examples`
    cuts them from text); `source` names where they came from in the profile. `layers` defaults to the
    compressible (full-attention) layers. With `until_stable`, examples are added beyond `num_examples` until the
    split-half Spearman of the profile reaches `stability_threshold` or `max_examples` (or the rows of `examples`)
    run out.
    With `out_path`, progress is saved after every example to `<out_path>.partial.json` (atomically); an
    interrupted run with the same settings resumes from it.

    `estimator="fisher"` estimates every layer from one backward pass per example (`fisher_example`; `draws`
    is then the number of sampled tokens per position); `antithetic` adds each draw's negated noise;
    `batch_rows` runs that many perturbed continuations as one batch (same numbers, fewer calls).
    """
    from ripplekv_ext.integrations.transformers import input_device
    _check_options(prefix_len, cont_len, num_examples, sigma, draws, target, until_stable, stability_threshold,
                   max_examples, estimator, antithetic, batch_rows)
    compressible = model_compressible_layers(model)
    layers = _checked_layers(model, layers, compressible)
    if examples.dim() != 2 or examples.shape[1] != prefix_len + cont_len:
        raise ValueError(f"examples must be [n, prefix_len + cont_len = {prefix_len + cont_len}], "
                         f"got {list(examples.shape)}")
    if examples.shape[0] < num_examples:
        raise ValueError(f"examples must hold at least num_examples = {num_examples} rows, got {examples.shape[0]}")
    source = source or "token ids"
    cap = min(max_examples if until_stable else num_examples, examples.shape[0])

    info = describe_model(model, model_name)
    method = {"target": target, "sigma": float(sigma), "seed": int(seed), "draws": int(draws), "metric": METRIC}
    # Only non-default estimators are recorded, so a plain profile's file names only what every profile has.
    if estimator != "perturbation":
        method["estimator"] = estimator
    if antithetic:
        method["antithetic"] = True
    run_key = {"model": info, "method": method, "prefix_len": prefix_len, "cont_len": cont_len, "layers": layers,
               "source": source, "examples_sha": _ids_digest(examples[:cap])}

    per_example: list[list[float]] = []
    reused_flags: list[bool] = []
    seconds_before = 0.0
    partial = partial_path(out_path) if out_path else None
    if partial and resume and partial.is_file():
        per_example, reused_flags, seconds_before = load_partial(partial, run_key)

    start = time.perf_counter()
    bar = _progress_bar(progress, total=cap * len(layers), done=len(per_example) * len(layers))
    try:
        while len(per_example) < cap:
            e = len(per_example)
            if until_stable and e >= num_examples:
                rho = split_half_spearman(per_example)
                if rho is not None and rho >= stability_threshold:
                    break
            values, reused = profile_example(model, examples[e], prefix_len, layers, sigma=sigma, seed=seed,
                                             draws=draws, target=target, example_index=e, reuse=reuse,
                                             progress=bar.update if bar else None, **_variant_kwargs(
                                                 estimator, antithetic, batch_rows))
            per_example.append(values)
            reused_flags.append(reused)
            if partial:
                save_partial(partial, run_key, per_example, reused_flags,
                             seconds_before + time.perf_counter() - start)
    except KeyboardInterrupt:
        if partial:
            print(f"\ninterrupted: {len(per_example)} examples saved in {partial}; run again to resume",
                  file=sys.stderr)
        raise
    finally:
        if bar:
            bar.close()
    seconds = seconds_before + time.perf_counter() - start

    n = len(per_example)
    x = np.asarray(per_example, dtype=np.float64)
    profile = Profile(
        model=info, method=method,
        calibration={"source": source, "num_examples": n, "prefix_len": prefix_len, "cont_len": cont_len},
        layers=layers, sensitivity=x.mean(axis=0).tolist(), stderr=standard_errors(per_example),
        per_example=[list(map(float, row)) for row in per_example], compressible_layers=compressible,
        stability={"split_half_spearman": split_half_spearman(per_example), "until_stable": bool(until_stable),
                   "threshold": float(stability_threshold) if until_stable else None,
                   "max_examples": int(max_examples) if until_stable else None},
        cost={"seconds": float(seconds),
              "tokens_processed": tokens_processed(n, prefix_len, cont_len, layers, draws,
                                                   text_config(model).num_hidden_layers, reused_flags,
                                                   estimator=estimator, antithetic=antithetic),
              "device": str(input_device(model)),
              "reuse_hidden_states": bool(all(reused_flags))},
    )
    if out_path:
        save_profile(profile, out_path)
        partial.unlink(missing_ok=True)
    return profile


def _ids_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


def _variant_kwargs(estimator: str, antithetic: bool, batch_rows: int) -> dict:
    """profile_example's keyword arguments for a non-plain run (none for the plain one, so a caller that wraps
    profile_example with its plain arguments alone still fits)."""
    plain = {"estimator": "perturbation", "antithetic": False, "batch_rows": 1}
    given = {"estimator": estimator, "antithetic": antithetic, "batch_rows": batch_rows}
    return {name: value for name, value in given.items() if value != plain[name]}


def _progress_bar(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=done, desc="profiling (example x layer)", unit="run", dynamic_ncols=True)
