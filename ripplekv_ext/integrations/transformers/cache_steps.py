"""The steps on a transformers cache: the only code that puts a ``CompressedLayer`` into a cache.

``compress_layer`` is what a ``compress`` block runs at the end of a layer's prefill; ``reselect_layer`` its twin
during decoding (``Policy.decode_every``); ``compressed_cache`` rebuilds a prefill's cache from captured
``CompressionStep``s under another compressor (the fidelity harness runs many policies from one prefill);
``probe_cache`` and ``drop_probe`` let a prefill end with tokens that are dropped afterwards (``compress_context``'s
probe).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from ripplekv_ext.selection.compressor import KVCompressor
from ripplekv_ext.integrations.transformers.compressed_layer import CompressedLayer
from ripplekv_ext.model_info import text_config

__all__ = ["cache_classes", "cache_device", "compress_layer", "compressed_cache", "drop_probe", "is_prefill",
           "layer_at", "new_cache", "probe_cache", "reselect_layer"]


def cache_classes() -> list:
    """The classes a compressed context's cache is made of (what ``torch.load(weights_only=True)`` must allow)."""
    return [DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, CompressedLayer]


def new_cache(model) -> DynamicCache:
    """The cache ``model`` would create for itself in a forward given none."""
    return DynamicCache(config=text_config(model))


def probe_cache(model, probe_tokens: int) -> DynamicCache:
    """A cache for a prefill that ends with ``probe_tokens`` tokens (a probe) ``drop_probe`` removes afterwards.

    A sliding-window layer keeps only its last window, so the probe's tokens would push out context tokens it
    could not give back: here each sliding-window layer's window is longer by the probe, so it still holds them
    after the probe. What such a layer attends to in the prefill is unchanged: the model builds its sliding mask
    from its config.
    """
    cache = new_cache(model)
    for layer_idx, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[layer_idx] = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window + probe_tokens)
    return cache


def drop_probe(cache, probe_tokens: int) -> None:
    """Remove the last ``probe_tokens`` of every layer of a ``probe_cache`` after its prefill, leaving what a
    prefill of the context alone leaves: each longer-windowed layer becomes a sliding-window layer of the model's
    window, fed the context's tokens it holds (it keeps its last window, as it would have)."""
    if probe_tokens < 1:
        raise ValueError(f"probe_tokens must be at least 1, got {probe_tokens}")
    for layer_idx, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            restored = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window - probe_tokens)
            restored.update(layer.keys[:, :, :-probe_tokens], layer.values[:, :, :-probe_tokens])
            restored.cumulative_length = layer.cumulative_length - probe_tokens  # every context token it has seen
            cache.layers[layer_idx] = restored
        else:
            layer.crop(-probe_tokens)
            if isinstance(layer, CompressedLayer) and layer.prompt_lengths is not None:
                # Selections during decoding count the context as the prompt: the probe is gone from it.
                layer.prompt_tokens -= probe_tokens
                layer.prompt_lengths = layer.prompt_lengths - probe_tokens


def layer_at(cache, layer_idx: Optional[int]):
    """Layer ``layer_idx`` of ``cache`` (None when there is no such layer, or no cache)."""
    layers = getattr(cache, "layers", ())
    if layer_idx is None or not 0 <= layer_idx < len(layers):
        return None
    return layers[layer_idx]


def cache_device(cache) -> Optional[torch.device]:
    """The device of the keys ``cache`` holds (None before any layer holds any)."""
    keys = getattr(layer_at(cache, 0), "keys", None)
    return None if keys is None else keys.device


def is_prefill(layer, query: Tensor, key: Tensor) -> bool:
    """Whether an attention call with ``query`` over ``key`` is a prefill of the uncompressed ``layer``: the layer
    held nothing before it (its keys are exactly this call's, as many as the queries)."""
    return type(layer) is DynamicLayer and layer.keys is key and key.shape[2] == query.shape[2]


def compress_layer(cache, layer_idx: int, queries: Tensor, keys: Tensor, values: Tensor,
                   compressor: KVCompressor, lengths: Optional[Tensor] = None,
                   scale: Optional[float] = None, budgets: Optional[list[int]] = None,
                   rolling: bool = False) -> list[int]:
    """Compress layer ``layer_idx`` of ``cache`` at the end of its prefill and replace it by a ``CompressedLayer``.

    ``queries`` are what the policy's selector reads (the last ``W`` post-RoPE queries, or all of them); ``lengths``
    (int64 ``[B]``) the real tokens of each row of a left-padded batch (None: no padding); ``budgets`` one per row
    (default: the policy's for each row's length). The full tensors are released (memory is really freed, not
    masked). With ``decode_every``, or for the first chunk of a prompt read in chunks (``bounded_prefill``), the layer
    keeps the newest ``W`` queries and each row's prompt length for later selections. Returns the tokens each row kept.
    """
    n = keys.shape[2]
    policy = compressor.policy
    if lengths is None and (budgets is None or len(set(budgets)) == 1):
        # A head-wise selector (AdaKV) comes back with a per-head key mask; every other one with None.
        kept_keys, kept_values, key_mask = compressor.compress_heads(layer_idx, queries, keys, values, scale=scale,
                                                                     budget=None if budgets is None else budgets[0])
        row_kept = [kept_keys.shape[2]] * keys.shape[0]
    else:
        # A prefill's mask covers exactly its n tokens (the layer was empty before it).
        lengths = [n] * keys.shape[0] if lengths is None else lengths
        kept_keys, kept_values, key_mask = compressor.compress_rows(layer_idx, queries, keys, values, lengths,
                                                                    scale=scale, budgets=budgets)
        row_kept = key_mask.sum(dim=1).tolist()
        if bool(key_mask.all()):  # no padding slot left: the plain causal path
            key_mask = None
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
    compressed = CompressedLayer(kept_keys, kept_values, seen_tokens=n, key_mask=key_mask)
    if policy.decode_every is not None or rolling:
        compressed.remember_queries(queries, policy.window)
        compressed.prompt_lengths = (torch.full((keys.shape[0],), n, dtype=torch.int64) if lengths is None
                                     else lengths.cpu())
    cache.layers[layer_idx] = compressed
    return row_kept


def reselect_layer(layer: CompressedLayer, layer_idx: int, compressor: KVCompressor,
                   scale: Optional[float] = None, budgets: Optional[list[int]] = None) -> None:
    """Select a compressed layer down to ``budgets`` (one per row; default: its decode budgets) again, its newest
    window kept, with its remembered newest queries as the window."""
    if budgets is None:
        budgets = [compressor.plan.decode(seen, prompt)[layer_idx]
                   for seen, prompt in zip(layer.seen_per_row(), layer.prompt_lengths.tolist())]
    queries, keys, values = layer.recent_queries, layer.keys, layer.values
    if layer.key_mask is None and len(set(budgets)) == 1:
        kept_keys, kept_values = compressor.compress(layer_idx, queries, keys, values, scale=scale,
                                                     budget=budgets[0])
        key_mask = None
    else:
        # A compressed layer stays left-padded: each row's real slots are its last ones.
        kept_keys, kept_values, key_mask = compressor.compress_rows(layer_idx, queries, keys, values,
                                                                    layer.held_per_row(), scale=scale,
                                                                    budgets=budgets)
        if bool(key_mask.all()):
            key_mask = None
    layer.keep(kept_keys, kept_values, key_mask)


def compressed_cache(cache, steps: dict, compressor: Optional[KVCompressor] = None):
    """A copy of a prefill's ``cache`` whose layers in ``steps`` (layer -> the ``CompressionStep`` captured during
    that prefill) are compressed again by ``compressor`` from the step's full keys, values and window queries:
    what ``compress(model, compressor.policy)`` would have left. ``compressor`` None keeps those layers whole.

    The other layers (sliding windows no policy manages) are deep-copied, since continuing appends to them; the
    captured cache itself is left as it was, so it can serve the next policy.
    """
    out = copy.copy(cache)
    out.layers = [layer if i in steps else copy.deepcopy(layer) for i, layer in enumerate(cache.layers)]
    budgets = None
    if compressor is not None and compressor.policy.reads_attention and steps:
        budgets = compressor.plan.from_attention({layer: (step.queries, step.keys, step.scale)
                                                for layer, step in steps.items()},
                                               next(iter(steps.values())).n_tokens)
    for layer_idx, step in steps.items():
        keys, values, key_mask = step.keys, step.values, None
        if compressor is not None:
            keys, values, key_mask = compressor.compress_heads(layer_idx, step.queries, keys, values, scale=step.scale,
                                                               budget=None if budgets is None else budgets[layer_idx])
        out.layers[layer_idx] = CompressedLayer(keys, values, seen_tokens=step.n_tokens, key_mask=key_mask)
    return out
