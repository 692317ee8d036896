"""The attention registration: the one way this package puts its attention function into a transformers model.

A function is registered in transformers' ``AttentionInterface`` (and a mask function in
``AttentionMaskInterface``) under a name no one else uses, and the model's configs are switched to that name, so
every model that routes attention through the registry calls it, with no per-model patching. The global entries
("sdpa", "eager", "paged|eager", ...) are never replaced: another model in the process keeps stock attention.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Optional

import torch
from torch import Tensor
from transformers import masking_utils, modeling_utils

__all__ = ["attention_implementation", "eager_attention", "registered_attention", "registered_name",
           "switched_attention", "unique_attention_name"]

_names = itertools.count()


def unique_attention_name(prefix: str) -> str:
    """A registry name no other block uses: open blocks never see each other's attention function."""
    return f"{prefix}_{next(_names)}"


def attention_implementation(model) -> Optional[str]:
    """The attention implementation ``model`` runs now (``"sdpa"``, ``"eager"``, a registered name...)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def registered_function(name: str):
    """The attention function registered under ``name`` (KeyError when none is)."""
    return modeling_utils.AttentionInterface._global_mapping[name]


def _configs(model) -> list:
    """Every distinct config object in the model (top-level, sub-configs, per-module references)."""
    seen: dict[int, object] = {}
    stack = [model.config] + [m.config for m in model.modules() if hasattr(m, "config")]
    while stack:
        config = stack.pop()
        if id(config) in seen or not hasattr(config, "_attn_implementation_internal"):
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None:
                stack.append(sub)
    return list(seen.values())


@contextlib.contextmanager
def registered_name(name: str, attention_function, mask_function):
    """``attention_function`` (and ``mask_function``, e.g. ``masking_utils.sdpa_mask``) registered under ``name``
    inside the block; withdrawn on exit, even after an exception. No model is switched to it."""
    try:
        modeling_utils.AttentionInterface.register(name, attention_function)
        masking_utils.AttentionMaskInterface.register(name, mask_function)
        yield name
    finally:
        modeling_utils.AttentionInterface._global_mapping.pop(name, None)
        masking_utils.AttentionMaskInterface._global_mapping.pop(name, None)


class switched_attention:
    """Switches every config of ``model`` to the implementation ``name`` (``switch``) and back (``restore``).

    ``restore`` puts back what each config held when the object was made; with ``only_if_switched`` only where the
    config still holds ``name``, so an engine that switched the model itself in between (continuous batching
    restores "eager" after running "paged|eager") keeps its own setting."""

    def __init__(self, model, name: str):
        self.name = name
        self._saved = [(config, config._attn_implementation_internal) for config in _configs(model)]

    def switch(self) -> None:
        for config, _ in self._saved:
            config._attn_implementation_internal = self.name

    def restore(self, only_if_switched: bool = False) -> None:
        for config, value in self._saved:
            if not only_if_switched or config._attn_implementation_internal == self.name:
                config._attn_implementation_internal = value


@contextlib.contextmanager
def registered_attention(model, name: str, attention_function, mask_function):
    """Run ``model`` with ``attention_function`` inside the block.

    Registers it under ``name`` (``registered_name``) and sets every config of the model to it; on exit, even
    after an exception, the configs get their previous implementation back and ``name`` is withdrawn.
    """
    switch = switched_attention(model, name)
    with registered_name(name, attention_function, mask_function):
        switch.switch()
        try:
            yield name
        finally:
            switch.restore()


def eager_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    scaling: Optional[float] = None, dropout: float = 0.0, softcap: Optional[float] = None,
                    **kwargs):
    """The eager attention transformers' decoder models use: softmax in fp32, optional logit soft-capping."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def base_attention(attention: str):
    """(attention function, mask function) of ``"sdpa"`` or ``"eager"``: what a block computes attention with."""
    if attention == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward, masking_utils.sdpa_mask
    return eager_attention, masking_utils.eager_mask
