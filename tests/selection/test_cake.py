"""CAKE (its budgets in ripplekv_ext.budgets.cake, its token score in ripplekv_ext.selection.cake): budgets, preference
and token score against hand computations on toy cases, its budgets under every selector, and its refusals."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv_ext import CakeAllocator, CakeSelector, KVCompressor, Policy, UniformAllocator
from ripplekv_ext.budgets.cake import cake_budgets, layer_preference
from ripplekv_ext.selection.cake import eviction_scores, window_attention
from ripplekv_ext.methods import make_policy
from ripplekv_ext.selection.selectors import SnapKVSelector


# --- budgets: the authors' adjust_budgets, by hand ----------------------------------------------------------

def test_budgets_split_the_prefix_total_by_preference_and_give_the_rounding_to_the_first_layers():
    # N=100, W=10, average 30: prefix total (30 - 10) x 3 = 60. int(1/8 x 60) = 7, int(2/8 x 60) = 15,
    # int(5/8 x 60) = 37: 59, one short, which goes to the first layer below its prefix (90): 8, 15, 37.
    assert cake_budgets([1.0, 2.0, 5.0], 100, 30, 10) == [18, 25, 47]


def test_budgets_over_a_layer_s_prefix_are_spread_evenly_over_the_others():
    # N=40, W=10, average 30: prefix 30, total 60. Shares 0, 0, 60: the last layer is capped at its prefix (30) and
    # its excess 30 spread evenly over the two layers below it, 15 each (not in proportion to their zero weights).
    assert cake_budgets([0.0, 0.0, 1.0], 40, 30, 10) == [25, 25, 40]
    # An odd excess: N=38, prefix 28, total 60 -> 0, 0, 28 and 32 over two layers: 16 each.
    assert cake_budgets([0.0, 0.0, 1.0], 38, 30, 10) == [26, 26, 38]


def test_budgets_of_equal_or_zero_preferences_are_equal_and_short_prompts_stay_whole():
    assert cake_budgets([2.0, 2.0, 2.0, 2.0], 200, 50, 8) == [50] * 4
    assert cake_budgets([0.0, 0.0], 200, 50, 8) == [50, 50]
    assert cake_budgets([1.0, 9.0], 40, 40, 8) == [40, 40]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=12), st.integers(2, 400), st.integers(1, 16), st.data())
def test_budgets_keep_the_total_within_each_layer_s_bounds(preferences, n, window, data):
    avg = data.draw(st.integers(window, max(window, n - 1)))
    budgets = cake_budgets(preferences, n, avg, window)
    assert len(budgets) == len(preferences)
    if n <= avg:
        assert budgets == [n] * len(preferences)
        return
    assert all(window <= b <= n for b in budgets)
    assert sum(budgets) == avg * len(preferences)


def test_budgets_refuse_bad_preferences():
    for bad in ([], [1.0, float("nan")], [-1.0, 2.0], [float("inf")]):
        with pytest.raises(ValueError, match="preferences must be finite numbers >= 0"):
            cake_budgets(bad, 100, 30, 10)


# --- the preference and the token score, by hand ------------------------------------------------------------

# One query head, a window of 2 over 4 keys (prefix: keys 0 and 1), as softmax rows the causal window allows.
TOY_ATTENTION = torch.tensor([[[[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]]]])


def test_preference_is_entropy_times_variance_of_the_prefix_columns():
    # Entropy over the prefix columns: -(0.5 ln 0.5 + 3 x 0.25 ln 0.25) = 2 ln 2. Variance across the two window
    # queries (unbiased): column 0 holds 0.5 and 0.25 -> 0.03125; column 1 holds 0.25 twice -> 0.
    entropy, variance = 2 * math.log(2), 0.03125
    assert layer_preference(TOY_ATTENTION) == pytest.approx(entropy * variance, rel=1e-5)
    assert layer_preference(TOY_ATTENTION, tau1=2.0, tau2=0.5) == pytest.approx(entropy ** 0.5 * variance ** 2,
                                                                                rel=1e-5)


def test_token_score_is_mean_plus_gamma_variance_pooled_over_five():
    # Mean over the window of the prefix columns: 0.375, 0.25; variance: 0.03125, 0. With gamma = 200:
    # 6.625, 0.25. Average pooling over 5 with zero padding counted: both positions see both values, / 5.
    scores = eviction_scores(TOY_ATTENTION, kv_heads=1, gamma=200.0)
    assert scores.shape == (1, 1, 2)
    assert torch.allclose(scores, torch.full((1, 1, 2), (6.625 + 0.25) / 5))
    # gamma 0 and two query heads sharing one KV head: the heads' pooled means averaged.
    two_heads = torch.cat([TOY_ATTENTION, TOY_ATTENTION.flip(-1).roll(1, -1)], dim=1)
    expected = (eviction_scores(two_heads[:, :1], 1, 0.0) + eviction_scores(two_heads[:, 1:], 1, 0.0)) / 2
    assert torch.allclose(eviction_scores(two_heads, 1, 0.0), expected)


def _authors_window_attention(queries, keys, window):
    """The authors' computation (modify_llama.py): repeated KV heads, logits / sqrt(D), an additive mask of the
    dtype's minimum over the window's upper triangle, softmax in fp32."""
    groups = queries.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    logits = queries[..., -window:, :] @ k.transpose(2, 3) / math.sqrt(queries.shape[-1])
    mask = torch.full((window, window), torch.finfo(logits.dtype).min)
    cond = torch.arange(window)
    mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    logits[:, :, -window:, -window:] += mask
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def test_window_attention_matches_the_authors_masking():
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    assert torch.allclose(window_attention(queries, keys, 8), _authors_window_attention(queries, keys, 8), atol=1e-6)


def test_selector_keeps_the_window_and_the_top_scored_prefix():
    g = torch.Generator().manual_seed(1)
    queries, keys = torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
    kept = CakeSelector().select(queries, keys, budget=20, window=8)
    scores = eviction_scores(_authors_window_attention(queries, keys, 8), 2)
    for head in range(2):
        top = set(scores[0, head].topk(12).indices.tolist())
        assert set(kept[0, head].tolist()) == top | set(range(52, 60))


def test_selector_scores_each_row_of_a_padded_batch_alone():
    g = torch.Generator().manual_seed(2)
    queries, keys = torch.randn(2, 2, 8, 16, generator=g), torch.randn(2, 1, 50, 16, generator=g)
    scores = CakeSelector().score(queries, keys, 8, lengths=torch.tensor([50, 30]))
    assert torch.equal(scores[0], CakeSelector().score(queries[:1], keys[:1], 8)[0])
    assert torch.equal(scores[1, :, 20:], CakeSelector().score(queries[1:], keys[1:, :, 20:], 8)[0])
    assert bool(scores[1, :, :20].isneginf().all())


# --- the compressor: budgets read from each layer's window --------------------------------------------------

def _windows(num_layers, n=120, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {layer: (torch.randn(1, 4, 8, 16, generator=g) * (1 + layer), torch.randn(1, 2, n, 16, generator=g), None)
            for layer in range(num_layers)}


def test_compressor_budgets_come_from_each_layer_s_preference():
    compressor = KVCompressor(Policy.cake(0.25, window=8, tau1=1.5, tau2=0.5), num_layers=4)
    windows = _windows(4)
    allocator = CakeAllocator(1.5, 0.5)
    preferences = [allocator.preference(q, k, 8) for q, k, _ in windows.values()]
    expected = cake_budgets(preferences, 120, 30, 8)
    assert compressor.attention_budgets(windows, 120) == expected
    assert len(set(expected)) > 1 and sum(expected) == 4 * 30
    # Before the prompt is read the plan is the same total, evenly.
    assert compressor.budgets(120) == [30] * 4


def test_cake_budgets_under_another_selector_and_another_allocator_with_cake_s_score():
    windows = _windows(3)
    cake = KVCompressor(Policy.cake(0.25, window=8), num_layers=3).attention_budgets(windows, 120)
    with_snapkv = KVCompressor(make_policy("cake+snapkv", 0.25, window=8), num_layers=3)
    assert isinstance(with_snapkv.policy.selector, SnapKVSelector)
    assert with_snapkv.attention_budgets(windows, 120) == cake
    uniform_cake = KVCompressor(make_policy("uniform+cake", 0.25, window=8), num_layers=3)
    assert uniform_cake.attention_budgets(windows, 120) == [30] * 3


def test_compressing_a_layer_without_its_budget_is_refused_not_planned_evenly():
    # An engine compressing layer by layer (KVCompressor, no transformers) must read CAKE's budgets first.
    compressor = KVCompressor(Policy.cake(0.25, window=8), num_layers=4)
    windows = _windows(4)
    q, k, _ = windows[0]
    with pytest.raises(ValueError, match=r"reads every layer's attention .* plan.from_attention.* pass each layer's "
                                         r"budget= \(without it they would be the even plan"):
        compressor.compress(0, q, k, k)
    with pytest.raises(ValueError, match="pass each layer's budgets="):
        compressor.compress_rows(0, q, k, k, lengths=[120])
    budgets = compressor.attention_budgets(windows, 120)
    for layer, (q, k, _) in windows.items():
        assert compressor.compress(layer, q, k, k, budget=budgets[layer])[0].shape[2] == budgets[layer]
    # A prompt the plan keeps whole needs no budget.
    assert compressor.compress(0, q[..., :8, :], k[..., :20, :], k[..., :20, :])[0].shape[2] == 20


def test_compressor_refuses_a_missing_layer_or_a_batch():
    compressor = KVCompressor(Policy.cake(0.25, window=8), num_layers=3)
    windows = _windows(3)
    with pytest.raises(ValueError, match=r"no window for layers \[2\]"):
        compressor.attention_budgets({0: windows[0], 1: windows[1]}, 120)
    q, k, _ = windows[0]
    with pytest.raises(ValueError, match=r"one prompt's attention: layer 0's keys must be \[1, H_kv, 120, D\]"):
        compressor.attention_budgets({**windows, 0: (q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), None)}, 120)


# --- bad settings --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: Policy.cake(0.2, tau1=0), "tau1 must be a finite number > 0, got 0"),
    (lambda: Policy.cake(0.2, tau2=-1.0), "tau2 must be a finite number > 0"),
    (lambda: Policy.cake(0.2, tau1=float("nan")), "tau1 must be a finite number > 0"),
    (lambda: Policy.cake(0.2, gamma=-5), "gamma must be a finite number >= 0, got -5"),
    (lambda: Policy.cake(0.2, gamma=float("inf")), "gamma must be a finite number >= 0"),
    (lambda: Policy.cake(0.2, gamma=True), "gamma must be a finite number >= 0"),
    (lambda: Policy.cake(0.2, window=1), r"window must be at least 2 with CakeAllocator.*got window=1"),
    (lambda: Policy(UniformAllocator(), CakeSelector(), 0.2, window=1), r"window must be at least 2 with CakeSelector"),
    (lambda: layer_preference(window_attention(*_windows(1)[0][:2], 8), tau1=1e-3),
     r"preference H \*\* \(1/tau1\) x V \*\* \(1/tau2\) is not a finite number with tau1=0.001, tau2=1 .*use "
     r"larger tau1 and tau2"),
    (lambda: Policy(CakeAllocator(), SnapKVSelector(), 0.2, decode_every=16),
     r"decode_every is not supported with CakeAllocator\(tau1=1, tau2=1\): its budgets come from the prompt"),
    (lambda: Policy(CakeAllocator(), CakeSelector(), 0.2, prefill_chunk=256),
     r"prefill_chunk=256 is not supported with CakeAllocator.*read the prompt in one forward"),
])
def test_bad_settings_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()
