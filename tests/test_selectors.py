"""The selectors (ripplekv_ext.selectors) on their own: hand-worked selections and what each needs of its queries.
Every selector under every allocator, against the reference ops: test_policies.py."""

import pytest
import torch

from ripplekv_ext.selectors import H2OSelector, SnapKVSelector, StreamingLLMSelector
from test_policies import _qkv


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
    _, k = _qkv(b=1, h_kv=1, n=10)
    idx = StreamingLLMSelector(sink=4).select(None, k, budget=6, window=2)
    assert idx.tolist() == [[[0, 1, 2, 3, 8, 9]]]


def test_h2o_needs_every_query():
    q, k = _qkv(n=40)
    with pytest.raises(ValueError, match=r"queries dim 2 must be N = 40, got 8"):
        H2OSelector().select(q[:, :, -8:], k, budget=16, window=8)


def test_snapkv_needs_the_window():
    q, k = _qkv(n=40)
    with pytest.raises(ValueError, match=r"at least window = 8 positions, got 4"):
        SnapKVSelector().select(q[:, :, -4:], k, budget=16, window=8)
