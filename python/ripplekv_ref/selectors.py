"""Reference of the selectors that are more than one op: written position by position, for clarity."""

import math

import torch
from torch import Tensor

from ripplekv_ref.snapkv_scores import snapkv_scores


def window_scores(q_window: Tensor, keys: Tensor, values=None, kernel_size: int = 7, pooling: str = "max",
                  group_reduce: str = "mean", scale=None) -> Tensor:
    """SnapKV's scores of the positions before the window (``snapkv_scores``); with ``values`` (``value_weighted``),
    each position's unpooled attention mass times its value's L2 norm, then pooled position by position: the max,
    or the sum over ``kernel_size`` (zero padding counted), of the weighted masses within ``kernel_size // 2``."""
    if values is None:
        return snapkv_scores(q_window, keys, kernel_size, pooling, group_reduce, scale)
    mass = snapkv_scores(q_window, keys, 1, "max", group_reduce, scale)
    n_prefix = mass.shape[-1]
    weighted = mass * values[:, :, :n_prefix].float().norm(dim=-1)
    half = kernel_size // 2
    out = torch.empty_like(weighted)
    for p in range(n_prefix):
        near = weighted[..., max(p - half, 0):p + half + 1]
        out[..., p] = near.amax(-1) if pooling == "max" else near.sum(-1) / kernel_size
    return out


def _keep_protected(head_scores, n: int, window: int, budget: int, sinks: int, recent: int) -> Tensor:
    """One head's kept positions, ascending: ``sinks`` first positions, ``recent`` positions just before the window,
    the window, and the best ``head_scores`` in between for the remaining slots (ties to the lower position)."""
    n_prefix = n - window
    kept = set(range(sinks)) | set(range(n_prefix - recent, n))
    middle = [p for p in range(n_prefix) if p not in kept]
    middle.sort(key=lambda p: (-float(head_scores[p]), p))
    kept.update(middle[:budget - len(kept)])
    return torch.tensor(sorted(kept))


def _select_with_recency(q_window: Tensor, keys: Tensor, budget: int, window: int, sink: int, recent_of,
                         values=None, **snapkv_options) -> Tensor:
    """Both recent selectors: every position when ``budget >= N``; else, per head, ``sinks = min(sink, budget -
    window)`` sinks and ``recent_of(head's SnapKV scores before the window, sinks, rest)`` recent positions, with
    ``rest = budget - window - sinks``, kept by ``_keep_protected``."""
    b, h, n, _ = keys.shape
    if budget >= n:
        return torch.arange(n).expand(b, h, n).clone()
    scores = window_scores(q_window[:, :, -window:], keys, values, **snapkv_options)
    sinks = min(sink, budget - window)
    rest = budget - window - sinks
    out = torch.empty(b, h, budget, dtype=torch.int64)
    for row in range(b):
        for head in range(h):
            recent = recent_of(scores[row, head], sinks, rest)
            out[row, head] = _keep_protected(scores[row, head], n, window, budget, sinks, recent)
    return out


def recent_snapkv_select(q_window: Tensor, keys: Tensor, budget: int, window: int, recent_fraction: float,
                         sink: int = 4, kernel_size: int = 7, pooling: str = "max", group_reduce: str = "mean",
                         scale=None, values=None) -> Tensor:
    """Positions kept per KV head by SnapKV with sinks and a recent region (``RecentSnapKVSelector``), ascending.

    Of the ``budget - window`` slots before the window: ``min(sink, budget - window)`` sinks (the first positions),
    ``floor(recent_fraction * (budget - window - sinks))`` recent positions (just before the window), and the rest
    the best SnapKV scores among the positions in between (ties to the lower position). ``budget >= N`` keeps all.
    """
    return _select_with_recency(q_window, keys, budget, window, sink,
                                lambda head_scores, sinks, rest: math.floor(recent_fraction * rest), values,
                                kernel_size=kernel_size, pooling=pooling, group_reduce=group_reduce, scale=scale)


def _each_row_alone(select_one, q_window: Tensor, keys: Tensor, budgets, lengths, window: int,
                    values=None) -> Tensor:
    """``select_one(row_queries, row_keys, budget, row_values)`` on each row of a left-padded batch alone: row
    ``b``'s kept positions (padded layout) in its last slots, ``-1`` before them, as ``select_topk_rows`` lays them
    out. ``row_values`` is None without ``values``."""
    b, h, n, _ = keys.shape
    budgets, lengths = [int(x) for x in budgets], [int(x) for x in lengths]
    kept = [min(budget, length) for budget, length in zip(budgets, lengths)]
    out = torch.full((b, h, max(kept, default=0)), -1, dtype=torch.int64)
    for row, (length, budget, c) in enumerate(zip(lengths, budgets, kept)):
        if c == 0:
            continue
        start = n - length
        row_q = q_window[row:row + 1, :, -min(window, length):] if length < window else q_window[row:row + 1]
        positions = (torch.arange(length).expand(1, h, length) if budget >= length else
                     select_one(row_q, keys[row:row + 1, :, start:], budget,
                                None if values is None else values[row:row + 1, :, start:]))
        out[row, :, out.shape[2] - c:] = positions[0] + start
    return out


def recent_snapkv_select_rows(q_window: Tensor, keys: Tensor, budgets, lengths, window: int, recent_fraction: float,
                              sink: int = 4, values=None, **options) -> Tensor:
    """``recent_snapkv_select`` on each row of a left-padded batch alone (``_each_row_alone``)."""
    return _each_row_alone(lambda q, k, budget, v: recent_snapkv_select(q, k, budget, window, recent_fraction, sink,
                                                                       values=v, **options),
                           q_window, keys, budgets, lengths, window, values)


def _adaptive_recent(head_scores, sinks: int, rest: int) -> int:
    """``AdaptiveRecentSelector``'s recent positions for one head: ``floor(share * rest)``, ``share`` the part of the
    head's score mass after its ``sinks`` that lies on its last ``rest`` positions."""
    mass = [float(score) for score in head_scores]
    body = sum(mass[sinks:])
    tail = sum(mass[len(mass) - rest:]) if rest else 0.0
    share = min(tail / body, 1.0) if body > 0 else 0.0
    return math.floor(share * rest)


def adaptive_recent_select(q_window: Tensor, keys: Tensor, budget: int, window: int, sink: int = 4,
                           kernel_size: int = 7, pooling: str = "max", group_reduce: str = "mean",
                           scale=None, values=None) -> Tensor:
    """Positions kept per KV head by ``AdaptiveRecentSelector``, ascending.

    Of the ``free = budget - window`` slots before the window: ``sinks = min(sink, free)`` sinks (the first
    positions); then, with ``rest = free - sinks``, the head's share of its SnapKV score mass over the positions
    after the sinks that lies on the last ``rest`` of them, ``floor(share * rest)`` recent positions (just before
    the window); the best SnapKV scores in between take the remaining slots (ties to the lower position).
    """
    return _select_with_recency(q_window, keys, budget, window, sink, _adaptive_recent, values,
                                kernel_size=kernel_size, pooling=pooling, group_reduce=group_reduce, scale=scale)


def adaptive_recent_select_rows(q_window: Tensor, keys: Tensor, budgets, lengths, window: int, sink: int = 4,
                                values=None, **options) -> Tensor:
    """``adaptive_recent_select`` on each row of a left-padded batch alone (``_each_row_alone``)."""
    return _each_row_alone(lambda q, k, budget, v: adaptive_recent_select(q, k, budget, window, sink, values=v,
                                                                         **options),
                           q_window, keys, budgets, lengths, window, values)


def peak_span_select(q_window: Tensor, keys: Tensor, budget: int, window: int, peak_share: float, sink: int = 4,
                     kernel_size: int = 7, group_reduce: str = "mean", scale=None, values=None) -> Tensor:
    """Positions kept per KV head by ``PeakSpanSelector``, ascending.

    The sinks and the recent region of ``adaptive_recent_select`` (sized from the max-pooled SnapKV scores); then,
    of the ``slots`` left, ``floor(peak_share * slots)`` positions with the best max-pooled scores, and the rest of
    the budget the best average-pooled scores among the positions not yet kept (ties to the lower position, both
    times). ``budget >= N`` keeps all. ``values``: the scores weighted by the values' norms (``window_scores``).
    """
    b, h, n, _ = keys.shape
    if budget >= n:
        return torch.arange(n).expand(b, h, n).clone()
    options = dict(kernel_size=kernel_size, group_reduce=group_reduce, scale=scale)
    peaks = window_scores(q_window[:, :, -window:], keys, values, pooling="max", **options)
    spans = window_scores(q_window[:, :, -window:], keys, values, pooling="avg", **options)
    n_prefix = n - window
    sinks = min(sink, budget - window)
    rest = budget - window - sinks
    out = torch.empty(b, h, budget, dtype=torch.int64)
    for row in range(b):
        for head in range(h):
            recent = _adaptive_recent(peaks[row, head], sinks, rest)
            kept = set(range(sinks)) | set(range(n_prefix - recent, n_prefix))
            n_peaks = math.floor(peak_share * (budget - window - len(kept)))
            for scores, count in ((peaks, n_peaks), (spans, None)):
                ranked = sorted((p for p in range(n_prefix) if p not in kept),
                                key=lambda p: (-float(scores[row, head, p]), p))
                kept.update(ranked[:budget - window - len(kept) if count is None else count])
            out[row, head] = torch.tensor(sorted(kept | set(range(n_prefix, n))))
    return out


def peak_span_select_rows(q_window: Tensor, keys: Tensor, budgets, lengths, window: int, peak_share: float,
                          sink: int = 4, values=None, **options) -> Tensor:
    """``peak_span_select`` on each row of a left-padded batch alone (``_each_row_alone``)."""
    return _each_row_alone(lambda q, k, budget, v: peak_span_select(q, k, budget, window, peak_share, sink,
                                                                   values=v, **options),
                           q_window, keys, budgets, lengths, window, values)


def key_norm_scores(keys: Tensor, window: int, lengths=None) -> Tensor:
    """``KeyNormSelector``'s scores: minus each prefix key's L2 norm, ``[B, H_kv, N - window]`` float32; with
    ``lengths`` (a left-padded batch) a row's pad positions score ``-inf``."""
    b, h, n, d = keys.shape
    out = torch.empty(b, h, max(n - window, 0), dtype=torch.float32)
    for row in range(b):
        start = 0 if lengths is None else n - int(lengths[row])
        for head in range(h):
            for position in range(n - window):
                key = keys[row, head, position].double()
                out[row, head, position] = -float(math.sqrt(sum(x * x for x in key.tolist()))) \
                    if position >= start else -math.inf
    return out
