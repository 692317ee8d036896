"""RippleKV sensitivity profiler (DESIGN.md §4).

For each calibration example (prefix of P tokens, continuation of T tokens) the prefix is run once; the
continuation is run teacher-forced against the clean cache (reference distributions), then once per
profiled layer `l` and noise draw against a cache whose layer-`l` prefix Values are perturbed:
`v' = v + sigma * ||v|| / sqrt(D) * eps`. Sensitivity `s_l` = mean KL(P_ref || P_l) over positions, draws
and examples.

Cost: layers before `l` never see the perturbation, so their outputs on the continuation are recorded
once in the reference pass and replayed; only layers `l..L-1` run. This is checked against a full forward
pass on the first example and falls back to full passes if the model's layers cannot be replayed.

Cheaper ways to the same ranking (docs/profiling.md has what each costs and buys): `batch_rows` runs many
perturbed continuations as one batch (each row enters at its own layer; same numbers); `antithetic` adds each
draw's negated noise; `estimator="fisher"` gets every layer from one backward pass (`fisher_example`). `--fast`
(FAST_SETTINGS) is the Fisher estimator on short examples, stopping by itself once the profile is stable.

    ripplekv profile --model smollm2 --prefix-len 1024 --cont-len 64 --examples 8 \
        --out bench/results/smollm2_profile.json
    ripplekv profile --model smollm2 --fast
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ripplekv_ext._jsonio import write_json_atomic
from ripplekv_ext.model_info import compressible_layers as model_compressible_layers
from ripplekv_ext.model_info import text_config
from ripplekv_ext.profile_file import TARGETS, Profile, ProfileError, describe_model, save_profile
from ripplekv_ext.stats import split_half_spearman, standard_errors

METRIC = "kl(p_ref || p_perturbed), natural log, mean over continuation positions"
PARTIAL_SUFFIX = ".partial.json"


# ---- running a continuation against a modified cache ----------------------------------------------

def decoder_layers(model):
    """The model's list of decoder layers, or None when it cannot be found."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "model.language_model.layers"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    return None


def input_device(model) -> torch.device:
    """Where the model's input ids go: its embedding's device, or, when accelerate offloads the embedding (its
    weight then sits on "meta"), the device the offload hook runs it on."""
    embedding = model.get_input_embeddings()
    hook = getattr(embedding, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    return embedding.weight.device


@contextlib.contextmanager
def _forwards_replaced(replacements: dict):
    """Layers run the given functions instead of their forward inside the block.

    An instance attribute shadows the class's forward. accelerate's offload hooks are themselves an instance
    `forward`, so the one in place is put back afterwards rather than deleted."""
    saved = {module: module.__dict__.get("forward") for module in replacements}
    for module, forward in replacements.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, forward in saved.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


class ContinuationRunner:
    """One example: the prefix cache, the reference continuation, and runs with one layer modified.

    `run(layer, modify)` restores a pristine copy of the prefix cache (so no run grows or alters it), lets
    `modify(cache_layer)` change layer `layer`'s entry, runs the continuation and returns log-probabilities
    `[T, V]` in float32. With `reuse=True` the layers before `layer` replay their recorded reference outputs.
    """

    def __init__(self, model, ids: torch.Tensor, prefix_len: int, reuse: bool = True):
        self.model = model
        device = input_device(model)
        ids = ids.to(device).view(1, -1)
        self.prefix_len = prefix_len
        self.prefix, self.cont = ids[:, :prefix_len], ids[:, prefix_len:]
        self.position_ids = torch.arange(prefix_len, ids.shape[1], device=device).unsqueeze(0)
        self.layers = decoder_layers(model) if reuse else None
        self.reuse = self.layers is not None
        out = model(input_ids=self.prefix, use_cache=True, logits_to_keep=1)
        cache = _output_cache(out)
        if cache is None or not hasattr(cache, "layers"):
            raise RuntimeError(f"{type(model).__name__} returned no transformers Cache with .layers; "
                               "the profiler needs the Cache API")
        self.cache = cache
        self._pristine = [copy.copy(layer) for layer in cache.layers]
        self.recorded: list = []
        self.ref_logprobs = self._forward(record=self.reuse)

    def _fresh_cache(self):
        self.cache.layers = [copy.copy(layer) for layer in self._pristine]
        return self.cache

    def _forward(self, record: bool = False, replay_below: int = 0):
        # Forward hooks on whole decoder layers, not the hook's attention registration (hook.registered_attention):
        # the profiler changes no attention computation (the perturbation is applied to the cache beforehand); it
        # records and replays each layer's *output* hidden states, which only a layer-level hook can see or replace.
        cache = self._fresh_cache()
        handles = []
        if record:
            self.recorded = [None] * len(self.layers)

            def make_hook(i):
                def hook(module, args, output):
                    self.recorded[i] = output
                return hook
            handles = [layer.register_forward_hook(make_hook(i)) for i, layer in enumerate(self.layers)]
        # Layers below `replay_below` return their recorded output.
        replay = {self.layers[i]: (lambda out: (lambda *a, **k: out))(self.recorded[i]) for i in range(replay_below)}
        try:
            with _forwards_replaced(replay):
                out = self.model(input_ids=self.cont, position_ids=self.position_ids, cache=cache, use_cache=True)
        finally:
            for h in handles:
                h.remove()
        if cache.get_seq_length() != self.prefix_len + self.cont.shape[1] and replay_below == 0:
            raise RuntimeError("the continuation did not extend the cache as expected")
        logits = out.logits[0]
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def run(self, layer: int, modify: Callable | None = None, reuse: bool | None = None) -> torch.Tensor:
        reuse = self.reuse if reuse is None else (reuse and self.reuse)
        if modify is None:
            return self._forward(replay_below=layer if reuse else 0)
        pristine = self._pristine[layer]
        self._pristine[layer] = copy.copy(pristine)
        try:
            modify(self._pristine[layer])
            return self._forward(replay_below=layer if reuse else 0)
        finally:
            self._pristine[layer] = pristine

    def kl_per_position(self, logprobs: torch.Tensor) -> torch.Tensor:
        """KL(P_ref || P) at each continuation position: `[..., T, V] -> [..., T]` (any leading batch dims)."""
        ref = self.ref_logprobs
        return (ref.exp() * (ref - logprobs)).sum(-1)

    def kl_from_ref(self, logprobs: torch.Tensor) -> float:
        """KL(P_ref || P) per position, averaged over the continuation."""
        # A KL is >= 0; rounding can leave a layer that barely moves the output a hair below (profiles must not
        # hold negative sensitivities).
        return max(0.0, float(self.kl_per_position(logprobs).mean()))

    def kl_rows(self, rows: Sequence[tuple[int, Callable]]) -> torch.Tensor:
        """Per-position KLs `[len(rows), T]` of several perturbed runs done as ONE batched continuation.

        Row `r = (layer, modify)` sees the prefix cache with `modify` applied to `layer` only, exactly as
        `run(layer, modify)` would. With reuse, rows are sorted by layer and layer `i` runs only on the rows
        perturbed at or below `i` (a prefix of the sorted batch); the other rows still hold the reference, so
        they take the recorded output. That is the same token-layer work as one run per row, in fewer calls.
        """
        order = sorted(range(len(rows)), key=lambda r: rows[r][0])
        row_layers = [rows[r][0] for r in order]
        batch = len(rows)
        cache = self._fresh_cache()
        active = [sum(l <= i for l in row_layers) if self.reuse else batch for i in range(len(cache.layers))]
        for i, cache_layer in enumerate(cache.layers):
            if active[i] == 0:
                continue  # no row runs this layer: its pristine entry is never read
            parts = []
            for r in order[:active[i]]:
                layer, modify = rows[r]
                entry = copy.copy(self._pristine[i])
                if layer == i:
                    modify(entry)
                parts.append(entry)
            cache_layer.keys = torch.cat([p.keys for p in parts])
            cache_layer.values = torch.cat([p.values for p in parts])
        replay = {}
        if self.reuse:
            replay = {module: _rows_replaying(module.forward, self.recorded[i], active[i], batch)
                      for i, module in enumerate(self.layers) if active[i] < batch}
        with _forwards_replaced(replay):
            out = self.model(input_ids=self.cont.expand(batch, -1), position_ids=self.position_ids, cache=cache,
                             use_cache=True)
        logits = out.logits
        kls = self.kl_per_position(torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                                     dim=-1))
        result = torch.empty_like(kls)
        result[torch.tensor(order)] = kls
        return result

    def check_reuse(self, layer: int, rtol: float = 1e-4) -> bool:
        """Does replaying layers < `layer` reproduce the reference? (It must, bit for bit in principle.)"""
        if not self.reuse or layer == 0:
            return True
        replayed = self.run(layer, None, reuse=True)
        diff = float((replayed - self.ref_logprobs).abs().max())
        return diff <= rtol * max(1.0, float(self.ref_logprobs.abs().max()))


def _rows_replaying(forward, recorded: torch.Tensor, active: int, batch: int):
    """A decoder layer's forward for a batch whose first `active` rows run it and the rest replay `recorded`."""
    def take(x):
        # Per-row inputs (hidden states, a per-row mask) are cut to the active rows; broadcast ones (batch 1) stay.
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch and batch > 1:
            return x[:active]
        if isinstance(x, tuple):
            return tuple(take(y) for y in x)
        return x

    def replaying_forward(hidden_states, *args, **kwargs):
        rest = recorded.expand(batch - active, *recorded.shape[1:])
        if active == 0:
            return rest
        out = forward(take(hidden_states), *[take(a) for a in args], **{k: take(v) for k, v in kwargs.items()})
        return torch.cat([out, rest])
    return replaying_forward


# ---- perturbation ----------------------------------------------------------------------------------

def _noise_seed(seed: int, example: int, layer: int, draw: int, which: int) -> int:
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


def _perturber(target: str, sigma: float, seed: int, example: int, layer: int, draw: int, sign: float = 1.0):
    def modify(cache_layer):
        if target in ("values", "both"):
            cache_layer.values = perturb(cache_layer.values, sigma, _noise_seed(seed, example, layer, draw, 1), sign)
        if target in ("keys", "both"):
            cache_layer.keys = perturb(cache_layer.keys, sigma, _noise_seed(seed, example, layer, draw, 0), sign)
    return modify


ESTIMATORS = ("perturbation", "fisher")


def profile_example(model, ids: torch.Tensor, prefix_len: int, layers: Sequence[int], *, sigma: float, seed: int,
                    draws: int, target: str, example_index: int, reuse: bool = True,
                    progress: Callable[[], None] | None = None, antithetic: bool = False, batch_rows: int = 1,
                    estimator: str = "perturbation") -> tuple[list[float], bool]:
    """Per-layer mean KL for one example; also whether hidden states were reused.

    `antithetic`: every draw also runs its negated noise (the mean of the pair cancels the odd-order terms of
    the KL's expansion). `batch_rows`: perturbed runs done per batched continuation (1 = one at a time; the
    numbers are the same either way, to rounding). `estimator="fisher"`: see `fisher_example` (no reuse).
    """
    if estimator == "fisher":
        values = fisher_example(model, ids, prefix_len, layers, sigma=sigma, seed=seed, samples=draws,
                                target=target, example_index=example_index)
        if progress:
            for _ in layers:
                progress()
        return values, False
    signs = (1.0, -1.0) if antithetic else (1.0,)
    with torch.inference_mode():
        runner = ContinuationRunner(model, ids, prefix_len, reuse=reuse)
        if runner.reuse and not runner.check_reuse(max(layers)):
            warnings.warn(f"{type(model).__name__}: replaying recorded layer outputs does not reproduce the "
                          "reference; falling back to full forward passes", RuntimeWarning)
            runner.reuse = False
        runs = [(layer, _perturber(target, sigma, seed, example_index, layer, d, sign))
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
    device = input_device(model)
    ids = ids.to(device).view(1, -1)
    prefix, cont = ids[:, :prefix_len], ids[:, prefix_len:]
    with torch.no_grad():
        cache = _output_cache(model(input_ids=prefix, use_cache=True, logits_to_keep=1))
    kinds = [k for k in ("values", "keys") if target in (k, "both")]
    leaves, scales = [], []
    for layer in layers:
        for kind in kinds:
            x = getattr(cache.layers[layer], kind).detach().clone().requires_grad_(True)
            setattr(cache.layers[layer], kind, x)
            leaves.append(x)
            xf = x.detach().to(torch.promote_types(x.dtype, torch.float32))
            scales.append(sigma ** 2 * xf.pow(2).sum(-1) / x.shape[-1])  # s^2 per cached vector
    position_ids = torch.arange(prefix_len, ids.shape[1], device=device).unsqueeze(0)
    generator = torch.Generator().manual_seed(_noise_seed(seed, example_index, 0, 0, 2))
    with torch.enable_grad():
        logits = model(input_ids=cont, position_ids=position_ids, cache=cache, use_cache=True).logits[0]
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        totals = torch.zeros(len(leaves), dtype=torch.float64)
        for s in range(samples):
            y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=generator).to(device)
            grads = torch.autograd.grad(logp.gather(-1, y).sum(), leaves, retain_graph=s + 1 < samples)
            for i, (g, scale) in enumerate(zip(grads, scales)):
                totals[i] += float((scale * g.float().pow(2).sum(-1)).sum())
    per_leaf = (0.5 * totals / (samples * cont.shape[1])).tolist()
    return [sum(per_leaf[i:i + len(kinds)]) for i in range(0, len(per_leaf), len(kinds))]


# ---- the profiling run -----------------------------------------------------------------------------

# What `ripplekv profile` does without options, and with --fast (docs/profiling.md has the measurements behind the
# fast settings; an option given explicitly overrides either).
PLAIN_SETTINGS = {"estimator": "perturbation", "prefix_len": 1024, "cont_len": 64, "num_examples": 8,
                  "until_stable": False, "max_examples": 64}
FAST_SETTINGS = {"estimator": "fisher", "prefix_len": 256, "cont_len": 64, "num_examples": 8,
                 "until_stable": True, "max_examples": 20}  # at most 20 * (256 + 3 * 64) = 8,960 tokens

def _check_options(prefix_len, cont_len, num_examples, sigma, draws, target, until_stable, stability_threshold,
                   max_examples, estimator="perturbation", antithetic=False, batch_rows=1):
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if antithetic and estimator != "perturbation":
        raise ValueError("antithetic pairs are perturbation draws: pass antithetic=False with estimator='fisher'")
    for name, value, minimum in (("prefix_len", prefix_len, 1), ("cont_len", cont_len, 1),
                                 ("num_examples", num_examples, 1), ("draws", draws, 1),
                                 ("batch_rows", batch_rows, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if until_stable:
        if not (-1.0 <= stability_threshold <= 1.0):
            raise ValueError(f"stability_threshold must be in [-1, 1], got {stability_threshold!r}")
        if max_examples < num_examples:
            raise ValueError(f"max_examples must be >= num_examples = {num_examples}, got {max_examples}")


def profile_model(model, tokenizer=None, texts=None, *, examples: torch.Tensor | None = None,
                  prefix_len: int = 1024, cont_len: int = 64, num_examples: int = 8, sigma: float = 0.1,
                  seed: int = 0, draws: int = 1, layers: Sequence[int] | None = None, target: str = "values",
                  reuse: bool = True, until_stable: bool = False, stability_threshold: float = 0.9,
                  max_examples: int = 64, out_path=None, resume: bool = True, progress: bool = True,
                  model_name: str | None = None, source: str | None = None, estimator: str = "perturbation",
                  antithetic: bool = False, batch_rows: int = 1) -> Profile:
    """Measure the sensitivity profile of `model` and return it (and write it to `out_path` if given).

    Calibration input is `examples` (token ids `[n, P + T]`) or `texts` (None = bundled KJV calibration
    split, a file path, or a list of strings) cut into examples with `tokenizer`. `layers` defaults to the
    compressible (full-attention) layers. With `until_stable`, examples are added beyond `num_examples`
    until the split-half Spearman of the profile reaches `stability_threshold` or `max_examples` is hit.
    With `out_path`, progress is saved after every example to `<out_path>.partial.json` (atomically); an
    interrupted run with the same settings resumes from it.

    `estimator="fisher"` estimates every layer from one backward pass per example (`fisher_example`; `draws`
    is then the number of sampled tokens per position); `antithetic` adds each draw's negated noise;
    `batch_rows` runs that many perturbed continuations as one batch (same numbers, fewer calls).
    """
    _check_options(prefix_len, cont_len, num_examples, sigma, draws, target, until_stable, stability_threshold,
                   max_examples, estimator, antithetic, batch_rows)
    num_layers = text_config(model).num_hidden_layers
    compressible = model_compressible_layers(model)
    layers = list(compressible if layers is None else layers)
    if not layers:
        raise ValueError("no layers to profile: " + ("layers is empty; pass at least one layer index" if compressible
                         else "the model has no full-attention layers; pass layers=..."))
    bad = [l for l in layers if not (isinstance(l, int) and 0 <= l < num_layers)]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct indices in [0, {num_layers}), got {layers}")
    layers = sorted(layers)

    cap = max_examples if until_stable else num_examples
    if examples is None:
        if tokenizer is None:
            raise ValueError("tokenizer is required to cut texts into examples (or pass examples=token ids)")
        # Text sources (the bundled KJV corpus, files) are evaluation-side data: imported only when text is given,
        # so the core library does not load the evaluation package (callers with token ids never need it).
        from ripplekv_ext.eval.corpus import load_texts

        docs, source_desc = load_texts(texts)
        examples = _cut_available(tokenizer, docs, prefix_len, cont_len, num_examples, cap)
    else:
        source_desc = "token ids"
        if examples.dim() != 2 or examples.shape[1] != prefix_len + cont_len:
            raise ValueError(f"examples must be [n, prefix_len + cont_len = {prefix_len + cont_len}], "
                             f"got {list(examples.shape)}")
        if examples.shape[0] < num_examples:
            raise ValueError(f"examples must hold at least num_examples = {num_examples} rows, "
                             f"got {examples.shape[0]}")
    source_desc = source or source_desc
    cap = min(cap, examples.shape[0])

    info = describe_model(model, model_name)
    method = {"target": target, "sigma": float(sigma), "seed": int(seed), "draws": int(draws), "metric": METRIC}
    # Only non-default estimators are recorded, so profiles (and partial files) of the plain method stay as before.
    if estimator != "perturbation":
        method["estimator"] = estimator
    if antithetic:
        method["antithetic"] = True
    run_key = {"model": info, "method": method, "prefix_len": prefix_len, "cont_len": cont_len, "layers": layers,
               "source": source_desc, "examples_sha": _ids_digest(examples[:cap])}

    per_example: list[list[float]] = []
    reused_flags: list[bool] = []
    seconds_before = 0.0
    partial = Path(str(out_path) + PARTIAL_SUFFIX) if out_path else None
    if partial and resume and partial.is_file():
        per_example, reused_flags, seconds_before = _load_partial(partial, run_key)

    device = input_device(model)
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
                write_json_atomic(partial, {"run_key": run_key, "per_example": per_example, "reused": reused_flags,
                                            "seconds": seconds_before + time.perf_counter() - start})
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
        calibration={"source": source_desc, "num_examples": n, "prefix_len": prefix_len, "cont_len": cont_len},
        layers=layers, sensitivity=x.mean(axis=0).tolist(), stderr=standard_errors(per_example),
        per_example=[list(map(float, row)) for row in per_example], compressible_layers=compressible,
        stability={"split_half_spearman": split_half_spearman(per_example), "until_stable": bool(until_stable),
                   "threshold": float(stability_threshold) if until_stable else None,
                   "max_examples": int(max_examples) if until_stable else None},
        cost={"seconds": float(seconds),
              "tokens_processed": _tokens_processed(n, prefix_len, cont_len, layers, draws, num_layers, reused_flags,
                                                    estimator=estimator, antithetic=antithetic),
              "device": str(device), "reuse_hidden_states": bool(all(reused_flags))},
    )
    if out_path:
        save_profile(profile, out_path)
        partial.unlink(missing_ok=True)
    return profile


def _cut_available(tokenizer, docs, prefix_len, cont_len, num_examples, cap):
    """As many examples as the text holds, up to `cap` (at least `num_examples`)."""
    from ripplekv_ext.eval.corpus import token_examples

    try:
        return token_examples(tokenizer, docs, prefix_len, cont_len, cap)
    except ValueError:
        if cap == num_examples:
            raise
        lo, hi = num_examples, cap
        best = token_examples(tokenizer, docs, prefix_len, cont_len, num_examples)
        while lo < hi:  # the largest count that fits
            mid = (lo + hi + 1) // 2
            try:
                best = token_examples(tokenizer, docs, prefix_len, cont_len, mid)
                lo = mid
            except ValueError:
                hi = mid - 1
        return best


def _ids_digest(ids: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()


def _variant_kwargs(estimator: str, antithetic: bool, batch_rows: int) -> dict:
    """profile_example's keyword arguments for a non-plain run (none for the plain one, so a caller that wraps
    profile_example with the original signature keeps working)."""
    plain = {"estimator": "perturbation", "antithetic": False, "batch_rows": 1}
    given = {"estimator": estimator, "antithetic": antithetic, "batch_rows": batch_rows}
    return {name: value for name, value in given.items() if value != plain[name]}


# A backward pass costs about twice its forward pass (two matrix products per weight instead of one).
BACKWARD_COST = 2.0


def _tokens_processed(n, prefix_len, cont_len, layers, draws, num_layers, reused_flags, *,
                      estimator="perturbation", antithetic=False):
    """Token-layer work in units of full-model tokens: prefix + reference + perturbed continuations.

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


# How to start over, in both spellings: the CLI's flag and profile_model's argument.
_START_OVER = "delete it or pass --no-resume (resume=False) to start over"


def _load_partial(path: Path, run_key: dict):
    """(per-example KLs, reuse flags, seconds) saved by an interrupted run with the same settings.

    Everything in the file is checked before it is trusted: a file edited or damaged by hand would otherwise
    resume, and fail only when the finished profile is saved (or worse, be averaged into it).
    """
    import json

    def refuse(problem: str):
        raise ProfileError(f"partial profile {path} {problem}; {_START_OVER}")

    try:
        # NaN / Infinity are not JSON (Python would accept them): a KL is a finite number.
        data = json.loads(path.read_text(encoding="utf-8"),
                          parse_constant=lambda c: refuse(f"holds {c}, not a finite number"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        refuse(f"is unreadable ({e})")
    if not isinstance(data, dict):
        refuse("is not a JSON object")
    if data.get("run_key") != json.loads(json.dumps(run_key)):
        refuse("was made with other settings or another model")
    per_example, reused, seconds = data.get("per_example"), data.get("reused"), data.get("seconds", 0.0)
    n_layers = len(run_key["layers"])
    if not isinstance(per_example, list) or not all(
            isinstance(row, list) and len(row) == n_layers and
            all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in row)
            for row in per_example):
        refuse(f"per_example must be rows of {n_layers} finite KLs >= 0")
    if not isinstance(reused, list) or len(reused) != len(per_example) or \
            not all(isinstance(r, bool) for r in reused):
        refuse("reused must hold one true/false per example")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        refuse("seconds must be a finite number >= 0")
    return per_example, reused, float(seconds)


def _progress_bar(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=done, desc="profiling (example x layer)", unit="run", dynamic_ncols=True)


def format_profile(profile: Profile) -> str:
    lines = [f"profile of {profile.model['name']} ({profile.calibration['num_examples']} examples, "
             f"P={profile.calibration['prefix_len']}, T={profile.calibration['cont_len']}, "
             f"target={profile.method['target']}, sigma={profile.method['sigma']})",
             f"{'layer':>5}  {'sensitivity':>12}  {'stderr':>10}"]
    for l, s, se in zip(profile.layers, profile.sensitivity, profile.stderr):
        lines.append(f"{l:>5}  {s:12.6g}  {se:10.3g}")
    rho = profile.stability["split_half_spearman"]
    lines.append(f"split-half Spearman: {'n/a' if rho is None else f'{rho:.3f}'}; "
                 f"wall time {profile.cost['seconds']:.1f} s on {profile.cost['device']}; "
                 f"reuse of hidden states: {profile.cost['reuse_hidden_states']}")
    return "\n".join(lines)

