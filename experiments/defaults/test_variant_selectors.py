"""The selectors the default was chosen against (variant_selectors.py) against their references (ripplekv_ref.selectors,
written position by position) and against independent facts, so the experiments that cite them still measure what
they measured."""

import pytest
import torch

from ripplekv_ext import KVCompressor, PeakSpanSelector, Policy, SnapKVSelector, UniformAllocator, streaming_indices
from ripplekv_ref.selectors import (adaptive_recent_select, adaptive_recent_select_rows, recent_snapkv_select,
                                   recent_snapkv_select_rows)
from variant_selectors import METHODS, AdaptiveRecentSelector, RecentSnapKVSelector

WINDOW = 8


def _inputs(batch=2, n=96, h_q=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, h_q, WINDOW, d, generator=g), torch.randn(batch, h_kv, n, d, generator=g)


def _window_reading(positions, n=120, d=8):
    """One head whose window queries attend (almost) only to ``positions``: keys there align with the queries."""
    q = torch.zeros(1, 1, WINDOW, d)
    q[..., 0] = 30.0
    k = torch.zeros(1, 1, n, d)
    k[0, 0, positions, 0] = 1.0
    return q, k


def _values(like, seed=0):
    """Values whose norms spread over two orders of magnitude (as a model's do: sinks' values are near zero)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=g) * torch.exp(3 * torch.rand(*like.shape[:3], 1, generator=g) - 2)


# ---- RecentSnapKVSelector: sinks + a fixed recent share + SnapKV -------------------------------------------------

@pytest.mark.parametrize("budget", [WINDOW, WINDOW + 1, WINDOW + 3, 20, 47, 95])
@pytest.mark.parametrize("recent_fraction,sink", [(0.0, 0), (0.0, 4), (0.3, 4), (0.5, 4), (0.5, 0), (1.0, 4),
                                                  (0.75, 2)])
def test_recent_select_matches_the_reference(budget, recent_fraction, sink):
    q, k = _inputs(seed=budget)
    got = RecentSnapKVSelector(recent_fraction, sink).select(q, k, budget, WINDOW)
    assert torch.equal(got, recent_snapkv_select(q, k, budget, WINDOW, recent_fraction, sink))


def test_all_recent_is_streamingllm_and_nothing_protected_is_snapkv():
    q, k = _inputs(seed=5)
    for budget in (WINDOW + 4, 30, 60):
        streaming = streaming_indices(k.shape[2], budget, sink=4, batch=2, heads=2)
        assert torch.equal(RecentSnapKVSelector(1.0, sink=4).select(q, k, budget, WINDOW), streaming)
        assert torch.equal(RecentSnapKVSelector(0.0, sink=0).select(q, k, budget, WINDOW),
                           SnapKVSelector().select(q, k, budget, WINDOW))


@pytest.mark.parametrize("selector,reference", [
    (RecentSnapKVSelector(0.5, sink=4), lambda *a: recent_snapkv_select_rows(*a, 0.5, 4)),
    (AdaptiveRecentSelector(sink=4), lambda *a: adaptive_recent_select_rows(*a, 4))], ids=["recent", "adaptive"])
def test_select_rows_match_the_reference_and_each_row_alone(selector, reference):
    lengths = torch.tensor([96, 70, 9, 0, 40, 25])
    budgets = torch.tensor([30, 30, 30, 30, 12, 25])
    q, k = _inputs(batch=len(lengths), seed=7)
    got = selector.select_rows(q * 2, k, budgets, lengths, WINDOW)
    assert torch.equal(got, reference(q * 2, k, budgets, lengths, WINDOW))
    for row in (0, 1, 4):
        n = int(lengths[row])
        alone = selector.select(q[row:row + 1] * 2, k[row:row + 1, :, 96 - n:], int(budgets[row]), WINDOW) + 96 - n
        assert torch.equal(got[row:row + 1, :, got.shape[2] - alone.shape[2]:], alone)


@pytest.mark.parametrize("make,options,match", [
    (RecentSnapKVSelector, {"recent_fraction": 1.5}, "recent_fraction must be a number in"),
    (RecentSnapKVSelector, {"recent_fraction": True}, "recent_fraction must be a number in"),
    (RecentSnapKVSelector, {"sink": -1}, "sink"), (RecentSnapKVSelector, {"kernel_size": 4}, "kernel_size must be odd"),
    (AdaptiveRecentSelector, {"sink": -1}, "sink"), (AdaptiveRecentSelector, {"pooling": "min"}, "pooling must be")])
def test_bad_options_are_refused_when_built(make, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make(**options)


# ---- AdaptiveRecentSelector: PeakSpan's protection + SnapKV's scores ---------------------------------------------

@pytest.mark.parametrize("budget", [WINDOW, WINDOW + 1, WINDOW + 3, 20, 47, 95])
@pytest.mark.parametrize("sink", [0, 4])
@pytest.mark.parametrize("sharpness", [0.5, 3.0])
def test_adaptive_select_matches_the_reference(budget, sink, sharpness):
    q, k = _inputs(seed=budget + sink)
    q = q * sharpness  # flat and peaked window attention: small and large recent shares
    got = AdaptiveRecentSelector(sink).select(q, k, budget, WINDOW)
    assert torch.equal(got, adaptive_recent_select(q, k, budget, WINDOW, sink))
    assert torch.equal(got, PeakSpanSelector(1.0, sink=sink, value_weighted=False).select(q, k, budget, WINDOW))


def test_a_head_reading_its_newest_tokens_keeps_them_and_one_reading_far_back_keeps_what_it_reads():
    # Newest: the window reads only the 20 positions before it, nearly all its mass in the last 28 (= 40 - 8 - 4)
    # prefix positions: the head keeps the sinks and 27 of those 28 by position, the fixed share 27/28's selection.
    n, budget = 120, 40
    q, k = _window_reading(list(range(n - WINDOW - 20, n - WINDOW)), n)
    got = AdaptiveRecentSelector(sink=4).select(q, k, budget, WINDOW)[0, 0]
    assert set(range(4)) | set(range(n - WINDOW - 27, n)) <= set(got.tolist())
    assert torch.equal(RecentSnapKVSelector(27 / 28, sink=4).select(q, k, budget, WINDOW)[0, 0], got)
    # Far back: no recent slot is protected and every position read is kept (the fixed share of 0.75 gives them away).
    far = list(range(30, 40))
    q, k = _window_reading(far, n)
    assert set(far) <= set(AdaptiveRecentSelector(sink=4).select(q, k, budget, WINDOW)[0, 0].tolist())
    assert not set(far) <= set(RecentSnapKVSelector(0.75, sink=4).select(q, k, budget, WINDOW)[0, 0].tolist())


@pytest.mark.parametrize("kind,reference", [
    ("recent-snapkv", lambda q, k, budget, v: recent_snapkv_select(q, k, budget, WINDOW, 0.75, values=v)),
    ("adaptive-recent", lambda q, k, budget, v: adaptive_recent_select(q, k, budget, WINDOW, values=v))])
def test_value_weighted_variants_match_the_reference(kind, reference):
    q, k = _inputs(seed=20)
    v = _values(k, seed=20)
    weighted = METHODS[kind](value_weighted=True)
    got = weighted.select(q * 2, k, 20, WINDOW, values=v)
    assert torch.equal(got, reference(q * 2, k, 20, v))
    assert not torch.equal(got, METHODS[kind]().select(q * 2, k, 20, WINDOW))


def test_the_names_the_experiments_use_run_through_a_policy():
    q, k = _inputs(seed=9)
    for name, make in METHODS.items():
        selector = make()
        assert selector.name == ("peak-span" if name == "peak-span-unweighted" else name)
        comp = KVCompressor(Policy(UniformAllocator(), selector, 0.25, WINDOW), num_layers=1)
        keys_c, _ = comp.compress(0, q, k, k.clone())
        assert keys_c.shape[2] == comp.budgets(96)[0] == 24
    assert not METHODS["peak-span-unweighted"]().needs_values
