"""RecentSnapKVSelector: SnapKV with attention sinks and a recent region kept by position, against its reference
(ripplekv_ref.selectors, written position by position) and against independent facts (all recent = StreamingLLM
plus the window; nothing protected = SnapKV)."""

import pytest
import torch

from ripplekv_ext import KVCompressor, Policy, UniformAllocator
from ripplekv_ext.methods import make_policy
from ripplekv_ext.ops import streaming_indices
from ripplekv_ext.selectors import RecentSnapKVSelector, SnapKVSelector
from ripplekv_ref.selectors import recent_snapkv_select, recent_snapkv_select_rows

WINDOW = 8


def _inputs(batch=2, n=96, h_q=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h_q, WINDOW, d, generator=g), torch.randn(batch, h_kv, n, d, generator=g))


@pytest.mark.parametrize("budget", [WINDOW, WINDOW + 1, WINDOW + 3, 20, 47, 95])
@pytest.mark.parametrize("recent_fraction,sink", [(0.0, 0), (0.0, 4), (0.3, 4), (0.5, 4), (0.5, 0), (1.0, 4),
                                                  (0.75, 2)])
def test_select_matches_the_reference(budget, recent_fraction, sink):
    q, k = _inputs(seed=budget)
    got = RecentSnapKVSelector(recent_fraction, sink).select(q, k, budget, WINDOW)
    assert torch.equal(got, recent_snapkv_select(q, k, budget, WINDOW, recent_fraction, sink))


def test_sinks_and_recent_positions_are_always_kept():
    q, k = _inputs(n=200, seed=3)
    selector = RecentSnapKVSelector(0.5, sink=4)
    budget = 60
    kept = selector.select(q, k, budget, WINDOW)
    sink, recent = selector.protected(budget, WINDOW)
    assert (sink, recent) == (4, 24)  # floor(0.5 * (60 - 8 - 4))
    protected = set(range(4)) | set(range(200 - WINDOW - recent, 200))
    for row in kept.reshape(-1, budget).tolist():
        assert protected <= set(row) and len(set(row)) == budget and row == sorted(row)


def test_all_recent_is_streamingllm_and_nothing_protected_is_snapkv():
    q, k = _inputs(seed=5)
    for budget in (WINDOW + 4, 30, 60):
        streaming = streaming_indices(k.shape[2], budget, sink=4, batch=2, heads=2)
        assert torch.equal(RecentSnapKVSelector(1.0, sink=4).select(q, k, budget, WINDOW), streaming)
        assert torch.equal(RecentSnapKVSelector(0.0, sink=0).select(q, k, budget, WINDOW),
                           SnapKVSelector().select(q, k, budget, WINDOW))


def test_select_rows_matches_the_reference_for_a_left_padded_batch():
    lengths = torch.tensor([96, 70, 9, 0, 40, 25])
    budgets = torch.tensor([30, 30, 30, 30, 12, 25])
    q, k = _inputs(batch=len(lengths), seed=7)
    selector = RecentSnapKVSelector(0.5, sink=4)
    got = selector.select_rows(q, k, budgets, lengths, WINDOW)
    assert torch.equal(got, recent_snapkv_select_rows(q, k, budgets, lengths, WINDOW, 0.5, 4))
    # A row alone gives its own selection: the batch is each row as if alone.
    for row in (0, 1, 4):
        n = int(lengths[row])
        alone = selector.select(q[row:row + 1], k[row:row + 1, :, 96 - n:], int(budgets[row]), WINDOW) + 96 - n
        assert torch.equal(got[row:row + 1, :, got.shape[2] - alone.shape[2]:], alone)


def test_through_a_policy_and_the_compressor():
    policy = make_policy("uniform+recent-snapkv", 0.25, window=WINDOW)
    assert isinstance(policy.selector, RecentSnapKVSelector) and policy.name == "uniform+recent-snapkv@0.25"
    q, k = _inputs(seed=9)
    comp = KVCompressor(Policy(UniformAllocator(), RecentSnapKVSelector(), 0.25, WINDOW), num_layers=1)
    keys_c, values_c = comp.compress(0, q, k, k.clone())
    assert keys_c.shape[2] == comp.budgets(96)[0] == 24


@pytest.mark.parametrize("options,match", [({"recent_fraction": 1.5}, "recent_fraction must be a number in"),
                                           ({"recent_fraction": -0.1}, "recent_fraction must be a number in"),
                                           ({"recent_fraction": True}, "recent_fraction must be a number in"),
                                           ({"sink": -1}, "sink"), ({"kernel_size": 4}, "kernel_size must be odd")])
def test_bad_options_are_refused_when_built(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RecentSnapKVSelector(**options)
