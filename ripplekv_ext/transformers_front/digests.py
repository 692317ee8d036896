"""Digests a compressed context is checked with: of the model's weights, and of the cache's tensors."""

from __future__ import annotations

import hashlib
import weakref

import torch
from torch import Tensor

__all__ = ["weights_digest", "cache_digest"]

# model -> (what its weights were when digested, the digest): digesting once per model and change of weights.
_WEIGHT_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weights_digest(model) -> str:
    """BLAKE2b of every tensor of ``model.state_dict()`` (names, dtypes, shapes and bytes): the model a cache's keys
    and values came from. Computed once per model and state of its weights (an in-place change of a tensor, a new
    tensor in its place): SmolLM2-135M's 621 MiB state_dict (fp32, the tied embedding under both names) took 2.2-2.5 s
    on one thread of a busy 2-core machine, 3 ms once cached (the first compress_context or continue_context on a
    model, and the first after its weights change, pay it)."""
    state = model.state_dict(keep_vars=True)
    versions = tuple((name, t.data_ptr(), t._version) for name, t in state.items())
    cached = _WEIGHT_DIGESTS.get(model)
    if cached is not None and cached[0] == versions:
        return cached[1]
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in state.items():
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy() if data.numel() else b"")
    _WEIGHT_DIGESTS[model] = (versions, digest.hexdigest())
    return _WEIGHT_DIGESTS[model][1]


def cache_digest(cache) -> str:
    """BLAKE2b of the tensors a cache holds (every layer's keys, values and key mask): what ``load_context`` checks a
    file against."""
    digest = hashlib.blake2b(digest_size=16)
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "key_mask", None)):
            if isinstance(tensor, Tensor):
                data = tensor.detach().cpu().contiguous()
                digest.update(f"{data.dtype}:{tuple(data.shape)}".encode())
                digest.update(data.view(torch.uint8).numpy() if data.numel() else b"")
    return digest.hexdigest()
