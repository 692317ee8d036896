"""Selectors: which tokens a layer keeps under its budget.

``Selector`` is the type every selector is: ``select`` keeps ``budget`` positions per KV head, the last ``window``
always among them; ``select_rows`` does the same for each row of a left-padded batch, as if each were alone (the
base runs each row through ``select``). ``ScoredSelector`` is the common kind: it ``score``s the positions before
the window and keeps the top ones plus the window, with the fused per-row ops (kvpress's ``ScorerPress`` is the
model). Any ``Selector`` combines with any allocator in a ``Policy``; selectors compare by their settings."""

from __future__ import annotations

import abc
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ripplekv_ext.checks import check_bool, check_choice, check_fraction, check_int
from ripplekv_ext.equality import SettingsEquality
from ripplekv_ext.ops import h2o_scores, select_topk, select_topk_rows, snapkv_scores, streaming_indices

__all__ = ["Selector", "ScoredSelector", "SnapKVSelector", "PeakSpanSelector", "KeyNormSelector", "H2OSelector",
           "StreamingLLMSelector", "free_slots_and_starts", "DEFAULT_PEAK_SHARE", "DEFAULT_VALUE_WEIGHTED"]

# The share of PeakSpanSelector's scored slots that go to max-pooled peaks (the rest to averaged spans): chosen on
# calibration text and retrieval prompts of both models (docs/defaults.md).
DEFAULT_PEAK_SHARE = 0.5
# Whether PeakSpanSelector weighs each position's attention mass by its value's norm: chosen on calibration text and
# retrieval prompts of both models (docs/defaults.md).
DEFAULT_VALUE_WEIGHTED = True


def _check_queries(queries: Tensor, keys: Tensor) -> None:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries and keys must be 4-D ([B, H_q, W, D] and [B, H_kv, N, D]), got "
                         f"{queries.dim()}-D and {keys.dim()}-D")


class Selector(SettingsEquality, abc.ABC):
    """Which ``budget`` of a layer's ``N`` positions each KV head keeps; the last ``window`` always among them.

    ``name`` names the selector in method names (``ALLOCATOR+SELECTOR``); ``needs_all_queries`` says whether it
    reads the queries of every prompt position (H2O) or only the window's; ``needs_values`` whether it reads the
    layer's values (the compressor passes ``values=`` only to a selector that does, so a selector of one's own
    need not take them); ``head_wise`` whether its KV heads keep different counts (AdaKV: its selections are
    right-aligned per head, ``-1`` before a head's kept positions, and kept with a per-head key mask).
    """

    name: str = "custom"
    needs_all_queries: bool = False
    needs_values: bool = False
    head_wise: bool = False

    @abc.abstractmethod
    def select(self, queries: Tensor, keys: Tensor, budget: int, window: int,
               scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        """int64 ``[B, H_kv, budget]``, ascending. ``queries``: the post-RoPE queries ``[B, H_q, W', D]`` of the
        last ``W' >= window`` prompt positions (every position when ``needs_all_queries``); ``keys``
        ``[B, H_kv, N, D]``; ``scale`` the model's softmax scale (None: ``1/sqrt(D)``); ``values`` ``[B, H_kv, N,
        D]``, read when ``needs_values``."""

    def select_rows(self, queries: Tensor, keys: Tensor, budgets: Tensor, lengths: Tensor, window: int,
                    scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        """``select`` for each row of a left-padded batch alone: int64 ``[B, H_kv, C_max]``, row ``b``'s
        ``min(budgets[b], lengths[b])`` kept positions (in the padded layout, ascending) in its last slots and
        ``-1`` before them. Row ``b``'s ``n_b = lengths[b]`` real tokens are positions ``[N - n_b, N)``.

        This base runs each row through ``select``; a selector with a batched form overrides it."""
        b, h_kv, n, _ = keys.shape
        budgets, lengths = budgets.tolist(), lengths.tolist()
        kept = [min(budget, length) for budget, length in zip(budgets, lengths)]
        indices = torch.full((b, h_kv, max(kept, default=0)), -1, dtype=torch.int64, device=keys.device)
        for row, (length, budget, c) in enumerate(zip(lengths, budgets, kept)):
            start = n - length
            if c == 0:
                continue
            if budget >= length:
                positions = torch.arange(start, n, device=keys.device).expand(1, h_kv, length)
            else:
                row_queries = queries[row:row + 1, :, max(queries.shape[2] - length, 0):]
                row_values = None if values is None else values[row:row + 1, :, start:]
                positions = self.select(row_queries, keys[row:row + 1, :, start:], budget, window, scale,
                                        values=row_values) + start
            indices[row, :, indices.shape[2] - c:] = positions[0]
        return indices


class ScoredSelector(Selector):
    """Keeps the ``budget - window`` best-scored positions before the window, plus the window.

    A subclass implements ``score``; selection is ``select_topk`` (``select_topk_rows`` for a batch, one call)."""

    @abc.abstractmethod
    def score(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None,
              lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        """float32 ``[B, H_kv, N - window]``: higher is kept first. With ``lengths`` (a left-padded batch) each row
        is scored alone and pad positions score ``-inf``."""

    def select(self, queries: Tensor, keys: Tensor, budget: int, window: int,
               scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        return select_topk(self.score(queries, keys, window, scale, values=values), budget, window)

    def select_rows(self, queries: Tensor, keys: Tensor, budgets: Tensor, lengths: Tensor, window: int,
                    scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        return select_topk_rows(self.score(queries, keys, window, scale, lengths, values), budgets, window, lengths)


def _pool(scores: Tensor, kernel_size: int, pooling: str) -> Tensor:
    """``scores`` ``[B, H, P]`` pooled along positions as ``snapkv_scores`` pools: max pads with -inf, average counts
    zero padding; a row's pad positions (-inf) stay -inf and pad the pooling as its boundary does."""
    pad = scores.isneginf()
    k = kernel_size
    if pooling == "max":
        return F.max_pool1d(scores, k, 1, k // 2).masked_fill(pad, -math.inf)
    return F.avg_pool1d(scores.masked_fill(pad, 0.0), k, 1, k // 2).masked_fill(pad, -math.inf)


def _window_scores(selector, queries: Tensor, keys: Tensor, window: int, scale: Optional[float],
                   lengths: Optional[Tensor], kernel_size: int, pooling: str, values: Optional[Tensor]) -> Tensor:
    """SnapKV's scores of the positions before the window, for ``selector``'s ``group_reduce`` and ``value_weighted``
    (``SnapKVSelector`` says what each means), pooled over ``kernel_size`` positions (1: unpooled)."""
    # More queries than the window are accepted and cut to it.
    _check_queries(queries, keys)
    if queries.shape[2] < window:
        raise ValueError(f"queries must hold at least window = {window} positions, got {queries.shape[2]}")
    if not selector.value_weighted:
        return snapkv_scores(queries[:, :, -window:], keys, kernel_size=kernel_size, pooling=pooling,
                             group_reduce=selector.group_reduce, scale=scale, lengths=lengths)
    if values is None or values.shape != keys.shape:
        got = None if values is None else list(values.shape)
        raise ValueError(f"{selector!r} weighs each position by its value's norm: values= must have the keys' "
                         f"shape {list(keys.shape)}, got {got}")
    mass = snapkv_scores(queries[:, :, -window:], keys, kernel_size=1, group_reduce=selector.group_reduce,
                         scale=scale, lengths=lengths)
    norms = torch.linalg.vector_norm(values[:, :, :mass.shape[-1]], dim=-1, dtype=torch.float32)
    # Pad positions keep their -inf (a pad value's norm may be 0, and -inf * 0 is NaN).
    weighted = (mass * norms).masked_fill(mass.isneginf(), -math.inf)
    return weighted if kernel_size == 1 else _pool(weighted, kernel_size, pooling)


def free_slots_and_starts(keys: Tensor, budgets, window: int,
                          lengths: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(slots beyond the window, first real position) of each row, int64 ``[B]`` each: ``budgets`` an int without
    ``lengths``, else int64 ``[B]`` for a left-padded batch whose rows hold ``lengths`` real tokens."""
    b = keys.shape[0]
    if lengths is None:
        return (torch.full((b,), max(budgets - window, 0), dtype=torch.int64, device=keys.device),
                torch.zeros(b, dtype=torch.int64, device=keys.device))
    return (budgets.to(keys.device) - window).clamp(min=0), keys.shape[2] - lengths.to(keys.device)


def _check_snapkv_options(kernel_size: int, group_reduce: str, value_weighted: bool) -> None:
    # Checked when the selector is built, so a bad option fails with the policy, not at the first prefill.
    if check_int("kernel_size", kernel_size, 1) % 2 == 0:
        raise ValueError(f"kernel_size must be odd (pooling keeps the length), got {kernel_size}")
    check_choice("group_reduce", group_reduce, ("mean", "max"))
    check_bool("value_weighted", value_weighted)


class SnapKVSelector(ScoredSelector):
    """Top tokens by attention mass from the last ``window`` queries, pooled along positions (SnapKV).

    ``value_weighted``: each position's attention mass times the L2 norm of its value (per KV head) before the
    pooling (VATP: Guo et al., 2024, "Attention Score is not All You Need for Token Importance Indicator in KV Cache
    Reduction: Value Also Matters"). A token adds its weight times its value to a head's output: tokens that draw
    attention with small values (as sinks do) change the output little, and mass alone ranks them too high."""

    name = "snapkv"
    value_weighted = False  # what a selector saved (pickled) before the option existed did

    def __init__(self, kernel_size: int = 7, pooling: str = "max", group_reduce: str = "mean",
                 value_weighted: bool = False):
        _check_snapkv_options(kernel_size, group_reduce, value_weighted)
        self.kernel_size, self.group_reduce, self.value_weighted = kernel_size, group_reduce, value_weighted
        check_choice("pooling", pooling, ("max", "avg"))
        self.pooling = pooling

    needs_values = property(lambda self: self.value_weighted)

    def score(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None,
              lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        return _window_scores(self, queries, keys, window, scale, lengths, self.kernel_size, self.pooling, values)

    def __repr__(self):
        # Only a value-weighted selector names the option: the reprs of the others stay what results recorded.
        return (f"SnapKVSelector(kernel_size={self.kernel_size}, pooling={self.pooling!r}, "
                f"group_reduce={self.group_reduce!r}" + (", value_weighted=True" if self.value_weighted else "") + ")")


class PeakSpanSelector(ScoredSelector):
    """Attention sinks, a recent region each KV head sizes from its own window's attention, and the scored slots
    split between isolated peaks and contiguous spans. RippleKV's default selector.

    Of a head's ``budget - window`` slots beyond the window: the first ``sink`` go to the first positions; of the
    ``rest`` after them, the share kept by position (just before the window) is the share of the head's max-pooled
    SnapKV score mass (after the sinks) that falls on its ``rest`` most recent positions; of the slots left,
    ``floor(peak_share * slots)`` go to the best max-pooled scores (an isolated peak, such as a passkey, keeps its
    height) and the others to the best scores average-pooled over the same ``kernel_size`` (a run of tokens a
    continuation reads together outranks one token between unread ones). ``value_weighted`` (on by default) weighs
    each position's attention by its value's norm, as ``SnapKVSelector``'s option does.

    A head whose window reads mostly the newest tokens (running text) keeps them by position, which beats SnapKV's
    scores on continuation fidelity; a head whose window reads far back (a question about a needle) keeps what it
    reads. Every choice here was measured against the alternatives on calibration prompts of both models
    (experiments/defaults/).
    """

    name = "peak-span"
    value_weighted = False  # what a selector saved (pickled) before the option existed did

    def __init__(self, peak_share: float = DEFAULT_PEAK_SHARE, sink: int = 4, kernel_size: int = 7,
                 group_reduce: str = "mean", value_weighted: bool = DEFAULT_VALUE_WEIGHTED):
        _check_snapkv_options(kernel_size, group_reduce, value_weighted)
        self.kernel_size, self.group_reduce, self.value_weighted = kernel_size, group_reduce, value_weighted
        self.peak_share = check_fraction("peak_share", peak_share)
        self.sink = check_int("sink", sink, 0)

    needs_values = property(lambda self: self.value_weighted)

    def score(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None,
              lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        """The max-pooled scores (the peaks' ranking, and the mass the recent region is sized from)."""
        return _window_scores(self, queries, keys, window, scale, lengths, self.kernel_size, "max", values)

    def protected_positions(self, scores: Tensor, free: Tensor, start: Tensor) -> Tensor:
        """Bool ``[B, H_kv, P]``: the positions kept by position, not by score: each row's first ``sink`` real
        positions (row ``b``'s first real position is ``start[b]``) and its recent region, sized from ``scores``
        (``[B, H_kv, P]``, -inf at pad positions) under ``free[b]`` slots beyond the window (int64 ``[B]``)."""
        n_prefix = scores.shape[-1]
        sink = free.clamp(max=self.sink)
        rest = (free - sink).clamp(min=0)
        position = torch.arange(n_prefix, device=scores.device)[None, None, :]
        mass = scores.nan_to_num(neginf=0.0).clamp(min=0)  # pad positions score -inf and hold no mass
        body = mass.masked_fill(position < (start + sink)[:, None, None], 0.0).sum(-1, dtype=torch.float64)
        tail = mass.masked_fill(position < (n_prefix - rest)[:, None, None], 0.0).sum(-1, dtype=torch.float64)
        share = torch.where(body > 0, tail / body, torch.zeros_like(body)).clamp(0.0, 1.0)
        recent = torch.floor(share * rest[:, None]).long()  # [B, H_kv], at most rest
        return ((position >= start[:, None, None]) & (position < (start + sink)[:, None, None])) | (
            position >= n_prefix - recent[..., None])

    def _ranking(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float], budgets,
                 lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        """Scores for ``select_topk`` (``select_topk_rows`` with ``lengths``; ``budgets`` an int without them, else
        int64 ``[B]``): the protected positions and each head's peaks at ``+inf``, every other position at its span
        score. Pad positions score -inf in both: never protected, never a peak (a row's real positions outnumber its
        slots whenever it is compressed), never kept."""
        # One scoring of the window (group reduction first), pooled both ways as the op pools.
        unpooled = _window_scores(self, queries, keys, window, scale, lengths, 1, "max", values)
        peaks, spans = _pool(unpooled, self.kernel_size, "max"), _pool(unpooled, self.kernel_size, "avg")
        free, start = free_slots_and_starts(keys, budgets, window, lengths)
        protected = self.protected_positions(peaks, free, start)
        slots = (free[:, None] - protected.sum(-1)).clamp(min=0)
        n_peaks = torch.floor(self.peak_share * slots.double()).long()  # [B, H_kv]
        # Rank of each unprotected position by its peak score; a stable sort gives ties to the lower position.
        order = torch.sort(peaks.masked_fill(protected, -math.inf), dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                .expand_as(order))
        return spans.masked_fill(protected | (rank < n_peaks[..., None]), math.inf)

    def select(self, queries: Tensor, keys: Tensor, budget: int, window: int,
               scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        return select_topk(self._ranking(queries, keys, window, scale, budget, values=values), budget, window)

    def select_rows(self, queries: Tensor, keys: Tensor, budgets: Tensor, lengths: Tensor, window: int,
                    scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        # Rows kept whole (n_b <= budget) never read their scores; compressed rows' protected slots are real ones.
        return select_topk_rows(self._ranking(queries, keys, window, scale, budgets, lengths, values), budgets,
                                window, lengths)

    def __repr__(self):
        return (f"PeakSpanSelector(peak_share={self.peak_share:g}, sink={self.sink}, kernel_size={self.kernel_size}, "
                f"group_reduce={self.group_reduce!r}" + (", value_weighted=True" if self.value_weighted else "") + ")")


class KeyNormSelector(ScoredSelector):
    """Keeps the keys of smallest L2 norm (Devoto et al., 2024: low-norm keys draw the most attention), plus the
    window. It reads no query, so it scores a context before any question is known (``compress_context``)."""

    name = "keynorm"

    def score(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None,
              lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        if keys.dim() != 4:
            raise ValueError(f"keys must be 4-D [B, H_kv, N, D], got {keys.dim()}-D")
        n = keys.shape[2]
        scores = -torch.linalg.vector_norm(keys[:, :, : max(n - window, 0)].float(), dim=-1)
        if lengths is not None:  # pad positions score -inf, as the scoring ops give them
            start = n - lengths.to(keys.device)
            pad = torch.arange(scores.shape[-1], device=keys.device)[None, :] < start[:, None]
            scores = scores.masked_fill(pad[:, None, :], -math.inf)
        return scores.contiguous()

    def __repr__(self):
        return "KeyNormSelector()"


class H2OSelector(ScoredSelector):
    """Top tokens by attention mass accumulated over *all* prompt queries (H2O), plus the window."""

    name = "h2o"
    needs_all_queries = True

    def __init__(self, chunk_size: int = 1024, group_reduce: str = "mean"):
        check_int("chunk_size", chunk_size, 1)
        check_choice("group_reduce", group_reduce, ("mean", "max"))
        self.chunk_size, self.group_reduce = chunk_size, group_reduce

    def score(self, queries: Tensor, keys: Tensor, window: int, scale: Optional[float] = None,
              lengths: Optional[Tensor] = None, values: Optional[Tensor] = None) -> Tensor:
        _check_queries(queries, keys)
        n = keys.shape[2]
        if queries.shape[2] != n:
            raise ValueError(f"H2O needs the queries of every prompt position: queries dim 2 must be N = {n}, "
                             f"got {queries.shape[2]}")
        scores = h2o_scores(queries, keys, chunk_size=self.chunk_size, scale=scale, group_reduce=self.group_reduce,
                            lengths=lengths)
        return scores[..., : n - window].contiguous()

    def __repr__(self):
        return f"H2OSelector(chunk_size={self.chunk_size}, group_reduce={self.group_reduce!r})"


class StreamingLLMSelector(Selector):
    """The first ``sink`` positions (attention sinks) and the most recent ``budget - sink`` (StreamingLLM)."""

    name = "streamingllm"

    def __init__(self, sink: int = 4):
        self.sink = check_int("sink", sink, 0)

    def select(self, queries: Tensor, keys: Tensor, budget: int, window: int,
               scale: Optional[float] = None, values: Optional[Tensor] = None) -> Tensor:
        b, h, n, _ = keys.shape
        return streaming_indices(n, budget, sink=self.sink, batch=b, heads=h, device=keys.device)

    def __repr__(self):
        return f"StreamingLLMSelector(sink={self.sink})"
