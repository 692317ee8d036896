"""KVCompressor: a policy applied layer by layer, for any inference loop (no transformers needed).

An engine asks ``budgets(n_tokens)`` to plan memory before prefill, then after each layer's prefill calls
``compress(layer_idx, queries, keys, values)`` and keeps the compact tensors it gets back::

    comp = KVCompressor(Policy.ripplekv(profile, retention=0.2), num_layers=30)
    plan = comp.budgets(n_prompt)                       # [C_0, ..., C_29] tokens per KV head
    k_c, v_c = comp.compress(layer, q_post_rope, k, v)  # [B, H_kv, C_layer, D]

``on_compress`` observes every ``compress`` call (benchmarks time the step with it, tests check the budgets) with a
``CompressionStep``: the layer, the step's inputs and outputs, the budget and the seconds it took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ripplekv_ext.model_info import compressible_layers, text_config
from ripplekv_ext.ops import gather_kv
from ripplekv_ext.policies import Policy

__all__ = ["KVCompressor", "CompressionStep"]


@dataclass(frozen=True)
class CompressionStep:
    """One ``KVCompressor.compress`` call, as an ``on_compress`` observer sees it.

    The tensors are the call's own (not copies): an observer that keeps them keeps them alive.
    """

    layer_idx: int
    queries: Tensor  # [B, H_q, W', D] post-RoPE queries the selector was given
    keys: Tensor  # [B, H_kv, N, D] the layer's full cache
    values: Tensor
    scale: Optional[float]  # softmax scale passed through (None: 1/sqrt(D))
    budget: Optional[int]  # tokens kept per KV head; None when the policy does not manage the layer
    indices: Optional[Tensor]  # int64 [B, H_kv, C] kept positions, None when the layer stayed whole
    kept_keys: Tensor  # [B, H_kv, C, D] (the inputs themselves when the layer stayed whole)
    kept_values: Tensor
    seconds: float  # selection + gather; on a GPU the device is synchronized around the step first

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[2]


CompressionObserver = Callable[[CompressionStep], None]


class KVCompressor:
    """Per-layer budgets and compression for one model under one policy.

    Args:
        policy: what to keep (``Policy``).
        num_layers: the model's number of decoder layers.
        compressible_layers: indices of the layers the policy manages (full-attention layers); default all.
            Others (e.g. sliding-window layers, which already bound their cache) are never compressed.
        on_compress: called with a ``CompressionStep`` after every ``compress`` call (or None).
    """

    def __init__(self, policy: Policy, num_layers: int, compressible_layers: Optional[Sequence[int]] = None,
                 on_compress: Optional[CompressionObserver] = None):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a ripplekv_ext.Policy, got {type(policy).__name__}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        layers = list(range(num_layers)) if compressible_layers is None else [int(i) for i in compressible_layers]
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"compressible_layers must be distinct indices in [0, {num_layers}), got {layers}")
        if on_compress is not None and not callable(on_compress):
            raise TypeError(f"on_compress must be callable or None, got {type(on_compress).__name__}")
        self.on_compress = on_compress
        self.policy = policy
        self.num_layers = num_layers
        self.compressible_layers = sorted(layers)
        self._slot = {layer: k for k, layer in enumerate(self.compressible_layers)}
        self._plans: dict[int, list[int]] = {}

    @classmethod
    def for_model(cls, model, policy: Policy, on_compress: Optional[CompressionObserver] = None) -> "KVCompressor":
        """Compressor for a transformers model: its full-attention layers are the compressible ones."""
        return cls(policy, text_config(model).num_hidden_layers, compressible_layers(model), on_compress)

    def _plan(self, n_tokens: int) -> list[int]:
        plan = self._plans.get(n_tokens)
        if plan is None:
            plan = self.policy.layer_budgets(len(self.compressible_layers), n_tokens, self.compressible_layers)
            self._plans[n_tokens] = plan
        return plan

    def budgets(self, n_tokens: int) -> list[Optional[int]]:
        """Tokens kept per KV head by each layer after an ``n_tokens`` prefill, indexed by layer.

        ``None`` marks a layer the policy does not manage (its cache is whatever the model keeps there); a
        budget equal to ``n_tokens`` means the layer stays uncompressed.
        """
        plan = self._plan(n_tokens)
        out: list[Optional[int]] = [None] * self.num_layers
        for layer, budget in zip(self.compressible_layers, plan):
            out[layer] = budget
        return out

    def layer_budget(self, layer_idx: int, n_tokens: int) -> Optional[int]:
        """Budget of one layer (``None`` if the layer is not compressible)."""
        self._check_layer(layer_idx)
        slot = self._slot.get(layer_idx)
        return None if slot is None else self._plan(n_tokens)[slot]

    def select(self, layer_idx: int, queries: Tensor, keys: Tensor,
               scale: Optional[float] = None) -> Optional[Tensor]:
        """int64 ``[B, H_kv, C]`` ascending positions to keep, or ``None`` when the layer stays as it is.

        ``queries``: post-RoPE prompt queries ``[B, H_q, W', D]``: at least the last ``window`` positions for
        SnapKV, every prompt position for H2O (``policy.selector.needs_all_queries``), unused by StreamingLLM.
        ``scale`` is the model's softmax scale (default ``1/sqrt(D)``).
        """
        if keys.dim() != 4:
            raise ValueError(f"keys must be 4-D [B, H_kv, N, D], got {keys.dim()}-D")
        n = keys.shape[2]
        budget = self.layer_budget(layer_idx, n)
        if budget is None or budget >= n:
            return None
        return self.policy.selector.select(queries, keys, budget, self.policy.window, scale)

    def compress(self, layer_idx: int, queries: Tensor, keys: Tensor, values: Tensor,
                 scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
        """``(keys_c, values_c)`` ``[B, H_kv, C, D]``: fresh compact tensors holding this layer's kept tokens, or
        the inputs themselves when the layer is not compressed (budget >= N or not compressible)."""
        if values.shape != keys.shape:
            raise ValueError(f"values must have the shape of keys {list(keys.shape)}, got {list(values.shape)}")
        observed = self.on_compress is not None
        if observed:
            start = _clock(keys)
        indices = self.select(layer_idx, queries, keys, scale)
        keys_c, values_c = (keys, values) if indices is None else gather_kv(keys, values, indices)
        if observed:
            seconds = _clock(keys) - start
            budget = self.layer_budget(layer_idx, keys.shape[2])
            self.on_compress(CompressionStep(layer_idx, queries, keys, values, scale, budget, indices, keys_c,
                                             values_c, seconds))
        return keys_c, values_c

    def _check_layer(self, layer_idx: int) -> None:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an integer in [0, {self.num_layers}), got {layer_idx!r}")

    def __repr__(self):
        return (f"KVCompressor({self.policy.name}, num_layers={self.num_layers}, "
                f"compressible_layers={self.compressible_layers})")


def _clock(like: Tensor) -> float:
    # GPU kernels run asynchronously: without a synchronization the step would look as fast as its launches.
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter()
