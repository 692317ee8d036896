"""h2o_scores against the reference, hand-worked values and identities; opcheck over the samples, and the bad-input
table."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ripplekv_ext
import ripplekv_ref
from devices import COMPILE_BACKEND, DEVICES
from op_samples import FLOAT_DTYPES, bnhd, nan_at, rand
from op_tables import Case, assert_same_nan_scores, op_tests, other_device, scores_nan_like_reference

TOL = dict(rtol=1e-5, atol=1e-5)


def make(B, H_q, H_kv, N, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, N, D, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(B, H_kv, N, D, generator=g).to(dtype=dtype, device=device)
    return q, k


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 4), (2, 4, 2, 50, 16), (1, 8, 1, 130, 32), (1, 9, 3, 200, 64)], ids=str)
@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
def test_matches_reference(shape, chunk_size, dtype, device):
    B, H_q, H_kv, N, D = shape
    q, k = make(B, H_q, H_kv, N, D, dtype, device)
    ours = ripplekv_ext.h2o_scores(q, k, chunk_size)
    assert ours.dtype == torch.float32 and ours.shape == (B, H_kv, N)
    torch.testing.assert_close(ours, ripplekv_ref.h2o_scores(q, k, chunk_size), **TOL)


@pytest.mark.parametrize("lengths", [[50, 31, 1, 0], [50, 50]], ids=["padded", "no padding"])
def test_lengths_equal_each_row_alone(lengths, dtype, device):
    n = 50
    q, k = make(len(lengths), 4, 2, n, 16, dtype, "cpu", seed=2)
    for b, n_b in enumerate(lengths):  # pads: never read
        q[b, :, : n - n_b] = float("nan")
        k[b, :, : n - n_b] = float("nan")
    q, k = q.to(device), k.to(device)
    ours = ripplekv_ext.h2o_scores(q, k, 7, lengths=torch.tensor(lengths))
    torch.testing.assert_close(ours, ripplekv_ref.h2o_scores(q, k, 7, lengths=torch.tensor(lengths)), **TOL)
    for b, n_b in enumerate(lengths):
        assert bool(torch.isneginf(ours[b, :, : n - n_b]).all())
        if n_b > 0:
            alone = ripplekv_ext.h2o_scores(q[b:b + 1, :, n - n_b:], k[b:b + 1, :, n - n_b:], 7)
            torch.testing.assert_close(ours[b:b + 1, :, n - n_b:], alone, **TOL)


def test_options(device):
    q, k = make(1, 4, 2, 60, 8, torch.float32, device, seed=4)
    for scale, reduce in ((0.5, "max"), (None, "mean"), (3.0, "mean")):
        torch.testing.assert_close(ripplekv_ext.h2o_scores(q, k, 16, scale, reduce),
                                   ripplekv_ref.h2o_scores(q, k, 16, scale, reduce), **TOL)


def test_uniform_attention_by_hand_and_total_mass(device):
    n = 6
    q = torch.zeros(1, 2, n, 4, device=device)
    k = torch.randn(1, 1, n, 4, device=device)
    expected = torch.tensor([sum(1 / (i + 1) for i in range(j, n)) for j in range(n)], device=device)
    torch.testing.assert_close(ripplekv_ext.h2o_scores(q, k, 4)[0, 0], expected)
    # Each query distributes exactly 1 over the keys, so every KV head's total is N.
    q, k = make(2, 4, 2, 90, 16, torch.float32, device)
    torch.testing.assert_close(ripplekv_ext.h2o_scores(q, k).sum(-1), torch.full((2, 2), 90.0, device=device),
                               rtol=1e-4, atol=1e-3)


def test_chunking_does_not_change_the_result(device):
    q, k = make(1, 2, 1, 77, 8, torch.float32, device)
    whole = ripplekv_ext.h2o_scores(q, k, 77)
    for chunk in (1, 5, 32, 1000):
        torch.testing.assert_close(ripplekv_ext.h2o_scores(q, k, chunk), whole, **TOL)


@settings(max_examples=20, deadline=None)
@given(H_kv=st.integers(1, 3), G=st.sampled_from([1, 2, 8]), N=st.integers(1, 70), D=st.sampled_from([1, 8, 32]),
       chunk=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_property_matches_reference(H_kv, G, N, D, chunk, seed):
    q, k = make(1, G * H_kv, H_kv, N, D, torch.float32, "cpu", seed)
    torch.testing.assert_close(ripplekv_ext.h2o_scores(q, k, chunk), ripplekv_ref.h2o_scores(q, k, chunk), **TOL)


def test_opcheck(device):
    q, k = make(1, 4, 2, 20, 8, torch.float16, device)
    torch.library.opcheck(torch.ops.ripplekv.h2o_scores.default, (q, k, 8, None, "max"))


def test_torch_compile_fullgraph(device):
    q, k = make(1, 2, 1, 30, 8, torch.float32, device)
    fn = torch.compile(lambda q, k: ripplekv_ext.h2o_scores(q, k, 8)[..., :-4] + 0, fullgraph=True,
                       backend=COMPILE_BACKEND)
    torch.testing.assert_close(fn(q, k), ripplekv_ref.h2o_scores(q, k)[..., :-4], **TOL)


def test_bad_input(device):
    q, k = make(1, 4, 2, 10, 8, torch.float32, device)
    cases = [
        ((q[0], k), r"h2o_scores: queries must be a 4-D tensor \[B, H_q, N, D\], got 3-D"),
        ((q, k[:, :, :9]), r"keys dim 2 \(N\) must be 10, got 9"),
        ((q[:, :3], k), r"queries heads \(H_q = 3\) must be a positive multiple of the keys heads \(H_kv = 2\)"),
        ((q, k.half()), r"keys must have the dtype of queries \(Float\), got Half"),
        ((q.int(), k.int()), r"queries must be float32, float16 or bfloat16, got Int"),
        ((q, k, 0), r"chunk_size must be >= 1, got 0"),
        ((q, k, 8, None, "sum"), r"group_reduce must be 'mean' or 'max', got 'sum'"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ripplekv_ext.h2o_scores(*args)


# ---- samples: every float dtype, chunks and options, bnhd, an empty batch, lengths; opcheck over each ----------------

def h2o_scores_samples(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (rand(1, 4, 24, 8, device=device, dtype=dtype),
                                 rand(1, 2, 24, 8, device=device, dtype=dtype, seed=1), 1024, None, "mean")))
    q, k = rand(2, 4, 24, 8, device=device), rand(2, 2, 24, 8, device=device, seed=1)
    out.append(("chunks, scale, group max", (q, k, 5, 0.3, "max")))
    out.append(("bnhd", (bnhd(q), bnhd(k), 8, None, "mean")))
    out.append(("empty batch", (q[:0], k[:0], 8, None, "mean")))
    out.append(("lengths", (q, k, 5, None, "mean", torch.tensor([24, 9], device=device))))
    out.append(("lengths, all-pad row", (bnhd(q), bnhd(k), 8, 0.3, "max", torch.tensor([0, 24]))))
    return out


SAMPLES = {"h2o_scores": h2o_scores_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    # Empty inputs give empty outputs of the right shape.
    Case("h2o_scores B=0", lambda d: ripplekv_ext.h2o_scores(rand(0, 4, 32, 8, device=d), rand(0, 2, 32, 8, device=d)),
         shapes=[(0, 2, 32)]),
    Case("h2o_scores N=0", lambda d: ripplekv_ext.h2o_scores(rand(1, 4, 0, 8, device=d), rand(1, 2, 0, 8, device=d)),
         shapes=[(1, 2, 0)]),
    # Sizes that have no meaning raise, as the reference does.
    Case("h2o_scores H_q=0", lambda d: ripplekv_ext.h2o_scores(
        rand(1, 0, 32, 8, device=d), rand(1, 2, 32, 8, device=d)),
         error=(RuntimeError, "must be a positive multiple of the keys heads"),
         reference="must be a positive multiple of the key heads"),
    Case("h2o_scores D=0", lambda d: ripplekv_ext.h2o_scores(rand(1, 4, 32, 0, device=d), rand(1, 2, 32, 0, device=d)),
         error=(RuntimeError, "head dimension D (dim 3) must be >= 1, got 0")),
    # Every tensor on one device (meta included): no uninitialised memory, no silent no-op.
    Case("h2o_scores queries on another device", lambda d: ripplekv_ext.h2o_scores(
        rand(1, 4, 32, 8, device=other_device(d)), rand(1, 2, 32, 8, device=d)),
         error=(RuntimeError, "every tensor must be on one device")),
    # lengths: int64 [B], one per row; a lone int says what the argument must be.
    Case("h2o_scores lengths of another size", lambda d: ripplekv_ext.h2o_scores(
        rand(1, 4, 32, 8, device=d), rand(1, 2, 32, 8, device=d), lengths=torch.tensor([32, 32])),
         error=(RuntimeError, "lengths dim 0 (B) must be 1, got 2"),
         reference="lengths must have B = 1 entries, got 2"),
    Case("h2o_scores lengths=32", lambda d: ripplekv_ext.h2o_scores(
        rand(1, 4, 32, 8, device=d), rand(1, 2, 32, 8, device=d), lengths=32),
         error=(TypeError, "h2o_scores: lengths must be an int64 [B] tensor or a list of ints")),
    # NaN policy: scoring propagates NaN into the scores (the selection that follows raises).
    Case("h2o_scores NaN in a key", lambda d: ripplekv_ext.h2o_scores(
        rand(1, 4, 32, 8, device=d), nan_at(rand(1, 2, 32, 8, device=d), 0, 0, 5, 0)),
         shapes=[(1, 2, 32)], check=scores_nan_like_reference),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_scores_match_reference(device):
    # The policy is the reference's: NaN/inf inputs give NaN scores at the same positions on every backend.
    args = (rand(1, 4, 32, 8, device=device), nan_at(rand(1, 2, 32, 8, device=device), 0, 0, 5, 0))
    assert_same_nan_scores(ripplekv_ext.h2o_scores(*args), ripplekv_ref.h2o_scores(*args))
