"""KeyNormSelector: the smallest-norm keys plus the window, against its reference and through compress_context."""

import math

import pytest
import torch

from ripplekv_ext import Policy, UniformAllocator
from ripplekv_ext.selectors import KeyNormSelector
from ripplekv_ref import select_topk, select_topk_rows
from ripplekv_ref.selectors import key_norm_scores

WINDOW = 4


def _keys(batch=2, h_kv=2, n=40, d=8, seed=0):
    return torch.randn(batch, h_kv, n, d, generator=torch.Generator().manual_seed(seed))


def test_scores_match_the_reference():
    keys = _keys()
    torch.testing.assert_close(KeyNormSelector().score(None, keys, WINDOW), key_norm_scores(keys, WINDOW))


def test_select_keeps_the_smallest_norms_and_the_window():
    keys = _keys(seed=1)
    for budget in (WINDOW, 10, 39):
        got = KeyNormSelector().select(None, keys, budget, WINDOW)
        assert torch.equal(got, select_topk(key_norm_scores(keys, WINDOW), budget, WINDOW))
    # An independent fact: scale one key down and it is kept.
    keys[0, 1, 7] *= 1e-3
    assert 7 in KeyNormSelector().select(None, keys, WINDOW + 1, WINDOW)[0, 1].tolist()


def test_rows_score_pads_minus_inf_and_match_the_reference():
    keys = _keys(batch=3, seed=2)
    lengths, budgets = torch.tensor([40, 12, 3]), torch.tensor([10, 8, 10])
    scores = KeyNormSelector().score(None, keys, WINDOW, lengths=lengths)
    reference = key_norm_scores(keys, WINDOW, lengths)
    assert torch.isneginf(scores[1, :, :28]).all() and torch.equal(torch.isinf(scores), torch.isinf(reference))
    torch.testing.assert_close(scores[torch.isfinite(scores)], reference[torch.isfinite(reference)])
    got = KeyNormSelector().select_rows(None, keys, budgets, lengths, WINDOW)
    assert torch.equal(got, select_topk_rows(reference, budgets, WINDOW, lengths))


def test_a_policy_with_it_needs_no_queries():
    policy = Policy(UniformAllocator(), KeyNormSelector(), 0.25, window=WINDOW)
    assert not policy.selector.needs_all_queries and policy.name == "uniform+keynorm@0.25"
    with pytest.raises(ValueError, match="keys must be 4-D"):
        KeyNormSelector().score(None, torch.zeros(3, 4), WINDOW)
    assert math.isinf(KeyNormSelector().score(None, _keys(batch=1, n=6), WINDOW,
                                              lengths=torch.tensor([3]))[0, 0, 0].item())
