"""BudgetPlan: every budget of one policy on one model's compressible layers, answered in one place.

How many tokens does layer ``l`` keep: of an ``n``-token prompt (``prompt``, ``layer``); part-way through a prompt
read in chunks (``chunk``); when it re-selects while decoding (``decode``); for each row of a left-padded batch
(``rows``, ``layer_rows``); from the prompt's own attention, for an allocator that reads it (CAKE:
``from_attention``). The rules are the policy's (``Policy.layer_budgets`` and its kin); the plan applies them to the
model's layers and keeps the answers it has given, as every layer (and every row of equal length) asks the same
question at a step. ``KVCompressor`` holds one (``compressor.plan``) and selects under the budget it is given; the
vLLM engine plan wraps one and adds only tiers and blocks.

Each answer is indexed by layer: ``None`` marks a layer the policy does not manage (its cache is whatever the model
keeps there), a budget equal to the tokens seen means the layer stays whole.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
from torch import Tensor

from ripplekv_ext.checks import check_int, is_integer
from ripplekv_ext.model_info import compressible_layers, text_config
from ripplekv_ext.policies import Policy, PromptTooShortWarning

__all__ = ["BudgetPlan"]


class BudgetPlan:
    """The budgets of ``policy`` on a model of ``num_layers`` decoder layers, of which ``compressible_layers`` (the
    full-attention ones; default all) are the policy's to compress."""

    def __init__(self, policy: Policy, num_layers: int, compressible_layers: Optional[Sequence[int]] = None):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a ripplekv_ext.Policy, got {type(policy).__name__}")
        num_layers = check_int("num_layers", num_layers, 1)
        layers = list(range(num_layers)) if compressible_layers is None else list(compressible_layers)
        # int() would quietly turn 1.5 or True into layer 1.
        bad = [i for i in layers if not is_integer(i) or not 0 <= i < num_layers]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"compressible_layers must be distinct indices in [0, {num_layers}), got {layers}")
        self.policy = policy
        self.num_layers = num_layers
        self.compressible_layers = sorted(int(i) for i in layers)
        self._slot = {layer: k for k, layer in enumerate(self.compressible_layers)}
        self._prompt: dict[int, list[int]] = {}  # n_tokens -> budgets of the compressible layers
        self._decode: dict[tuple[int, int], list[int]] = {}  # (n_tokens, prompt_tokens) -> the same

    @classmethod
    def for_model(cls, model, policy: Policy) -> "BudgetPlan":
        """The plan for a transformers model: its full-attention layers are the compressible ones."""
        return cls(policy, text_config(model).num_hidden_layers, compressible_layers(model))

    def is_compressible(self, layer_idx: int) -> bool:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be an integer in [0, {self.num_layers}), got {layer_idx!r}")
        return layer_idx in self._slot

    def prompt(self, n_tokens: int) -> list[Optional[int]]:
        """Tokens kept per KV head by each layer after an ``n_tokens`` prefill."""
        return self._by_layer(self._prompt_plan(n_tokens))

    def layer(self, layer_idx: int, n_tokens: int) -> Optional[int]:
        """One layer's ``prompt(n_tokens)``."""
        if not self.is_compressible(layer_idx):
            return None
        return self._prompt_plan(n_tokens)[self._slot[layer_idx]]

    def chunk(self, n_read: int, n_total: Optional[int] = None) -> list[Optional[int]]:
        """Tokens each layer keeps after the first ``n_read`` tokens of a prompt read in chunks (docs/design.md §4,
        "Bounded (rolling) prefill"): with the whole prompt's length ``n_total`` known, its final budget
        ``prompt(n_total)``, as the allocator rounds it part-way (``chunk_budget``: all tokens read up to the
        budget); else the budgets of a prompt of ``n_read`` tokens. After the last chunk (``n_read == n_total``) both
        are ``prompt(n_total)``."""
        n_read = check_int("n_read", n_read, 1)
        if n_total is None:
            with warnings.catch_warnings():  # a first chunk too short to compress is no mistake
                warnings.simplefilter("ignore", PromptTooShortWarning)
                return self.prompt(n_read)
        n_total = check_int("n_total", n_total, n_read)
        return [None if budget is None else self._chunk_budget(budget, n_read) for budget in self.prompt(n_total)]

    def layer_chunk(self, layer_idx: int, n_read: int, n_total: int) -> Optional[int]:
        """One layer's ``chunk(n_read, n_total)``."""
        budget = self.layer(layer_idx, check_int("n_total", n_total, check_int("n_read", n_read, 1)))
        return None if budget is None else self._chunk_budget(budget, n_read)

    def _chunk_budget(self, budget: int, n_read: int) -> int:
        """What a layer whose final budget is ``budget`` keeps after ``n_read`` tokens: the allocator's rounding
        part-way (``chunk_budget``), over the tokens after a protected prefix, which is kept whole."""
        allocator, protect = self.policy.allocator, self.policy.protect
        if allocator is None or n_read <= protect:
            return n_read
        return protect + allocator.chunk_budget(budget - protect, n_read - protect)

    def decode(self, n_tokens: int, prompt_tokens: int) -> list[Optional[int]]:
        """Tokens each layer keeps when it re-selects during decoding (``policy.decode_every``), ``n_tokens``
        (prompt + generated) having been seen after a ``prompt_tokens`` prompt. The total over the layers is fixed
        for the whole generation (``Policy.decode_layer_budgets``)."""
        key = (n_tokens, prompt_tokens)
        plan = self._decode.get(key)
        if plan is None:
            if len(self._decode) >= 256:  # lengths only grow: old plans are not asked for again
                self._decode.clear()
            plan = self._decode[key] = self.policy.decode_layer_budgets(
                len(self.compressible_layers), n_tokens, prompt_tokens, self.compressible_layers)
        return self._by_layer(plan)

    def rows(self, lengths) -> list[list[Optional[int]]]:
        """``prompt(n_b)`` for each row ``b`` of a left-padded batch: ``[row][layer]``. A row with no real token keeps
        nothing (0)."""
        nothing = [0 if layer in self._slot else None for layer in range(self.num_layers)]
        return [self.prompt(n) if n > 0 else nothing for n in as_lengths(lengths)]

    def layer_rows(self, layer_idx: int, lengths) -> Optional[list[int]]:
        """One layer's budget for each row's length (``None`` if the layer is not compressible)."""
        if not self.is_compressible(layer_idx):
            return None
        return [self.layer(layer_idx, n) if n > 0 else 0 for n in as_lengths(lengths)]

    def from_attention(self, windows: dict, n_tokens: int) -> list[Optional[int]]:
        """``prompt(n_tokens)`` read from one prompt's attention, for a policy whose allocator ``reads_attention``
        (CAKE): ``windows[layer] = (queries, keys, scale)`` of each compressible layer after an ``n_tokens`` prefill,
        its post-RoPE window queries ``[1, H_q, W', D]``, keys ``[1, H_kv, N, D]`` and softmax scale (None:
        ``1/sqrt(D)``). Other policies: ``prompt(n_tokens)``."""
        plan, allocator, layers = self.prompt(n_tokens), self.policy.allocator, self.compressible_layers
        if not self.policy.reads_attention or all(plan[layer] == n_tokens for layer in layers):
            return plan
        if any(layer not in windows for layer in layers):
            raise ValueError(f"{allocator!r} reads every compressible layer's attention: no window for layers "
                             f"{[layer for layer in layers if layer not in windows]}")
        for layer in layers:
            keys = windows[layer][1]
            if keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[2] != n_tokens:
                raise ValueError(f"{allocator!r} reads one prompt's attention: layer {layer}'s keys must be "
                                 f"[1, H_kv, {n_tokens}, D], got {list(keys.shape)}")
        preferences = [allocator.preference(windows[layer][0], windows[layer][1], self.policy.window,
                                            windows[layer][2]) for layer in layers]
        for layer, budget in zip(layers, self.policy.attention_layer_budgets(preferences, n_tokens, layers)):
            plan[layer] = budget
        return plan

    def _prompt_plan(self, n_tokens: int) -> list[int]:
        plan = self._prompt.get(n_tokens)
        if plan is None:
            plan = self._prompt[n_tokens] = self.policy.layer_budgets(len(self.compressible_layers), n_tokens,
                                                                      self.compressible_layers)
        return plan

    def _by_layer(self, plan: list[int]) -> list[Optional[int]]:
        out: list[Optional[int]] = [None] * self.num_layers
        for layer, budget in zip(self.compressible_layers, plan):
            out[layer] = budget
        return out

    def __repr__(self):
        return (f"BudgetPlan({self.policy.name}, num_layers={self.num_layers}, "
                f"compressible_layers={self.compressible_layers})")


def as_lengths(lengths, name: str = "lengths") -> tuple[int, ...]:
    """Row lengths (an int64 tensor or a sequence of ints) as a tuple of ints."""
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor [B], got {lengths.dtype} of shape "
                             f"{list(lengths.shape)}")
        return tuple(int(x) for x in lengths.tolist())
    values = tuple(lengths)
    if not all(is_integer(x) for x in values):
        raise ValueError(f"{name} must be integers (one per row), got {list(values)}")
    return tuple(int(x) for x in values)
