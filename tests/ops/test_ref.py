"""The reference (python/ripplekv_ref) itself, checked against hand-worked examples, a naive loop implementation and
identities.

Every extension test compares against ripplekv_ref, so the reference must be right on its own terms first.
"""

import re
import math

import pytest
import torch

import ripplekv_ref


def naive_snapkv(q, k, kernel_size, pooling, group_reduce, scale=None):
    """docs/design.md §4 written as Python loops over floats: independent of every tensor op used by the reference."""
    B, Hq, W, D = q.shape
    _, Hkv, N, _ = k.shape
    G = Hq // Hkv
    s = scale if scale is not None else 1 / math.sqrt(D)
    out = torch.zeros(B, Hkv, N - W, dtype=torch.float64)
    for b in range(B):
        for g in range(Hkv):
            per_head = []
            for h in range(g * G, (g + 1) * G):
                acc = [0.0] * (N - W)
                for i in range(W):
                    visible = N - W + i + 1
                    logits = [s * float(q[b, h, i] @ k[b, g, j]) for j in range(visible)]
                    m = max(logits)
                    z = sum(math.exp(x - m) for x in logits)
                    for j in range(N - W):
                        acc[j] += math.exp(logits[j] - m) / z
                per_head.append(acc)
            red = [(sum(col) / G if group_reduce == "mean" else max(col)) for col in zip(*per_head)]
            pad = kernel_size // 2
            for j in range(N - W):
                win = [red[t] if 0 <= t < N - W else None for t in range(j - pad, j + pad + 1)]
                if pooling == "max":
                    out[b, g, j] = max(x for x in win if x is not None)
                else:
                    out[b, g, j] = sum(x for x in win if x is not None) / kernel_size
    return out


def test_snapkv_uniform_attention_by_hand():
    # Zero queries attend uniformly: query 0 (position 2) sees 3 keys, query 1 (position 3) sees 4.
    q = torch.zeros(1, 1, 2, 2)
    k = torch.randn(1, 1, 4, 2)
    scores = ripplekv_ref.snapkv_scores(q, k, kernel_size=1)
    assert torch.allclose(scores, torch.full((1, 1, 2), 1 / 3 + 1 / 4))


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("group_reduce", ["mean", "max"])
@pytest.mark.parametrize("kernel_size", [1, 3, 7])
def test_snapkv_matches_naive_loops(pooling, group_reduce, kernel_size):
    g = torch.Generator().manual_seed(kernel_size)
    q = torch.randn(2, 4, 3, 5, generator=g)
    k = torch.randn(2, 2, 11, 5, generator=g)
    ours = ripplekv_ref.snapkv_scores(q, k, kernel_size, pooling, group_reduce, scale=0.7)
    naive = naive_snapkv(q, k, kernel_size, pooling, group_reduce, scale=0.7)
    assert ours.dtype == torch.float32 and ours.shape == (2, 2, 8)
    assert torch.allclose(ours.double(), naive, atol=1e-6)


def test_snapkv_mass_identity():
    # Each window query's probabilities sum to 1, so unpooled prefix mass plus window mass is W per head.
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 20, 8)
    prefix = ripplekv_ref.snapkv_scores(q, k, kernel_size=1).sum(-1)
    # The window's own mass, computed here from the definition: query i attends to window keys 0..i.
    logits = (q @ k[:, :, 16:].transpose(-1, -2)) / 8 ** 0.5
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    full = torch.cat([q @ k[:, :, :16].transpose(-1, -2) / 8 ** 0.5, logits.masked_fill(~causal, float("-inf"))], -1)
    window = full.softmax(-1)[..., 16:].sum((-1, -2))
    torch.testing.assert_close(prefix + window, torch.full_like(prefix, 4.0))
    assert bool((prefix > 0).all()) and bool((window > 0).all())


def test_select_topk_by_hand():
    scores = torch.tensor([[[3.0, 1.0, 3.0, 2.0, 0.0]]])
    assert ripplekv_ref.select_topk(scores, 4, 2).tolist() == [[[0, 2, 5, 6]]]
    # All tied: lower positions win.
    assert ripplekv_ref.select_topk(torch.ones(1, 1, 4), 3, 1).tolist() == [[[0, 1, 4]]]
    # -inf is just the lowest score.
    minf = torch.tensor([[[float("-inf"), 0.5, float("-inf")]]])
    assert ripplekv_ref.select_topk(minf, 3, 1).tolist() == [[[0, 1, 3]]]
    # N <= budget keeps everything; budget == W keeps only the window.
    assert ripplekv_ref.select_topk(scores, 7, 2).tolist() == [[list(range(7))]]
    assert ripplekv_ref.select_topk(scores, 2, 2).tolist() == [[[5, 6]]]


@pytest.mark.parametrize("args, error, message", [
    ((torch.tensor([[[float("nan"), 1.0]]]), 2, 1), ValueError, "NaN"),
    ((torch.ones(1, 1, 5), 2, 3), ValueError, r"budget must be >= window \(3\).*got 2"),
    ((torch.ones(1, 1, 5), 2.5, 1), TypeError, r"budget must be an integer, got float"),
    ((torch.ones(1, 1, 5), -1, 1), ValueError, r"budget must be >= 0, got -1"),
    ((torch.ones(1, 5), 2, 1), ValueError, r"scores must be a 3-D tensor"),
])
def test_select_topk_errors(args, error, message):
    with pytest.raises(error, match=message):
        ripplekv_ref.select_topk(*args)


@pytest.mark.parametrize("call, message", [
    (lambda: ripplekv_ref.snapkv_scores(torch.ones(1, 0, 2, 4), torch.ones(1, 2, 8, 4)), "positive multiple"),
    (lambda: ripplekv_ref.h2o_scores(torch.ones(1, 0, 8, 4), torch.ones(1, 2, 8, 4)), "positive multiple"),
    (lambda: ripplekv_ref.snapkv_scores(torch.ones(1, 2, 2, 0), torch.ones(1, 2, 8, 0)), "D (dim 3) must be >= 1"),
    (lambda: ripplekv_ref.h2o_scores(torch.ones(1, 2, 8, 0), torch.ones(1, 2, 8, 0)), "D (dim 3) must be >= 1"),
    (lambda: ripplekv_ref.snapkv_compress(torch.ones(1, 2, 2, 0), torch.ones(1, 2, 8, 0), torch.ones(1, 2, 8, 0), 20),
     "D (dim 3) must be >= 1"),
])
def test_scoring_needs_query_heads_and_a_head_dim(call, message):
    # No query head means no group to average over, D = 0 no 1/sqrt(D) scale: both are errors, not empty results.
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_h2o_uniform_by_hand_and_chunking():
    # Zero queries: position j receives 1/(i+1) from every query i >= j.
    n = 6
    q = torch.zeros(1, 2, n, 4)
    k = torch.randn(1, 1, n, 4)
    expected = torch.tensor([sum(1 / (i + 1) for i in range(j, n)) for j in range(n)])
    assert torch.allclose(ripplekv_ref.h2o_scores(q, k, chunk_size=4)[0, 0], expected)
    q = torch.randn(2, 4, 13, 8)
    k = torch.randn(2, 2, 13, 8)
    whole = ripplekv_ref.h2o_scores(q, k, chunk_size=13)
    assert torch.allclose(whole, ripplekv_ref.h2o_scores(q, k, chunk_size=3), atol=1e-6)
    # Every query's row sums to 1, so the total mass per KV head (mean over the group) is N.
    assert torch.allclose(whole.sum(-1), torch.full((2, 2), 13.0), atol=1e-4)


def test_snapkv_compress_pipeline_and_passthrough():
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 30, 8)
    v = torch.randn(1, 2, 30, 8)
    k_c, v_c, idx = ripplekv_ref.snapkv_compress(q, k, v, 10)
    assert idx.shape == (1, 2, 10) and torch.equal(idx[..., -3:], torch.tensor([27, 28, 29]).expand(1, 2, 3))
    assert torch.equal(k_c, ripplekv_ref.gather_kv(k, v, idx)[0])
    k_c, v_c, idx = ripplekv_ref.snapkv_compress(q, k, v, 30)
    assert torch.equal(k_c, k) and torch.equal(v_c, v) and torch.equal(idx[0, 1], torch.arange(30))


def test_streaming_by_hand():
    assert ripplekv_ref.streaming_indices(10, 6, sink=2).tolist() == [[[0, 1, 6, 7, 8, 9]]]
    assert ripplekv_ref.streaming_indices(5, 6, batch=2, heads=3).shape == (2, 3, 5)
    with pytest.raises(ValueError, match=r"budget must be >= sink \(4\)"):
        ripplekv_ref.streaming_indices(10, 3)


def test_packed_matches_per_layer():
    scores = torch.randn(3, 1, 2, 20)
    budgets = torch.tensor([5, 30, 8])
    flat, offsets = ripplekv_ref.select_topk_packed(scores, budgets, 4)
    assert offsets.tolist() == [0, 5, 29, 37] and flat.shape == (1, 2, 37)
    keys = torch.randn(3, 1, 2, 24, 8)
    values = torch.randn(3, 1, 2, 24, 8)
    k_flat, v_flat = ripplekv_ref.gather_kv_packed(keys, values, flat, offsets)
    for l in range(3):
        idx = ripplekv_ref.select_topk(scores[l], int(budgets[l]), 4)
        assert torch.equal(flat[..., offsets[l]:offsets[l + 1]], idx)
        k_c, v_c = ripplekv_ref.gather_kv(keys[l], values[l], idx)
        assert torch.equal(k_flat[:, :, offsets[l]:offsets[l + 1]], k_c)
        assert torch.equal(v_flat[:, :, offsets[l]:offsets[l + 1]], v_c)
