"""The selectors (ripplekv_ext.selection.selectors) on their own: hand-worked selections and what each needs of its
queries; PeakSpanSelector and KeyNormSelector against their references (ripplekv_ref.selectors, written position by
position) and against independent facts. Every selector under every allocator, against the reference ops:
test_policies.py. The variants the default was chosen against are tested where they live, in experiments/defaults/."""

import math

import pytest
import torch

from ripplekv_ext import KVCompressor, Policy, UniformAllocator
from ripplekv_ext.methods import make_policy
from ripplekv_ext.selection.selectors import (H2OSelector, KeyNormSelector, PeakSpanSelector, SnapKVSelector,
                                              StreamingLLMSelector)
from ripplekv_ref import select_topk, select_topk_rows
from ripplekv_ref.selectors import (adaptive_recent_select, key_norm_scores, peak_span_select, peak_span_select_rows,
                                   window_scores)
from policy_samples import qkv


def test_snapkv_keeps_the_key_the_window_attends_to():
    # Hand-worked: keys are zero except position 5, which is aligned with every window query, so all window
    # attention mass lands on it; with room for one prefix token and no pooling, SnapKV keeps position 5.
    n, w, d = 40, 4, 8
    q = torch.zeros(1, 2, n, d)
    q[..., 0] = 10.0
    k = torch.zeros(1, 1, n, d)
    k[0, 0, 5, 0] = 1.0
    idx = SnapKVSelector(kernel_size=1).select(q, k, budget=w + 1, window=w)
    assert idx.tolist() == [[[5, 36, 37, 38, 39]]]
    # Max pooling (kernel 7) spreads the peak over positions 2..8; the tie goes to the lowest position.
    idx = SnapKVSelector(kernel_size=7).select(q, k, budget=w + 1, window=w)
    assert idx.tolist() == [[[2, 36, 37, 38, 39]]]


def test_h2o_keeps_the_key_every_query_attends_to():
    n, w, d = 30, 4, 8
    q = torch.zeros(1, 1, n, d)
    q[..., 0] = 10.0
    k = torch.zeros(1, 1, n, d)
    k[0, 0, 2, 0] = 1.0
    idx = H2OSelector().select(q, k, budget=w + 1, window=w)
    assert idx.tolist() == [[[2, 26, 27, 28, 29]]]


def test_streamingllm_hand_worked():
    _, k = qkv(b=1, h_kv=1, n=10)
    idx = StreamingLLMSelector(sink=4).select(None, k, budget=6, window=2)
    assert idx.tolist() == [[[0, 1, 2, 3, 8, 9]]]


def test_h2o_needs_every_query():
    q, k = qkv(n=40)
    with pytest.raises(ValueError, match=r"queries dim 2 must be N = 40, got 8"):
        H2OSelector().select(q[:, :, -8:], k, budget=16, window=8)


def test_snapkv_needs_the_window():
    q, k = qkv(n=40)
    with pytest.raises(ValueError, match=r"at least window = 8 positions, got 4"):
        SnapKVSelector().select(q[:, :, -4:], k, budget=16, window=8)


# ---- PeakSpanSelector: sinks, a recent region sized by each head's window attention, peaks and spans ----------

RECENT_WINDOW = 8


def _inputs(batch=2, n=96, h_q=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h_q, RECENT_WINDOW, d, generator=g), torch.randn(batch, h_kv, n, d, generator=g))


def _window_reading(positions, n=120, d=8):
    """One head whose window queries attend (almost) only to ``positions``: keys there align with the queries."""
    q = torch.zeros(1, 1, RECENT_WINDOW, d)
    q[..., 0] = 30.0
    k = torch.zeros(1, 1, n, d)
    k[0, 0, positions, 0] = 1.0
    return q, k


@pytest.mark.parametrize("budget", [RECENT_WINDOW, RECENT_WINDOW + 1, RECENT_WINDOW + 3, 20, 47, 95])
@pytest.mark.parametrize("peak_share", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("sharpness", [0.5, 3.0])
def test_peak_span_select_matches_the_reference(budget, peak_share, sharpness):
    q, k = _inputs(seed=budget)
    q = q * sharpness
    got = PeakSpanSelector(peak_share, sink=4, value_weighted=False).select(q, k, budget, RECENT_WINDOW)
    assert torch.equal(got, peak_span_select(q, k, budget, RECENT_WINDOW, peak_share, sink=4))


def test_peak_span_select_rows_match_the_reference_for_a_left_padded_batch():
    selector = PeakSpanSelector(0.5, sink=4, value_weighted=False)
    lengths = torch.tensor([96, 70, 9, 0, 40, 25])
    budgets = torch.tensor([30, 30, 30, 30, 12, 25])
    q, k = _inputs(batch=len(lengths), seed=11)
    got = selector.select_rows(q * 2, k, budgets, lengths, RECENT_WINDOW)
    assert torch.equal(got, peak_span_select_rows(q * 2, k, budgets, lengths, RECENT_WINDOW, 0.5, 4))
    for row in (0, 1, 4):  # a row alone gives its own selection
        n = int(lengths[row])
        alone = selector.select(q[row:row + 1] * 2, k[row:row + 1, :, 96 - n:], int(budgets[row]),
                                RECENT_WINDOW) + 96 - n
        assert torch.equal(got[row:row + 1, :, got.shape[2] - alone.shape[2]:], alone)


@pytest.mark.parametrize("budget", [20, 47])
def test_peak_span_at_its_ends_is_protection_plus_snapkv_or_averaged_snapkv(budget):
    q, k = _inputs(seed=3)
    # Every scored slot a peak: the recent region and SnapKV's max-pooled scores for the rest, position for position.
    assert torch.equal(PeakSpanSelector(1.0, value_weighted=False).select(q, k, budget, RECENT_WINDOW),
                       adaptive_recent_select(q, k, budget, RECENT_WINDOW, 4))
    # No peaks, no sinks, and a window that reads only far back (no recent region): SnapKV with averaged scores.
    far_q, far_k = _window_reading(list(range(30, 40)))
    assert torch.equal(PeakSpanSelector(0.0, sink=0, value_weighted=False).select(far_q, far_k, budget, RECENT_WINDOW),
                       SnapKVSelector(pooling="avg").select(far_q, far_k, budget, RECENT_WINDOW))


def test_peak_span_through_a_policy_and_its_options():
    policy = make_policy("ripplekv+peak-span", 0.25, window=RECENT_WINDOW, profile=[1.0, 2.0, 3.0])
    assert isinstance(policy.selector, PeakSpanSelector) and policy.name == "ripplekv+peak-span@0.25"
    assert policy.selector.needs_values and repr(policy.selector).endswith("value_weighted=True)")
    unweighted = PeakSpanSelector(value_weighted=False)
    assert not unweighted.needs_values
    assert repr(unweighted) == "PeakSpanSelector(peak_share=0.5, sink=4, kernel_size=7, group_reduce='mean')"
    for options, match in (({"peak_share": 1.5}, "peak_share must be a number in"),
                           ({"peak_share": True}, "peak_share must be a number in"),
                           ({"peak_share": "0.5"}, "peak_share must be a number in"), ({"sink": -1}, "sink"),
                           ({"kernel_size": 4}, "kernel_size must be odd"),
                           ({"value_weighted": 1}, "value_weighted must be True or False")):
        with pytest.raises((ValueError, TypeError), match=match):
            PeakSpanSelector(**options)


# ---- Value-weighted scores: each position's attention mass times its value's norm, then pooled --------------------

def _values(like, seed=0):
    """Values whose norms spread over two orders of magnitude (as a model's do: sinks' values are near zero)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(like.shape, generator=g)
    return v * torch.exp(3 * torch.rand(*like.shape[:3], 1, generator=g) - 2)


VALUE_WEIGHTED = {  # kind: (weighted selector, its reference, the same selector unweighted)
    "snapkv": (SnapKVSelector(value_weighted=True),
               lambda q, k, budget, v: select_topk(window_scores(q, k, v), budget, RECENT_WINDOW), SnapKVSelector()),
    "snapkv-avg": (SnapKVSelector(pooling="avg", value_weighted=True),
                   lambda q, k, budget, v: select_topk(window_scores(q, k, v, pooling="avg"), budget, RECENT_WINDOW),
                   SnapKVSelector(pooling="avg")),
    "peak-span": (PeakSpanSelector(0.5, value_weighted=True),
                  lambda q, k, budget, v: peak_span_select(q, k, budget, RECENT_WINDOW, 0.5, values=v),
                  PeakSpanSelector(0.5, value_weighted=False)),
}


@pytest.mark.parametrize("kind", list(VALUE_WEIGHTED))
@pytest.mark.parametrize("budget", [RECENT_WINDOW + 1, 20, 47, 95])
def test_value_weighted_selectors_match_the_reference(kind, budget):
    selector, reference, unweighted = VALUE_WEIGHTED[kind]
    q, k = _inputs(seed=budget)
    v = _values(k, seed=budget)
    got = selector.select(q * 2, k, budget, RECENT_WINDOW, values=v)
    assert torch.equal(got, reference(q * 2, k, budget, v))
    if budget == 20:  # the weighting moves the selection (else this could not tell weighted from plain scores)
        assert not torch.equal(got, unweighted.select(q * 2, k, budget, RECENT_WINDOW))


@pytest.mark.parametrize("sink", [4, 0])  # without sinks, pooling reads the pads next to a row's first tokens
def test_value_weighted_rows_match_the_reference_and_each_row_alone(sink):
    lengths = torch.tensor([96, 70, 9, 0, 40, 25])
    budgets = torch.tensor([30, 30, 30, 30, 12, 25])
    q, k = _inputs(batch=len(lengths), seed=12)
    v = _values(k, seed=12)
    for row, n in enumerate(lengths.tolist()):  # zero values at the pads: a pad must not score 0 * -inf = NaN
        v[row, :, :96 - n] = 0.0
    selector = PeakSpanSelector(0.5, sink=sink, value_weighted=True)
    got = selector.select_rows(q * 2, k, budgets, lengths, RECENT_WINDOW, values=v)
    assert torch.equal(got, peak_span_select_rows(q * 2, k, budgets, lengths, RECENT_WINDOW, 0.5, sink, values=v))
    for row in (0, 1, 4):
        n = int(lengths[row])
        alone = selector.select(q[row:row + 1] * 2, k[row:row + 1, :, 96 - n:], int(budgets[row]), RECENT_WINDOW,
                                values=v[row:row + 1, :, 96 - n:]) + 96 - n
        assert torch.equal(got[row:row + 1, :, got.shape[2] - alone.shape[2]:], alone)


@pytest.mark.parametrize("budget", [20, 47])
def test_values_of_one_norm_change_nothing(budget):
    # Scaling every score of a head by one number keeps its ranking and its recent share: the unweighted selection.
    q, k = _inputs(seed=5)
    v = torch.nn.functional.normalize(torch.randn(k.shape), dim=-1) * 3.0
    for weighted, plain in ((PeakSpanSelector(value_weighted=True), PeakSpanSelector(value_weighted=False)),
                            (SnapKVSelector(value_weighted=True), SnapKVSelector())):
        assert torch.equal(weighted.select(q, k, budget, RECENT_WINDOW, values=v),
                           plain.select(q, k, budget, RECENT_WINDOW))


def test_a_read_token_with_a_null_value_gives_way():
    # Hand-worked: the window reads positions 30 and 60 alike; position 30's value is zero, so it adds nothing to
    # the head's output and the weighted selector keeps 60 alone, where attention mass alone keeps both.
    n = 120
    q, k = _window_reading([30, 60], n)
    v = torch.ones(1, 1, n, 8)
    v[0, 0, 30] = 0.0
    budget = RECENT_WINDOW + 1
    assert SnapKVSelector(kernel_size=1).select(q, k, budget + 1, RECENT_WINDOW)[0, 0, :2].tolist() == [30, 60]
    assert SnapKVSelector(kernel_size=1, value_weighted=True).select(q, k, budget, RECENT_WINDOW,
                                                                     values=v)[0, 0, 0].item() == 60


def test_a_selector_saved_before_value_weighting_loads_unweighted():
    # A pickled selector restores its __dict__ without __init__: one saved before the option has no value_weighted.
    import pickle

    old = PeakSpanSelector(value_weighted=False)
    del old.__dict__["value_weighted"]
    loaded = pickle.loads(pickle.dumps(old))
    assert not loaded.needs_values and repr(loaded) == repr(PeakSpanSelector(value_weighted=False))
    q, k = _inputs()
    assert torch.equal(loaded.select(q, k, 20, RECENT_WINDOW),
                       PeakSpanSelector(value_weighted=False).select(q, k, 20, RECENT_WINDOW))


def test_value_weighted_needs_the_values():
    q, k = _inputs()
    for values, match in ((None, "values= must have the keys' shape"), (k[:, :, :-1], "got \\[2, 2, 95, 16\\]")):
        with pytest.raises(ValueError, match=match):
            PeakSpanSelector(value_weighted=True).select(q, k, 20, RECENT_WINDOW, values=values)
    compressor = KVCompressor(Policy(UniformAllocator(), PeakSpanSelector(value_weighted=True), 0.25,
                                     window=RECENT_WINDOW), 1)
    with pytest.raises(ValueError, match="reads the layer's values: pass values="):
        compressor.select(0, q, k)
    kept_keys, kept_values = compressor.compress(0, q, k, _values(k))
    assert kept_keys.shape[2] == 24 and kept_values.shape == kept_keys.shape


# ---- KeyNormSelector: the smallest-norm keys ---------------------------------------------------------------------

NORM_WINDOW = 4


def _keys(batch=2, h_kv=2, n=40, d=8, seed=0):
    return torch.randn(batch, h_kv, n, d, generator=torch.Generator().manual_seed(seed))


def test_scores_match_the_reference():
    keys = _keys()
    torch.testing.assert_close(KeyNormSelector().score(None, keys, NORM_WINDOW), key_norm_scores(keys, NORM_WINDOW))


def test_select_keeps_the_smallest_norms_and_the_window():
    keys = _keys(seed=1)
    for budget in (NORM_WINDOW, 10, 39):
        got = KeyNormSelector().select(None, keys, budget, NORM_WINDOW)
        assert torch.equal(got, select_topk(key_norm_scores(keys, NORM_WINDOW), budget, NORM_WINDOW))
    # An independent fact: scale one key down and it is kept.
    keys[0, 1, 7] *= 1e-3
    assert 7 in KeyNormSelector().select(None, keys, NORM_WINDOW + 1, NORM_WINDOW)[0, 1].tolist()


def test_rows_score_pads_minus_inf_and_match_the_reference():
    keys = _keys(batch=3, seed=2)
    lengths, budgets = torch.tensor([40, 12, 3]), torch.tensor([10, 8, 10])
    scores = KeyNormSelector().score(None, keys, NORM_WINDOW, lengths=lengths)
    reference = key_norm_scores(keys, NORM_WINDOW, lengths)
    assert torch.isneginf(scores[1, :, :28]).all() and torch.equal(torch.isinf(scores), torch.isinf(reference))
    torch.testing.assert_close(scores[torch.isfinite(scores)], reference[torch.isfinite(reference)])
    got = KeyNormSelector().select_rows(None, keys, budgets, lengths, NORM_WINDOW)
    assert torch.equal(got, select_topk_rows(reference, budgets, NORM_WINDOW, lengths))


def test_a_policy_with_it_needs_no_queries():
    policy = Policy(UniformAllocator(), KeyNormSelector(), 0.25, window=NORM_WINDOW)
    assert not policy.selector.needs_all_queries and policy.name == "uniform+keynorm@0.25"
    with pytest.raises(ValueError, match="keys must be 4-D"):
        KeyNormSelector().score(None, torch.zeros(3, 4), NORM_WINDOW)
    assert math.isinf(KeyNormSelector().score(None, _keys(batch=1, n=6), NORM_WINDOW,
                                              lengths=torch.tensor([3]))[0, 0, 0].item())
