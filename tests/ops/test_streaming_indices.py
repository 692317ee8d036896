"""streaming_indices (ripplekv_ext.ops, computed in Python: no torch op): hand-worked selections and the reference."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref


def test_by_hand():
    assert ripplekv_ext.streaming_indices(10, 6, sink=2).tolist() == [[[0, 1, 6, 7, 8, 9]]]
    assert ripplekv_ext.streaming_indices(10, 4, sink=4).tolist() == [[[0, 1, 2, 3]]]
    assert ripplekv_ext.streaming_indices(5, 9).tolist() == [[[0, 1, 2, 3, 4]]]
    assert ripplekv_ext.streaming_indices(10, 5, sink=0).tolist() == [[[5, 6, 7, 8, 9]]]


def stated(n, budget, sink):
    """docs/design.md's rule, written from its statement: the first ``sink`` positions and the last ``budget - sink``; a
    prompt within its budget is kept whole."""
    if n <= budget:
        return list(range(n))
    return [p for p in range(n) if p < sink or p >= n - (budget - sink)]


@pytest.mark.parametrize("n, budget, sink", [(100, 20, 4), (100, 100, 4), (7, 3, 1), (1, 1, 4), (64, 8, 8),
                                             (101, 100, 0), (50, 5, 5)])
def test_matches_the_stated_rule_and_the_reference(n, budget, sink, device):
    ours = ripplekv_ext.streaming_indices(n, budget, sink, batch=2, heads=3, device=device)
    ref = ripplekv_ref.streaming_indices(n, budget, sink, batch=2, heads=3, device=device)
    assert ours.dtype == torch.int64 and ours.device.type == device.type
    assert all(row == stated(n, budget, sink) for row in ours.flatten(0, 1).tolist())
    assert torch.equal(ours, ref)
    assert ours.shape == (2, 3, min(n, budget)) and ours.is_contiguous()
    assert bool((ours.diff(dim=-1) > 0).all())


def test_bad_input():
    with pytest.raises(ValueError, match=r"streaming_indices: budget must be >= sink \(4\) when compressing \(N = "
                                         r"10\), got 3"):
        ripplekv_ext.streaming_indices(10, 3)
    with pytest.raises(ValueError, match=r"budget must be >= 0, got -1"):
        ripplekv_ext.streaming_indices(10, -1)
    with pytest.raises(TypeError, match=r"n_tokens must be an integer, got float"):
        ripplekv_ext.streaming_indices(10.0, 3)
