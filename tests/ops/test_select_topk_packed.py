"""select_topk_packed: every layer selected in one call, against the reference and the per-layer ops (with
gather_kv_packed, its partner, for the whole packed pipeline); opcheck over the samples, and the bad-input table."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from devices import COMPILE_BACKEND
from op_samples import nan_at, rand
from op_tables import Case, I64_MAX, op_tests


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

    k_flat, _ = torch.compile(compress_all, fullgraph=True, backend=COMPILE_BACKEND)(scores, keys, values)
    flat, offsets = ripplekv_ref.select_topk_packed(scores, [6, 11], 4)
    assert torch.equal(k_flat, ripplekv_ref.gather_kv_packed(keys, values, flat, offsets)[0])


def test_bad_input(device):
    scores, keys, values = make(2, 1, 2, 20, 8, 4, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"select_topk_packed: budgets must have L = 2 entries \(scores dim 0\), "
                                           r"got 3"):
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


# ---- samples: mixed budgets, one layer, strided, an empty batch; opcheck over each -----------------------------------

def select_topk_packed_samples(device):
    s = rand(3, 2, 2, 30, device=device)
    return [("mixed budgets", (s, [4, 20, 50], 4)), ("one layer", (s[:1], [12], 4)),
            ("strided", (rand(3, 2, 2, 60, device=device)[..., ::2], [6, 6, 6], 4)),
            ("empty batch", (s[:, :0], [10, 10, 10], 4))]


SAMPLES = {"select_topk_packed": select_topk_packed_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    # Empty inputs give empty outputs of the right shape.
    Case("select_topk_packed B=0", lambda d: ripplekv_ext.select_topk_packed(rand(2, 0, 2, 40, device=d), [10, 50], 4),
         shapes=[(0, 2, 54), (3,)]),
    Case("select_topk_packed L=0", lambda d: ripplekv_ext.select_topk_packed(rand(0, 1, 2, 40, device=d), [], 4),
         shapes=[(1, 2, 0), (1,)]),
    # A budget near 2**63 keeps everything.
    Case("select_topk_packed budget 2**63-1", lambda d: ripplekv_ext.select_topk_packed(
        rand(2, 1, 2, 40, device=d), [I64_MAX, 10], 4),
         shapes=[(1, 2, 54), (3,)]),
    # A lone int where one value per layer is expected: say what the argument must be.
    Case("select_topk_packed budgets=10", lambda d: ripplekv_ext.select_topk_packed(rand(2, 1, 2, 40, device=d), 10, 4),
         error=(TypeError, "select_topk_packed: budgets must be an int64 [L] tensor or a list of ints "
                           "(one per layer)")),
    # NaN scores: the selection raises, naming the row and the layer.
    Case("select_topk_packed NaN in layer 1", lambda d: ripplekv_ext.select_topk_packed(
        nan_at(rand(2, 1, 2, 40, device=d), 1, 0, 1, 3), [10, 10], 4),
         error=(RuntimeError, "of row 1 (row = b * H_kv + h) of layer 1"), reference="scores must not contain NaN"),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)
