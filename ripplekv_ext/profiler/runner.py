"""Running one example's continuation against a modified prefix cache.

The prefix is run once; the continuation is run teacher-forced against the clean cache (the reference
distributions), then once per modification. Layers before the modified one never see the change, so their
outputs on the continuation are recorded once in the reference pass and replayed; only the layers from the
modified one on run.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch



def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocabulary in float32 or wider (half-precision logits lose the small KLs)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


class ContinuationRunner:
    """One example: the prefix cache, the reference continuation, and runs with one layer modified.

    `run(layer, modify)` restores a pristine copy of the prefix cache (so no run grows or alters it), lets
    `modify(cache_layer)` change layer `layer`'s entry, runs the continuation and returns log-probabilities
    `[T, V]` in float32. With `reuse=True` the layers before `layer` replay their recorded reference outputs.
    """

    def __init__(self, model, ids: torch.Tensor, prefix_len: int, reuse: bool = True):
        from ripplekv_ext.integrations.transformers import decoder_layers, input_device, output_cache
        self.model = model
        device = input_device(model)
        ids = ids.to(device).view(1, -1)
        self.prefix_len = prefix_len
        self.prefix, self.cont = ids[:, :prefix_len], ids[:, prefix_len:]
        self.position_ids = torch.arange(prefix_len, ids.shape[1], device=device).unsqueeze(0)
        self.layers = decoder_layers(model) if reuse else None
        self.reuse = self.layers is not None
        out = model(input_ids=self.prefix, use_cache=True, logits_to_keep=1)
        cache = output_cache(out)
        if cache is None or not hasattr(cache, "layers"):
            raise RuntimeError(f"{type(model).__name__} returned no transformers Cache with .layers; "
                               "the profiler needs the Cache API")
        self.cache = cache
        self._pristine = [copy.copy(layer) for layer in cache.layers]
        self.recorded: list = []
        self.ref_logprobs = self._forward(record=self.reuse)

    @property
    def prefix_layers(self) -> tuple:
        """The prefix cache's per-layer entries every run starts from (read them; change one through `run`)."""
        return tuple(self._pristine)

    def _fresh_cache(self):
        self.cache.layers = [copy.copy(layer) for layer in self._pristine]
        return self.cache

    def _forward(self, record: bool = False, replay_below: int = 0):
        # Forward hooks on whole decoder layers, not an attention registration (as compress blocks use):
        # the profiler changes no attention computation (the perturbation is applied to the cache beforehand); it
        # records and replays each layer's *output* hidden states, which only a layer-level hook can see or replace.
        from ripplekv_ext.integrations.transformers import cache_argument, forwards_replaced
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
            with forwards_replaced(replay):
                out = self.model(input_ids=self.cont, position_ids=self.position_ids, use_cache=True,
                                 **{cache_argument(): cache})
        finally:
            for h in handles:
                h.remove()
        if cache.get_seq_length() != self.prefix_len + self.cont.shape[1] and replay_below == 0:
            raise RuntimeError("the continuation did not extend the cache as expected")
        return log_probs(out.logits[0])

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
        from ripplekv_ext.integrations.transformers import cache_argument, forwards_replaced
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
        with forwards_replaced(replay):
            out = self.model(input_ids=self.cont.expand(batch, -1), position_ids=self.position_ids, use_cache=True,
                             **{cache_argument(): cache})
        kls = self.kl_per_position(log_probs(out.logits))
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
