"""AdaKV's head-wise budgets (ripplekv_ext.selection.adakv): the per-head counts against a hand computation and against
a plain re-statement of kvpress's AdaKVPress rule, both budget modes, and its refusals."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ripplekv_ext import AdaKVSelector, KVCompressor, Policy, UniformAllocator
from ripplekv_ext.selection.adakv import headwise_selection
from ripplekv_ext.methods import make_policy
from ripplekv_ext.selection.selectors import SnapKVSelector, StreamingLLMSelector

# Two KV heads over 6 prefix positions: head 0's attention is peaked on its first four, head 1's spread thin.
TOY = torch.tensor([[[0.9, 0.8, 0.7, 0.1, 0.05, 0.0],
                     [0.5, 0.01, 0.02, 0.03, 0.04, 0.06]]])


def test_counts_by_hand_at_equal_kept_tokens():
    # Budget 5 with a window of 2: 3 prefix slots per head, 6 in the layer. alpha 0.6: a floor of int(0.6 x 5) - 2 =
    # 1 per head (positions 0 and 0). The other 4 go to the best scores across heads: head 0's 0.8, 0.7, 0.1, then
    # head 1's 0.06. Head 0 keeps 4 (over its average of 3), head 1 keeps 2; the window (6, 7) last in each.
    kept = headwise_selection(TOY, budget=5, window=2, alpha=0.6)
    assert kept.tolist() == [[[0, 1, 2, 3, 6, 7], [-1, -1, 0, 5, 6, 7]]]


def test_counts_by_hand_at_equal_bytes():
    # The same order, stopped just before a head would hold a 4th prefix token (more than the budget's 3): the
    # floors, then 0.8 and 0.7 of head 0. No head exceeds the budget; the layer keeps 4 of its 6 slots.
    kept = headwise_selection(TOY, budget=5, window=2, alpha=0.6, padded=True)
    assert kept.tolist() == [[[0, 1, 2, 6, 7], [-1, -1, 0, 6, 7]]]


def _kvpress_rule(scores, budget, window, alpha):
    """kvpress's AdaKVPress, restated for one row: each head's top floor forced (scores set to the maximum), then the
    layer's lowest scores pruned across heads; the window (scored the maximum by SnapKVPress) counted in the floor."""
    h, p = scores.shape
    floor = max(int(alpha * budget) - window, 0)
    forced = scores.clone()
    for head in range(h):
        order = sorted(range(p), key=lambda i: (-scores[head, i].item(), i))
        for i in order[:floor]:
            forced[head, i] = float("inf")
    ranked = sorted(((head, i) for head in range(h) for i in range(p)),
                    key=lambda hi: (-forced[hi].item(), hi[0] * p + hi[1]))
    keep = ranked[: h * (budget - window)]
    return [sorted(i for head2, i in keep if head2 == head) + list(range(p, p + window)) for head in range(h)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(4, 40), st.integers(1, 6), st.floats(0, 1), st.data())
def test_selection_equals_the_kvpress_rule(heads, prefix, window, alpha, data):
    budget = data.draw(st.integers(window, prefix + window))
    scores = torch.tensor(data.draw(st.lists(st.integers(0, 9), min_size=heads * prefix, max_size=heads * prefix)),
                          dtype=torch.float32).reshape(1, heads, prefix)  # small integers: many ties
    kept = headwise_selection(scores, budget, window, alpha)
    got = [[i for i in row if i >= 0] for row in kept[0].tolist()]
    assert got == _kvpress_rule(scores[0], budget, window, alpha)
    assert sum(len(row) for row in got) == heads * budget  # equal kept tokens
    padded = headwise_selection(scores, budget, window, alpha, padded=True)
    assert padded.shape[2] <= budget  # equal bytes: no head over the budget
    for head in range(heads):  # and each head a prefix of what the unpadded selection kept
        assert set(padded[0, head].tolist()) - {-1} <= set(got[head])


def test_compress_heads_masks_the_padding_slots_and_compress_refuses():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g),
               torch.randn(1, 2, 64, 16, generator=g))
    compressor = KVCompressor(Policy(UniformAllocator(), AdaKVSelector(), 0.25, window=8), num_layers=1)
    keys, values, mask = compressor.compress_heads(0, q, k, v)
    indices = compressor.select(0, q, k)
    assert mask is not None and torch.equal(mask, indices >= 0)
    assert torch.equal(keys[mask], k[0].gather(1, indices[0].clamp(min=0)[..., None].expand(-1, -1, 16))[mask[0]])
    assert bool((keys[~mask] == 0).all())
    assert int(mask.sum()) == 2 * 16
    with pytest.raises(ValueError, match=r"keeps a different count per KV head: use compress_heads"):
        compressor.compress(0, q, k, v)
    # Selectors with one count per head: compress's tensors and no mask.
    snapkv = KVCompressor(Policy.snapkv(0.25, window=8), num_layers=1)
    assert snapkv.compress_heads(0, q, k, v)[2] is None


def test_methods_name_both_modes():
    assert make_policy("uniform+adakv", 0.2).selector == AdaKVSelector()
    assert make_policy("ripplekv+adakv-padded", 0.2, [1.0, 2.0]).selector == AdaKVSelector(padded=True)
    assert make_policy("uniform+adakv-padded", 0.2).name == "uniform+adakv-padded@0.2"


@pytest.mark.parametrize("make, message", [
    (lambda: AdaKVSelector(alpha=1.5), r"alpha must be a fraction in \[0, 1\]"),
    (lambda: AdaKVSelector(alpha=True), r"alpha must be a fraction in \[0, 1\]"),
    (lambda: AdaKVSelector(padded="yes"), "padded must be True or False"),
    (lambda: AdaKVSelector(StreamingLLMSelector()), "scorer must be a ripplekv_ext.ScoredSelector"),
    (lambda: Policy(UniformAllocator(), AdaKVSelector(), 0.2, decode_every=8),
     r"decode_every is not supported with AdaKVSelector.*different counts"),
    (lambda: Policy(UniformAllocator(), AdaKVSelector(), 0.2, prefill_chunk=128),
     r"prefill_chunk=128 is not supported with AdaKVSelector.*different counts"),
    (lambda: AdaKVSelector().select_rows(torch.zeros(2, 2, 8, 16), torch.zeros(2, 1, 40, 16), torch.tensor([20, 20]),
                                         torch.tensor([40, 30]), 8), "a left-padded batch .* cannot carry it"),
    (lambda: headwise_selection(torch.tensor([[[1.0, float("nan")]]]), 3, 1), "scores contain NaN"),
    (lambda: headwise_selection(torch.zeros(1, 1, 4), 9, 2), r"budget must be in \[window, N\] = \[2, 6\]"),
])
def test_bad_settings_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_snapkv_scores_are_the_default_scorer():
    assert AdaKVSelector().scorer == SnapKVSelector()
    assert AdaKVSelector(SnapKVSelector(value_weighted=True)).needs_values
