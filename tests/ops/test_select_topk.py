"""select_topk against the reference (indices exact), a brute-force oracle and hand-worked rows; opcheck over the
samples, and the bad-input table."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ripplekv_ext
import ripplekv_ref
from devices import COMPILE_BACKEND, requires_cuda
from op_samples import nan_at, rand
from op_tables import Case, I64_MAX, op_tests

INF = float("inf")


def brute_force(scores, budget, window):
    """Python lists, stable sort: independent of both implementations."""
    B, H, n_prefix = scores.shape
    n = n_prefix + window
    out = []
    for row in scores.flatten(0, 1).tolist():
        if n <= budget:
            out.append(list(range(n)))
            continue
        order = sorted(range(n_prefix), key=lambda j: -row[j])  # sorted() is stable: ties keep position order
        out.append(sorted(order[: budget - window]) + list(range(n_prefix, n)))
    return torch.tensor(out, dtype=torch.int64).reshape(B, H, -1)


def check(scores, budget, window):
    idx = ripplekv_ext.select_topk(scores, budget, window)
    assert idx.dtype == torch.int64 and idx.device == scores.device
    assert torch.equal(idx, ripplekv_ref.select_topk(scores, budget, window))
    assert torch.equal(idx.cpu(), brute_force(scores.cpu(), budget, window))
    return idx


def test_by_hand(device):
    s = torch.tensor([[[3.0, 1.0, 3.0, 2.0, 0.0]]], device=device)
    assert check(s, 4, 2).tolist() == [[[0, 2, 5, 6]]]
    assert check(torch.ones(1, 1, 4, device=device), 3, 1).tolist() == [[[0, 1, 4]]]
    assert check(torch.tensor([[[-INF, 0.5, -INF]]], device=device), 3, 1).tolist() == [[[0, 1, 3]]]
    assert check(s, 7, 2).tolist() == [[list(range(7))]]   # N <= C keeps everything
    assert check(s, 100, 2).shape == (1, 1, 7)
    assert check(s, 2, 2).tolist() == [[[5, 6]]]            # budget == W: only the window
    assert check(s, 3, 0).tolist() == [[[0, 2, 3]]]         # no window
    assert check(torch.tensor([[[0.0, -0.0, 0.0]]], device=device), 2, 0).tolist() == [[[0, 1]]]  # -0 == +0


@pytest.mark.parametrize("kind", ["random", "ties", "all_equal", "all_minus_inf", "large"])
def test_adversarial(kind, device):
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        s = torch.randn(2, 3, 500, generator=g)
    elif kind == "ties":  # a few distinct values, as max pooling produces
        s = torch.randint(0, 4, (2, 3, 500), generator=g).float()
    elif kind == "all_equal":
        s = torch.full((1, 2, 300), 0.25)
    elif kind == "all_minus_inf":
        s = torch.full((1, 2, 300), -INF)
    else:
        s = torch.rand(1, 2, 5000, generator=g) * 1e-3
        s[0, 0, 100:200] = INF
    s = s.to(device)
    for budget in (32, 33, 100, 250, s.shape[-1] + 31, s.shape[-1] + 32):
        check(s, budget, 32)


def test_non_contiguous(device):
    s = torch.randn(3, 2, 200, device=device).transpose(0, 1)
    assert not s.is_contiguous()
    check(s, 50, 8)
    check(torch.randn(2, 2, 400, device=device)[..., ::2], 60, 4)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 4), n_prefix=st.integers(1, 80), window=st.integers(0, 16),
       budget_extra=st.integers(0, 100), distinct=st.sampled_from([2, 5, 1000]), seed=st.integers(0, 2**16))
def test_property_matches_reference(B, H, n_prefix, window, budget_extra, distinct, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, distinct, (B, H, n_prefix), generator=g).float() / distinct
    check(scores, window + budget_extra, window)


def test_opcheck(device):
    s = torch.randn(2, 3, 50, device=device)
    torch.library.opcheck(torch.ops.ripplekv.select_topk.default, (s, 20, 4))
    torch.library.opcheck(torch.ops.ripplekv.select_topk.default, (s, 80, 4))


def test_torch_compile_fullgraph(device):
    s = torch.randn(1, 2, 64, device=device)

    def pick(s):
        return ripplekv_ext.select_topk(s * 2, 16, 4) + 0

    compiled = torch.compile(pick, fullgraph=True, backend=COMPILE_BACKEND)
    assert torch.equal(compiled(s), ripplekv_ref.select_topk(s, 16, 4))


def test_bad_input(device):
    s = torch.randn(1, 2, 10, device=device)
    with pytest.raises(RuntimeError, match=r"select_topk: scores must be a 3-D tensor \[B, H_kv, N - W\], got 2-D"):
        ripplekv_ext.select_topk(s[0], 5, 2)
    with pytest.raises(RuntimeError, match=r"scores must be Float, got Half"):
        ripplekv_ext.select_topk(s.half(), 5, 2)
    with pytest.raises(RuntimeError, match=r"budget must be >= window \(4\) when compressing \(N = 14\), got 3"):
        ripplekv_ext.select_topk(s, 3, 4)
    with pytest.raises(RuntimeError, match=r"budget must be a non-negative number of tokens, got -2"):
        ripplekv_ext.select_topk(s, -2, 4)
    with pytest.raises(TypeError, match=r"select_topk: budget must be an integer, got float \(5.0\)"):
        ripplekv_ext.select_topk(s, 5.0, 2)
    with pytest.raises(TypeError, match=r"select_topk: budget must be an integer, got bool"):
        ripplekv_ext.select_topk(s, True, 0)
    bad = s.clone()
    bad[0, 1, 7] = float("nan")
    message = r"scores must not contain NaN, got NaN" + (r" at position 7 of row 1" if device.type == "cpu" else "")
    with pytest.raises(RuntimeError, match=message):
        ripplekv_ext.select_topk(bad, 6, 2)
    # Nothing to compress: NaN or a small budget do not matter when every token is kept.
    assert ripplekv_ext.select_topk(bad, 12, 2).shape == (1, 2, 12)


@requires_cuda
def test_cuda_rows_longer_than_2_31():
    # 64-bit counters in the radix select: a row of 2^31 + 64 scores.
    n = (1 << 31) + 64
    if torch.cuda.get_device_properties(0).total_memory < 4 * n * 2.5:
        pytest.skip("needs about 22 GB of GPU memory")
    scores = torch.zeros(1, 1, n, device="cuda")
    picks = torch.tensor([5, (1 << 31) - 1, (1 << 31) + 7, n - 1], device="cuda")
    scores[0, 0, picks] = torch.tensor([4.0, 3.0, 2.0, 1.0], device="cuda")
    idx = ripplekv_ext.select_topk(scores, 4 + 2, 2)  # 4 prefix picks + a window of 2
    assert idx[0, 0].tolist() == picks.tolist() + [n, n + 1]
    # Two more: ties at 0, which go to the lowest positions, with the picks past 2^31 still in order.
    idx = ripplekv_ext.select_topk(scores, 6 + 2, 2)
    assert idx[0, 0, :6].tolist() == [0, 1, 5, (1 << 31) - 1, (1 << 31) + 7, n - 1]


# ---- samples: budgets below, at and above N, no window, strided, an empty batch; opcheck over each -------------------

def select_topk_samples(device):
    s = rand(2, 3, 30, device=device)
    out = [(f"budget {b}", (s, b, 4)) for b in (4, 5, 20, 34, 50)]
    out.append(("no window", (s, 10, 0)))
    out.append(("strided", (rand(2, 3, 60, device=device)[:, :, ::2], 10, 4)))
    out.append(("empty batch", (s[:0], 10, 4)))
    return out


SAMPLES = {"select_topk": select_topk_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    # Empty inputs give empty outputs of the right shape.
    Case("select_topk B=0", lambda d: ripplekv_ext.select_topk(rand(0, 2, 40, device=d), 20, 4), shapes=[(0, 2, 20)]),
    Case("select_topk H=0", lambda d: ripplekv_ext.select_topk(rand(1, 0, 40, device=d), 20, 4), shapes=[(1, 0, 20)]),
    Case("select_topk N=0", lambda d: ripplekv_ext.select_topk(rand(1, 2, 0, device=d), 20, 0), shapes=[(1, 2, 0)]),
    # A budget near 2**63 keeps everything; a window that large cannot make N.
    Case("select_topk budget 2**63-1", lambda d: ripplekv_ext.select_topk(rand(1, 2, 40, device=d), I64_MAX, 4),
         shapes=[(1, 2, 44)], check=lambda d, r: torch.equal(r.cpu(), torch.arange(44).expand(1, 2, 44))),
    Case("select_topk window 2**63-1", lambda d: ripplekv_ext.select_topk(rand(1, 2, 40, device=d), 20, I64_MAX),
         error=(RuntimeError, "overflows int64")),
    # NaN scores: the selection raises, naming the row.
    Case("select_topk NaN", lambda d: ripplekv_ext.select_topk(nan_at(rand(2, 2, 40, device=d), 1, 0, 7), 20, 4),
         error=(RuntimeError, "scores must not contain NaN, got NaN")),
    Case("select_topk NaN, budget == window", lambda d: ripplekv_ext.select_topk(
        nan_at(rand(2, 2, 40, device=d), 1, 1, 7), 4, 4),
         error=(RuntimeError, "of row 3 (row = b * H_kv + h)"), reference="scores must not contain NaN"),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)
