"""snapkv_compress (score, select and gather in one op) against the reference and the unfused ops; opcheck over the
samples, and the bad-input table."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ripplekv_ext
import ripplekv_ref
from op_samples import FLOAT_DTYPES, bnhd, nan_at, rand
from op_tables import Case, I64_MAX, op_tests, other_device
from ripplekv_ref.comparison import SCORE_TOL, assert_same_selection
from test_snapkv_scores import SHAPES, make_window  # noqa: F401


@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_compress_matches_reference(shape, dtype, device):
    B, H_q, H_kv, W, N, D = shape
    q, k, v = make_window(B, H_q, H_kv, W, N, D, dtype, device, seed=1)
    budget = W + (N - W) // 3
    k_c, v_c, idx = ripplekv_ext.snapkv_compress(q, k, v, budget)
    _, _, idx_ref = ripplekv_ref.snapkv_compress(q, k, v, budget)
    assert idx.shape == (B, H_kv, budget) and idx.dtype == torch.int64
    assert_same_selection(idx, idx_ref, ripplekv_ref.snapkv_scores(q, k), W)
    # Whatever was selected, K/V must be exactly those rows, and the window is always there.
    k_g, v_g = ripplekv_ref.gather_kv(k, v, idx)
    assert torch.equal(k_c, k_g) and torch.equal(v_c, v_g)
    assert bool((idx.diff(dim=-1) > 0).all())
    assert torch.equal(idx[..., -W:], torch.arange(N - W, N, device=device).expand(B, H_kv, W))


def test_compress_exact_ties_go_low(device):
    # Identical keys: every prefix score ties, so the lowest positions must win on every backend.
    q, _, _ = make_window(1, 4, 2, 4, 1, 8, torch.float32, device)
    k = torch.ones(1, 2, 40, 8, device=device)
    v = torch.randn(1, 2, 40, 8, device=device)
    _, _, idx = ripplekv_ext.snapkv_compress(q, k, v, 10)
    expected = torch.cat([torch.arange(6), torch.arange(36, 40)]).to(device).expand(1, 2, 10)
    assert torch.equal(idx, expected)


def test_compress_nothing_to_compress(device):
    q, k, v = make_window(1, 2, 1, 4, 20, 8, torch.bfloat16, device)
    for budget in (20, 50):
        k_c, v_c, idx = ripplekv_ext.snapkv_compress(q, k, v, budget)
        assert torch.equal(k_c, k) and torch.equal(v_c, v)
        assert torch.equal(idx, torch.arange(20, device=device).expand(1, 1, 20))
        assert k_c.data_ptr() != k.data_ptr()  # fresh buffers, never aliases of the cache
    # W = N is fine when nothing is compressed.
    k_c, _, _ = ripplekv_ext.snapkv_compress(q, k[:, :, :4], v[:, :, :4], 4)
    assert k_c.shape == (1, 1, 4, 8)


def test_compress_budget_equals_window(device):
    q, k, v = make_window(1, 2, 2, 5, 30, 8, torch.float32, device)
    _, _, idx = ripplekv_ext.snapkv_compress(q, k, v, 5)
    assert torch.equal(idx, torch.arange(25, 30, device=device).expand(1, 2, 5))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), G=st.sampled_from([1, 2, 8]), W=st.integers(1, 8),
       extra=st.integers(1, 60), D=st.sampled_from([1, 8, 24]), budget_frac=st.floats(0, 1.2),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_property_compress_matches_reference(B, H_kv, G, W, extra, D, budget_frac, dtype, seed):
    N = W + extra
    q, k, v = make_window(B, G * H_kv, H_kv, W, N, D, dtype, "cpu", seed)
    budget = W + int(budget_frac * (N - W))
    scores = ripplekv_ext.snapkv_scores(q, k)
    ref_scores = ripplekv_ref.snapkv_scores(q, k)
    torch.testing.assert_close(scores, ref_scores, **SCORE_TOL)
    k_c, v_c, idx = ripplekv_ext.snapkv_compress(q, k, v, budget)
    _, _, idx_ref = ripplekv_ref.snapkv_compress(q, k, v, budget)
    assert idx.shape == idx_ref.shape
    if N > budget:
        assert_same_selection(idx, idx_ref, ref_scores, W)
        # The fused path selects exactly what select_topk selects on the unfused scores.
        assert torch.equal(idx, ripplekv_ext.select_topk(scores, budget, W))
    assert torch.equal(k_c, ripplekv_ref.gather_kv(k, v, idx)[0])


def test_compress_bad_input(device):
    q, k, v = make_window(1, 4, 2, 4, 10, 8, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"snapkv_compress: values must have the shape of keys \[1, 2, 10, 8\], "
                                           r"got \[1, 2, 9, 8\]"):
        ripplekv_ext.snapkv_compress(q, k, v[:, :, :9], 6)
    with pytest.raises(RuntimeError, match=r"budget must be >= window \(4\) when compressing \(N = 10\), got 3"):
        ripplekv_ext.snapkv_compress(q, k, v, 3)
    with pytest.raises(RuntimeError, match=r"budget must be a non-negative number of tokens, got -1"):
        ripplekv_ext.snapkv_compress(q, k, v, -1)
    with pytest.raises(TypeError, match=r"snapkv_compress: budget must be an integer, got float \(6.5\)"):
        ripplekv_ext.snapkv_compress(q, k, v, 6.5)
    with pytest.raises(RuntimeError, match=r"window W \(q_window dim 2\) must be in \[1, N\] = \[1, 3\], got 4"):
        ripplekv_ext.snapkv_compress(q, k[:, :, :3], v[:, :, :3], 8)
    with pytest.raises(RuntimeError, match=r"values must have the dtype of keys \(Float\), got Half"):
        ripplekv_ext.snapkv_compress(q, k, v.half(), 6)
    bad_q = q.clone()
    bad_q[0, 1, 2, 3] = float("nan")
    with pytest.raises(RuntimeError, match=r"NaN"):
        ripplekv_ext.snapkv_compress(bad_q, k, v, 6)


# ---- samples: every float dtype, budgets from the window to above N, options, bnhd, an empty batch; opcheck over each

def snapkv_compress_samples(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (rand(1, 4, 4, 16, device=device, dtype=dtype),
                                 rand(1, 2, 40, 16, device=device, dtype=dtype, seed=1),
                                 rand(1, 2, 40, 16, device=device, dtype=dtype, seed=2), 12, 7, "max", "mean", None)))
    q, k, v = (rand(2, 4, 4, 16, device=device), rand(2, 2, 40, 16, device=device, seed=1),
               rand(2, 2, 40, 16, device=device, seed=2))
    for budget in (4, 39, 40, 100):  # window only, just compressing, N, above N
        out.append((f"budget {budget}", (q, k, v, budget, 7, "max", "mean", None)))
    out.append(("avg, group max, scale", (q, k, v, 10, 3, "avg", "max", 0.5)))
    out.append(("bnhd", (bnhd(q), bnhd(k), bnhd(v), 10, 7, "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], v[:0], 10, 7, "max", "mean", None)))
    return out


SAMPLES = {"snapkv_compress": snapkv_compress_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    # Empty batches give empty outputs. The first in a subprocess (crashed_before): a SIGFPE in the CPU driver would
    # end the run.
    Case("snapkv_compress B=0", lambda d: ripplekv_ext.snapkv_compress(
        rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d), rand(0, 2, 64, 16, device=d), 20),
         shapes=[(0, 2, 20, 16), (0, 2, 20, 16), (0, 2, 20)], crashed_before=True),
    Case("snapkv_compress B=0, budget >= N", lambda d: ripplekv_ext.snapkv_compress(
        rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d), rand(0, 2, 64, 16, device=d), 64),
         shapes=[(0, 2, 64, 16), (0, 2, 64, 16), (0, 2, 64)]),
    # Sizes that have no meaning raise, as the reference does.
    Case("snapkv_compress D=0", lambda d: ripplekv_ext.snapkv_compress(
        rand(1, 4, 8, 0, device=d), rand(1, 2, 64, 0, device=d), rand(1, 2, 64, 0, device=d), 20),
         error=(RuntimeError, "head dimension D (dim 3) must be >= 1, got 0")),
    Case("snapkv_compress kernel_size=True", lambda d: ripplekv_ext.snapkv_compress(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=d), 20, kernel_size=True),
         error=(TypeError, "kernel_size must be an integer, got bool")),
    # A budget near 2**63 keeps everything.
    Case("snapkv_compress budget 2**63-1", lambda d: ripplekv_ext.snapkv_compress(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=d), I64_MAX),
         shapes=[(1, 2, 64, 16), (1, 2, 64, 16), (1, 2, 64)]),
    # Every tensor on one device (meta included): no uninitialised memory, no silent no-op.
    Case("snapkv_compress values on another device", lambda d: ripplekv_ext.snapkv_compress(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=other_device(d)), 20),
         error=(RuntimeError, "every tensor must be on one device")),
    # NaN scores: the selection raises, whether or not the budget leaves anything to select.
    Case("snapkv_compress NaN, budget == window", lambda d: ripplekv_ext.snapkv_compress(
        rand(1, 4, 8, 16, device=d), nan_at(rand(1, 2, 64, 16, device=d), 0, 1, 60, 3),
        rand(1, 2, 64, 16, device=d), 8), error=(RuntimeError, "scores must not contain NaN")),
    Case("snapkv_compress NaN, budget > window", lambda d: ripplekv_ext.snapkv_compress(
        nan_at(rand(1, 4, 8, 16, device=d), 0, 0, 0, 0), rand(1, 2, 64, 16, device=d),
        rand(1, 2, 64, 16, device=d), 20), error=(RuntimeError, "scores must not contain NaN")),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)
