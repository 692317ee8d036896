"""select_topk_packed: every layer selected in one call, against the reference and the per-layer ops (with
gather_kv_packed, its partner, for the whole packed pipeline)."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref


def make(L, B, H, N, D, W, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (L, B, H, N - W), generator=g).float().to(device)  # many ties
    keys = torch.randn(L, B, H, N, D, generator=g).to(dtype=dtype, device=device)
    values = torch.randn(L, B, H, N, D, generator=g).to(dtype=dtype, device=device)
    return scores, keys, values


@pytest.mark.parametrize("budgets", [[10, 40, 8, 25], [8, 8, 8, 8], [100, 100, 100, 100], [0 + 8, 39, 40, 41]], ids=str)
def test_matches_reference_and_per_layer(budgets, dtype, device):
    W, N = 8, 40
    scores, keys, values = make(4, 2, 3, N, 16, W, dtype, device)
    flat, offsets = ripplekv_ext.select_topk_packed(scores, torch.tensor(budgets), W)
    flat_ref, offsets_ref = ripplekv_ref.select_topk_packed(scores, torch.tensor(budgets), W)
    assert torch.equal(flat, flat_ref) and torch.equal(offsets, offsets_ref)
    assert offsets.device == scores.device and offsets.tolist()[-1] == sum(min(b, N) for b in budgets)
    k_flat, v_flat = ripplekv_ext.gather_kv_packed(keys, values, flat, offsets)
    k_ref, v_ref = ripplekv_ref.gather_kv_packed(keys, values, flat, offsets)
    assert torch.equal(k_flat, k_ref) and torch.equal(v_flat, v_ref)
    # Independently: each segment is that layer's own select + gather.
    bounds = offsets.tolist()
    for l, budget in enumerate(budgets):
        idx = ripplekv_ext.select_topk(scores[l], budget, W)
        assert torch.equal(flat[..., bounds[l]:bounds[l + 1]], idx)
        k_c, v_c = ripplekv_ext.gather_kv(keys[l], values[l], idx)
        assert torch.equal(k_flat[:, :, bounds[l]:bounds[l + 1]], k_c)
        assert torch.equal(v_flat[:, :, bounds[l]:bounds[l + 1]], v_c)


def test_opcheck(device):
    scores, keys, values = make(2, 1, 2, 20, 8, 4, torch.float32, device)
    torch.library.opcheck(torch.ops.ripplekv.select_topk_packed.default, (scores, [6, 30], 4))
    flat, offsets = ripplekv_ext.select_topk_packed(scores, [6, 30], 4)
    torch.library.opcheck(torch.ops.ripplekv.gather_kv_packed.default, (list(keys), list(values), flat, offsets))


def test_torch_compile_fullgraph(device):
    scores, keys, values = make(2, 1, 2, 20, 8, 4, torch.float32, device)

    def compress_all(scores, keys, values):
        flat, offsets = ripplekv_ext.select_topk_packed(scores, [6, 11], 4)
        return ripplekv_ext.gather_kv_packed(keys, values, flat, offsets)

    k_flat, _ = torch.compile(compress_all, fullgraph=True)(scores, keys, values)
    flat, offsets = ripplekv_ref.select_topk_packed(scores, [6, 11], 4)
    assert torch.equal(k_flat, ripplekv_ref.gather_kv_packed(keys, values, flat, offsets)[0])


def test_bad_input(device):
    scores, keys, values = make(2, 1, 2, 20, 8, 4, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"select_topk_packed: budgets must have L = 2 entries \(scores dim 0\), got 3"):
        ripplekv_ext.select_topk_packed(scores, [6, 6, 6], 4)
    with pytest.raises(RuntimeError, match=r"budgets\[1\] must be >= window \(4\) when compressing \(N = 20\), got 2"):
        ripplekv_ext.select_topk_packed(scores, [6, 2], 4)
    with pytest.raises(RuntimeError, match=r"budgets\[0\] must be a non-negative number of tokens, got -6"):
        ripplekv_ext.select_topk_packed(scores, [-6, 8], 4)
    with pytest.raises(TypeError, match=r"budgets\[1\] must be an integer, got float"):
        ripplekv_ext.select_topk_packed(scores, [6, 7.5], 4)
    with pytest.raises(ValueError, match=r"budgets must be a 1-D int64 tensor \[L\], got 1-D torch.float32"):
        ripplekv_ext.select_topk_packed(scores, torch.tensor([6.0, 7.0]), 4)
    with pytest.raises(RuntimeError, match=r"scores must be a 4-D tensor \[L, B, H_kv, N - W\], got 3-D"):
        ripplekv_ext.select_topk_packed(scores[0], [6], 4)
