"""KVCompressor: a policy applied layer by layer, for any inference loop (no transformers needed).

Budgets are the compressor's ``plan`` (``BudgetPlan``: a prompt, each chunk of a bounded prefill, decoding, each row
of a batch, CAKE's from attention); the compressor selects and gathers under the budget it is given, or the plan's.
An engine asks ``plan.prompt(n_tokens)`` (``budgets(n_tokens)``, the same) to plan memory before prefill, then after
each layer's prefill calls ``compress(layer_idx, queries, keys, values)`` and keeps the compact tensors it gets
back::

    comp = KVCompressor(Policy.ripplekv(profile, retention=0.2), num_layers=30)
    plan = comp.plan.prompt(n_prompt)                   # [C_0, ..., C_29] tokens per KV head
    k_c, v_c = comp.compress(layer, q_post_rope, k, v)  # [B, H_kv, C_layer, D]

A left-padded batch of prompts of different lengths (row ``b``'s ``n_b`` real tokens are positions ``[N - n_b, N)``)
goes through ``compress_rows(layer_idx, queries, keys, values, lengths)``: each row is compressed as if it were
alone, with the budgets of its own length (``plan.rows(lengths)``), and the layer's rows come back padded on the
left to its longest row, with a key mask ``[B, C_max]`` marking the real slots (docs/design.md §4, "Batches").

Compression during decoding (``Policy(..., decode_every=K)``) is the same calls again on the whole cache every ``K``
generated tokens, with ``budget=plan.decode(n_seen, n_prompt)[layer]`` (a fixed total, split for the length seen
so far) and the post-RoPE queries of the layer's latest ``W`` tokens as the window.

CAKE's budgets come from the prompt's attention (``plan.from_attention``, once every layer has read it); AdaKV's heads
keep different counts (``compress_heads`` returns the per-head key mask attention must apply).

``on_compress`` observes every ``compress`` call (benchmarks time the step with it, tests check the budgets) with a
``CompressionStep``: the layer, the step's inputs and outputs, the budget and the seconds it took.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ripplekv_ext.budgets.plan import BudgetPlan, as_lengths
from ripplekv_ext.checks import is_integer
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
    budget: Optional[int]  # tokens kept per KV head (the longest row's, for a batch); None: layer not managed
    indices: Optional[Tensor]  # int64 [B, H_kv, C] kept positions (-1: a row's padding slot); None: stayed whole
    kept_keys: Tensor  # [B, H_kv, C, D] (the inputs themselves when the layer stayed whole)
    kept_values: Tensor
    seconds: float  # selection + gather; on a GPU the device is synchronized around the step first
    # Per-row batches (``compress_rows``); for ``compress`` every row is the whole N, ``lengths`` is None.
    lengths: Optional[tuple[int, ...]] = None  # real tokens n_b of each row (left-padded layout)
    row_budgets: Optional[tuple[int, ...]] = None  # the policy's budget for each row's n_b (>= n_b: row kept whole)
    key_mask: Optional[Tensor] = None  # bool [B, C_max]: the kept slots holding a real token

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
        if on_compress is not None and not callable(on_compress):
            raise TypeError(f"on_compress must be callable or None, got {type(on_compress).__name__}")
        self.plan = BudgetPlan(policy, num_layers, compressible_layers)
        self.on_compress = on_compress
        self.policy = policy
        self.num_layers = self.plan.num_layers
        self.compressible_layers = self.plan.compressible_layers

    @classmethod
    def for_model(cls, model, policy: Policy, on_compress: Optional[CompressionObserver] = None) -> "KVCompressor":
        """Compressor for a transformers model: its full-attention layers are the compressible ones."""
        return cls(policy, text_config(model).num_hidden_layers, compressible_layers(model), on_compress)

    # The budgets are the plan's (``BudgetPlan``): these names stay for the code written against them.

    def budgets(self, n_tokens: int) -> list[Optional[int]]:
        """``plan.prompt``: tokens kept per KV head by each layer after an ``n_tokens`` prefill, indexed by layer."""
        return self.plan.prompt(n_tokens)

    def attention_budgets(self, windows: dict, n_tokens: int) -> list[Optional[int]]:
        """``plan.from_attention``: the budgets read from one prompt's attention (CAKE)."""
        return self.plan.from_attention(windows, n_tokens)

    def layer_budget(self, layer_idx: int, n_tokens: int) -> Optional[int]:
        """``plan.layer``: one layer's budget (``None`` if the layer is not compressible)."""
        return self.plan.layer(layer_idx, n_tokens)

    def chunk_budgets(self, n_read: int, n_total: Optional[int] = None) -> list[Optional[int]]:
        """``plan.chunk``: what each layer keeps part-way through a prompt read in chunks."""
        return self.plan.chunk(n_read, n_total)

    def decode_budgets(self, n_tokens: int, prompt_tokens: int) -> list[Optional[int]]:
        """``plan.decode``: what each layer keeps when it re-selects during decoding."""
        return self.plan.decode(n_tokens, prompt_tokens)

    def select(self, layer_idx: int, queries: Tensor, keys: Tensor,
               scale: Optional[float] = None, budget: Optional[int] = None,
               values: Optional[Tensor] = None, protect: Optional[int] = None) -> Optional[Tensor]:
        """int64 ``[B, H_kv, C]`` ascending positions to keep, or ``None`` when the layer stays as it is.

        ``queries``: post-RoPE prompt queries ``[B, H_q, W', D]``: at least the last ``window`` positions for
        SnapKV, every prompt position for H2O (``policy.selector.needs_all_queries``), unused by StreamingLLM.
        ``scale`` is the model's softmax scale (default ``1/sqrt(D)``). ``budget``: tokens to keep (default: the
        policy's for an ``N``-token prompt); during decoding, ``decode_budgets``'s. ``values`` ``[B, H_kv, N, D]``:
        needed by a selector that reads them (``policy.selector.needs_values``). ``protect``: the first tokens of
        ``keys``, kept whole and left out of the scoring (default: the policy's protected prefix; an engine that
        passes only the tokens after it passes 0).
        """
        if keys.dim() != 4:
            raise ValueError(f"keys must be 4-D [B, H_kv, N, D], got {keys.dim()}-D")
        n = keys.shape[2]
        protect = self._protect(protect)
        budget = self._budget(layer_idx, n, budget, protect)
        if budget is None or budget >= n:
            return None
        # The protected prefix is not scored: the rest is selected as a prompt of its own.
        rest = self.policy.selector.select(queries, keys[:, :, protect:], budget - protect, self.policy.window, scale,
                                           **self._values_argument(keys, values, protect))
        if not protect:
            return rest
        prefix = torch.arange(protect, device=rest.device).expand(rest.shape[0], rest.shape[1], protect)
        return torch.cat([prefix, rest + protect], dim=-1)

    def _protect(self, protect: Optional[int]) -> int:
        if protect is None:
            return self.policy.protect
        if not is_integer(protect) or protect < 0:
            raise ValueError(f"protect must be an integer >= 0 (tokens kept whole at the start of keys) or None (the "
                             f"policy's, {self.policy.protect}), got {protect!r}")
        return int(protect)

    def _values_argument(self, keys: Tensor, values: Optional[Tensor], protect: int = 0) -> dict:
        """``{"values": values}`` (after the first ``protect`` tokens) for a selector that reads them, else nothing
        (a selector of one's own may not take the argument)."""
        if not self.policy.selector.needs_values:
            return {}
        if values is None:
            raise ValueError(f"{self.policy.selector!r} reads the layer's values: pass values= (the keys' shape "
                             f"{list(keys.shape)})")
        return {"values": values[:, :, protect:]}

    def compress(self, layer_idx: int, queries: Tensor, keys: Tensor, values: Tensor,
                 scale: Optional[float] = None, budget: Optional[int] = None,
                 protect: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """``(keys_c, values_c)`` ``[B, H_kv, C, D]``: fresh compact tensors holding this layer's kept tokens, or
        the inputs themselves when the layer is not compressed (budget >= N or not compressible). ``budget`` and
        ``protect`` as in ``select``."""
        if self.policy.selector is not None and self.policy.selector.head_wise:
            raise ValueError(f"{self.policy.selector!r} keeps a different count per KV head: use compress_heads, "
                             "which returns the per-head key mask attention must apply")
        keys_c, values_c, _ = self.compress_heads(layer_idx, queries, keys, values, scale, budget, protect)
        return keys_c, values_c

    def compress_heads(self, layer_idx: int, queries: Tensor, keys: Tensor, values: Tensor,
                       scale: Optional[float] = None, budget: Optional[int] = None,
                       protect: Optional[int] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(keys_c, values_c, key_mask)`` for a selector whose heads keep different counts (AdaKV): each head's
        kept tokens in its last slots of ``[B, H_kv, C_max, D]``, zeros before them, and the bool ``[B, H_kv, C_max]``
        mask of real slots attention must apply (None: all real, as for every other selector)."""
        if values.shape != keys.shape:
            raise ValueError(f"values must have the shape of keys {list(keys.shape)}, got {list(values.shape)}")
        observed = self.on_compress is not None
        if observed:
            start = _clock(keys)
        indices = self.select(layer_idx, queries, keys, scale, budget, values, protect)
        keys_c, values_c = (keys, values) if indices is None else gather_kv(keys, values, indices)
        if observed:
            seconds = _clock(keys) - start
            budget = self._budget(layer_idx, keys.shape[2], budget, self._protect(protect))
            self.on_compress(CompressionStep(layer_idx, queries, keys, values, scale, budget, indices, keys_c,
                                             values_c, seconds))
        key_mask = None if indices is None or bool((indices >= 0).all()) else indices >= 0
        return keys_c, values_c, key_mask

    # -- left-padded batches: every row compressed as if it were alone ----------------------------------------

    def row_budgets(self, lengths) -> list[list[Optional[int]]]:
        """``plan.rows``: ``[row][layer]`` budgets for each row's length. A row with no real token keeps nothing."""
        return self.plan.rows(lengths)

    def layer_row_budgets(self, layer_idx: int, lengths) -> Optional[list[int]]:
        """``plan.layer_rows``: one layer's budget for each row's length (``None`` if it is not compressible)."""
        return self.plan.layer_rows(layer_idx, lengths)

    def select_rows(self, layer_idx: int, queries: Tensor, keys: Tensor, lengths,
                    scale: Optional[float] = None, budgets=None, values: Optional[Tensor] = None) -> Optional[Tensor]:
        """int64 ``[B, H_kv, C_max]`` positions to keep per row of a left-padded batch, or ``None`` when every row
        keeps all its real tokens.

        Row ``b`` holds ``n_b = lengths[b]`` real tokens at positions ``[N - n_b, N)``; it keeps
        ``C_b = min(budget_b, n_b)`` of them, ``budget_b`` being this layer's budget for ``n_b``, chosen exactly as
        ``select`` would choose them for that row alone. Its positions (in the padded layout, ascending) fill the
        *last* ``C_b`` slots; the first ``C_max - C_b`` are ``-1``. ``queries`` are the padded batch's queries
        (``[B, H_q, W', D]``, its last ``W'`` positions), as ``select`` takes them. ``budgets``: one per row
        (default: the policy's for each row's length); during decoding, ``decode_budgets``'s for each row.
        ``values`` as in ``select``.
        """
        if keys.dim() != 4:
            raise ValueError(f"keys must be 4-D [B, H_kv, N, D], got {keys.dim()}-D")
        n = keys.shape[2]
        lengths = _check_lengths(lengths, keys.shape[0], n)
        budgets = self._row_budgets(layer_idx, lengths, budgets)
        if budgets is None or all(budget >= length for budget, length in zip(budgets, lengths)):
            return None
        if all(length == n for length in lengths) and len(set(budgets)) == 1:  # no padding: one batched call
            return self.select(layer_idx, queries, keys, scale, budgets[0], values)
        if self.policy.protect:  # each row's prefix starts at its own first real token
            return self._select_rows_one_by_one(layer_idx, queries, keys, lengths, scale, budgets, values)
        # One call for the whole batch (the per-row ops for scored selectors; other selectors go row by row).
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=keys.device)
        return self.policy.selector.select_rows(queries, keys, as_tensor(budgets), as_tensor(lengths),
                                                self.policy.window, scale, **self._values_argument(keys, values))

    def _select_rows_one_by_one(self, layer_idx: int, queries: Tensor, keys: Tensor, lengths: tuple[int, ...],
                                scale: Optional[float], budgets: list[int], values: Optional[Tensor]) -> Tensor:
        """``select_rows``, each row by ``select`` on its own real tokens."""
        n, heads = keys.shape[2], keys.shape[1]
        rows = []
        for b, (length, budget) in enumerate(zip(lengths, budgets)):
            start = n - length
            kept = self.select(layer_idx, queries[b:b + 1], keys[b:b + 1, :, start:], scale, budget,
                               None if values is None else values[b:b + 1, :, start:])
            if kept is None:
                kept = torch.arange(length, device=keys.device).expand(1, heads, length)
            rows.append(kept + start)
        width = max(row.shape[-1] for row in rows)
        return torch.cat([torch.nn.functional.pad(row, (width - row.shape[-1], 0), value=-1) for row in rows])

    def compress_rows(self, layer_idx: int, queries: Tensor, keys: Tensor, values: Tensor, lengths,
                      scale: Optional[float] = None, budgets=None) -> tuple[Tensor, Tensor, Tensor]:
        """``(keys_c, values_c, key_mask)`` for a left-padded batch (see ``select_rows``).

        ``keys_c``/``values_c`` ``[B, H_kv, C_max, D]`` hold each row's kept tokens in its last ``C_b`` slots and
        zeros before them; ``key_mask`` (bool ``[B, C_max]``) is True on the real slots, and attention must apply
        it. When no row is cut, the inputs themselves come back (``C_max = N``) with the padding as the mask.
        ``lengths``: int64 ``[B]`` tensor or sequence of ints, each in ``[0, N]``; ``budgets`` as in ``select_rows``.
        """
        if values.shape != keys.shape:
            raise ValueError(f"values must have the shape of keys {list(keys.shape)}, got {list(values.shape)}")
        observed = self.on_compress is not None
        if observed:
            start = _clock(keys)
        lengths = _check_lengths(lengths, keys.shape[0], keys.shape[2] if keys.dim() == 4 else 0)
        indices = self.select_rows(layer_idx, queries, keys, lengths, scale, budgets, values)
        if indices is None:
            keys_c, values_c = keys, values
            n = keys.shape[2]
            key_mask = torch.arange(n, device=keys.device) >= (n - torch.tensor(lengths, device=keys.device))[:, None]
        else:
            keys_c, values_c, key_mask = _gather_rows(keys, values, indices)
        if observed:
            seconds = _clock(keys) - start
            budgets = self._row_budgets(layer_idx, lengths, budgets)
            budget = None if budgets is None else max(budgets)
            self.on_compress(CompressionStep(layer_idx, queries, keys, values, scale, budget, indices, keys_c,
                                             values_c, seconds, lengths, None if budgets is None else tuple(budgets),
                                             key_mask))
        return keys_c, values_c, key_mask

    def _budget(self, layer_idx: int, n_tokens: int, budget: Optional[int], protect: int) -> Optional[int]:
        """The given budget (checked), or the plan's for an ``n_tokens`` prompt; None: layer not compressible."""
        if budget is None:
            return self.policy.layer_alone_budget(self.plan.layer(layer_idx, n_tokens), n_tokens, "budget")
        if not self.plan.is_compressible(layer_idx):
            return None
        return _check_budget("budget", budget, self.policy.window, n_tokens, protect)

    def _row_budgets(self, layer_idx: int, lengths: tuple[int, ...], budgets) -> Optional[list[int]]:
        if budgets is None:
            return self.policy.layer_alone_budget(self.plan.layer_rows(layer_idx, lengths), lengths, "budgets")
        if not self.plan.is_compressible(layer_idx):
            return None
        budgets = list(as_lengths(budgets, "budgets"))
        if len(budgets) != len(lengths):
            raise ValueError(f"budgets must hold one budget per row ({len(lengths)}), got {len(budgets)}")
        for row, (budget, length) in enumerate(zip(budgets, lengths)):
            _check_budget(f"budgets[{row}]", budget, self.policy.window, length, self.policy.protect)
        return budgets

    def __repr__(self):
        return (f"KVCompressor({self.policy.name}, num_layers={self.num_layers}, "
                f"compressible_layers={self.compressible_layers})")


def _check_budget(name: str, budget, window: int, n_tokens: int, protect: int = 0) -> int:
    # A budget that covers the tokens keeps them all; one that cuts must still hold the window (and the protected
    # prefix).
    if not is_integer(budget) or (budget < protect + window and budget < n_tokens):
        prefix = f"the protected prefix ({protect}) + " if protect else ""
        raise ValueError(f"{name} must be an integer >= {prefix}window = {protect + window} (the newest window tokens "
                         f"are always kept) or >= the tokens it covers ({n_tokens}), got {budget!r}")
    return int(budget)


def _check_lengths(lengths, batch: int, n_tokens: int) -> tuple[int, ...]:
    lengths = as_lengths(lengths)
    if len(lengths) != batch:
        raise ValueError(f"lengths must hold one length per row ({batch}), got {len(lengths)}")
    bad = [row for row, n in enumerate(lengths) if not 0 <= n <= n_tokens]
    if bad:
        raise ValueError(f"lengths must be in [0, N = {n_tokens}], got {[lengths[r] for r in bad]} in rows {bad}")
    return lengths


def _gather_rows(keys: Tensor, values: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # A -1 slot is a row's padding: gather_kv writes zeros there, so nothing of a pad is held.
    keys_c, values_c = gather_kv(keys, values, indices)
    return keys_c, values_c, indices[:, 0, :] >= 0  # every head of a row keeps the same count


def _clock(like: Tensor) -> float:
    # GPU kernels run asynchronously: without a synchronization the step would look as fast as its launches.
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter()
