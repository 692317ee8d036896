"""snapkv_compress_rows: a left-padded batch compressed per row in one call, against the reference and against
snapkv_compress of each row alone; opcheck over the samples, and the bad-input table."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from devices import COMPILE_BACKEND, requires_cuda
from op_samples import FLOAT_DTYPES, bnhd, nan_at, rand
from op_tables import Case, op_tests
from ripplekv_ref.comparison import assert_same_selection
from test_snapkv_scores import make_window

W = 6


def padded_batch(lengths, n, dtype, device, h_q=4, h_kv=2, d=16, seed=0):
    """q/k/v whose pad positions hold NaN: nothing of a pad may reach a real row's result."""
    q, k, v = make_window(len(lengths), h_q, h_kv, W, n, d, dtype, "cpu", seed=seed)
    for b, n_b in enumerate(lengths):
        k[b, :, : n - n_b] = float("nan")
        v[b, :, : n - n_b] = float("nan")
        if n_b < W:
            q[b, :, : W - n_b] = float("nan")  # a row shorter than the window has pad queries too
    return q.to(device), k.to(device), v.to(device)


def check_rows(q, k, v, budgets, lengths, out):
    """Each row equals snapkv_compress of the row alone (indices up to near ties of the fp32 scores, K/V exactly
    the rows the indices name), right-aligned, with -1 and zeros in the pad slots."""
    k_c, v_c, idx = out
    n = k.shape[2]
    kept = [min(c, n_b) for c, n_b in zip(budgets, lengths)]
    c_max = max(kept, default=0)
    assert idx.shape == (k.shape[0], k.shape[1], c_max) and k_c.shape == v_c.shape == (*idx.shape, k.shape[3])
    assert k_c.dtype == k.dtype and idx.dtype == torch.int64
    for b, (n_b, c, c_b) in enumerate(zip(lengths, budgets, kept)):
        pad = c_max - c_b
        assert bool((idx[b, :, :pad] == -1).all())
        assert bool((k_c[b, :, :pad] == 0).all()) and bool((v_c[b, :, :pad] == 0).all())
        if c_b == 0:
            continue
        row_idx = idx[b:b + 1, :, pad:]
        row_k, row_v = k[b:b + 1, :, n - n_b:], v[b:b + 1, :, n - n_b:]
        if n_b <= c:
            assert torch.equal(row_idx, torch.arange(n - n_b, n, device=k.device).expand(1, k.shape[1], n_b))
        else:
            _, _, alone = ripplekv_ext.snapkv_compress(q[b:b + 1], row_k, row_v, c)
            assert_same_selection(row_idx - (n - n_b), alone, ripplekv_ref.snapkv_scores(q[b:b + 1], row_k), W)
        k_g, v_g = ripplekv_ref.gather_kv(k[b:b + 1], v[b:b + 1], row_idx)
        assert torch.equal(k_c[b:b + 1, :, pad:], k_g) and torch.equal(v_c[b:b + 1, :, pad:], v_g)


CASES = {  # name: (N, lengths, budgets)
    "budgets differing by row": (64, [64, 50, 33, 20], [20, 30, 12, 9]),
    "budget covers the row": (48, [48, 15, 30], [16, 15, 40]),
    "all-pad rows": (40, [0, 40, 0], [10, 12, 10]),
    "rows shorter than the window": (40, [4, 40, 1, 6], [8, 10, 2, 6]),
    "window-only budgets": (40, [40, 25], [W, W]),
    "no padding": (40, [40, 40], [12, 20]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_match_reference_and_each_row_alone(case, dtype, device):
    n, lengths, budgets = CASES[case]
    q, k, v = padded_batch(lengths, n, dtype, device)
    out = ripplekv_ext.snapkv_compress_rows(q, k, v, torch.tensor(budgets), torch.tensor(lengths))
    check_rows(q, k, v, budgets, lengths, out)
    _, _, idx_ref = ripplekv_ref.snapkv_compress_rows(q, k, v, torch.tensor(budgets), torch.tensor(lengths))
    scores_ref = ripplekv_ref.snapkv_scores(q, k, lengths=torch.tensor(lengths))
    assert_same_selection(out[2], idx_ref, scores_ref, W)


@pytest.mark.parametrize("pooling, group_reduce, kernel_size, scale",
                         [("avg", "max", 3, 0.5), ("max", "mean", 1, None)])
def test_options(pooling, group_reduce, kernel_size, scale, device):
    lengths, budgets = [50, 31], [14, 11]
    q, k, v = padded_batch(lengths, 50, torch.float32, device, h_q=6, h_kv=3, seed=4)
    out = ripplekv_ext.snapkv_compress_rows(q, k, v, budgets, lengths, kernel_size, pooling, group_reduce, scale)
    ref = ripplekv_ref.snapkv_compress_rows(q, k, v, torch.tensor(budgets), torch.tensor(lengths), kernel_size,
                                            pooling, group_reduce, scale)
    scores_ref = ripplekv_ref.snapkv_scores(q, k, kernel_size, pooling, group_reduce, scale, torch.tensor(lengths))
    assert_same_selection(out[2], ref[2], scores_ref, W)
    k_g, v_g = ripplekv_ref.gather_kv(k, v, out[2])
    assert torch.equal(out[0], k_g) and torch.equal(out[1], v_g)


@pytest.mark.parametrize("layout", ["bnhd_transposed", "strided_dim"])
def test_non_contiguous(layout, device):
    lengths, budgets = [60, 41, 25], [17, 20, 9]
    q, k, v = padded_batch(lengths, 60, torch.float16, device, seed=2)
    if layout == "bnhd_transposed":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = (torch.cat([t, t], -1)[..., ::2] for t in (q, k, v))
    assert not k.is_contiguous()
    check_rows(q, k, v, budgets, lengths, ripplekv_ext.snapkv_compress_rows(q, k, v, budgets, lengths))


def test_gather_of_the_padded_indices_gives_the_padded_outputs(device):
    # The pad slots' -1 make gather_kv write zeros: the indices alone rebuild the compressed batch.
    lengths, budgets = [40, 12, 0], [10, 12, 10]
    q, k, v = padded_batch(lengths, 40, torch.float32, device)
    k_c, v_c, idx = ripplekv_ext.snapkv_compress_rows(q, k, v, budgets, lengths)
    k_g, v_g = ripplekv_ext.gather_kv(k, v, idx)  # the pads hold NaN: a -1 slot reads none of it
    assert torch.equal(k_g, k_c) and torch.equal(v_g, v_c)


def test_empty_batch(device):
    q, k, v = make_window(0, 4, 2, W, 30, 8, torch.float32, device)
    k_c, v_c, idx = ripplekv_ext.snapkv_compress_rows(q, k, v, [], [])
    assert k_c.shape == (0, 2, 0, 8) and idx.shape == (0, 2, 0)


def test_nan_in_a_real_row_names_the_row(device):
    lengths = [40, 30]
    q, k, v = padded_batch(lengths, 40, torch.float32, device)
    k[1, 0, 20] = float("nan")
    with pytest.raises(RuntimeError, match=r"snapkv_compress_rows: scores must not contain NaN, got NaN in batch "
                                           r"row 1"):
        ripplekv_ext.snapkv_compress_rows(q, k, v, [10, 10], lengths)


BAD = {
    "budget below window": (([40, 30], [10, 3]), r"budgets\[1\] must be >= window \(6\) when row 1 is compressed"),
    "length above N": (([41, 30], [10, 10]), r"lengths\[0\] \(real tokens of row 0\) must be in \[0, N\] = \[0, 40\]"),
    "lengths size": (([40], [10, 10]), r"lengths dim 0 \(B\) must be 2, got 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case, device):
    (lengths, budgets), message = BAD[case]
    q, k, v = make_window(2, 4, 2, W, 40, 8, torch.float32, device)
    with pytest.raises(RuntimeError, match=message):
        ripplekv_ext.snapkv_compress_rows(q, k, v, budgets, lengths)
    with pytest.raises(ValueError):
        ripplekv_ref.snapkv_compress_rows(q, k, v, torch.tensor(budgets), torch.tensor(lengths))


def test_torch_compile_fullgraph(device):
    # The fake kernels give C_max as an unbacked size: the whole call compiles into one graph.
    lengths, budgets = torch.tensor([30, 17]), torch.tensor([10, 8])
    q, k, v = make_window(2, 4, 2, W, 30, 8, torch.float32, device)

    def compress(q, k, v, budgets, lengths):
        k_c, v_c, idx = ripplekv_ext.snapkv_compress_rows(q, k * 1, v, budgets, lengths)
        return k_c + 0, idx, ripplekv_ext.select_topk_rows(ripplekv_ext.snapkv_scores(q, k, lengths=lengths), budgets,
                                                            W, lengths)

    compiled = torch.compile(compress, fullgraph=True, backend=COMPILE_BACKEND)
    k_c, idx, idx_from_scores = compiled(q, k, v, budgets, lengths)
    expected = ripplekv_ref.snapkv_compress_rows(q, k, v, budgets, lengths)
    assert torch.equal(idx, idx_from_scores) and torch.equal(k_c, ripplekv_ref.gather_kv(k, v, idx)[0])
    assert_same_selection(idx, expected[2], ripplekv_ref.snapkv_scores(q, k, lengths=lengths), W)


@requires_cuda
def test_cuda_lengths_on_the_device():
    lengths, budgets = [64, 40, 3], [16, 12, 8]
    q, k, v = padded_batch(lengths, 64, torch.bfloat16, "cuda")
    out = ripplekv_ext.snapkv_compress_rows(q, k, v, torch.tensor(budgets, device="cuda"),
                                            torch.tensor(lengths, device="cuda"))
    check_rows(q, k, v, budgets, lengths, out)


# ---- samples: every float dtype, all-pad and short rows, options, bnhd, an empty batch; opcheck over each ------------

def lengths_and_budgets(lengths, budgets, device):
    return (torch.tensor(budgets, dtype=torch.int64, device=device),
            torch.tensor(lengths, dtype=torch.int64, device=device))


def snapkv_compress_rows_samples(device):
    out = []
    for dtype in FLOAT_DTYPES:
        q, k, v = (rand(3, 4, 4, 16, device=device, dtype=dtype),
                   rand(3, 2, 40, 16, device=device, dtype=dtype, seed=1),
                   rand(3, 2, 40, 16, device=device, dtype=dtype, seed=2))
        out.append((f"{dtype}", (q, k, v, *lengths_and_budgets([40, 25, 9], [12, 20, 9], device), 7, "max", "mean",
                                 None)))
    q, k, v = (rand(3, 4, 4, 16, device=device), rand(3, 2, 40, 16, device=device, seed=1),
               rand(3, 2, 40, 16, device=device, seed=2))
    out.append(("all-pad and short rows", (q, k, v, *lengths_and_budgets([0, 40, 2], [8, 4, 8], device), 7, "max",
                                           "mean", None)))
    out.append(("avg, group max, scale", (q, k, v, *lengths_and_budgets([40, 30, 20], [10, 10, 10], device), 3, "avg",
                                          "max", 0.5)))
    out.append(("bnhd", (bnhd(q), bnhd(k), bnhd(v), *lengths_and_budgets([33, 40, 12], [10, 9, 8], device), 7,
                         "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], v[:0], *lengths_and_budgets([], [], device), 7, "max", "mean", None)))
    return out


SAMPLES = {"snapkv_compress_rows": snapkv_compress_rows_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    Case("snapkv_compress_rows B=0", lambda d: ripplekv_ext.snapkv_compress_rows(
        rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d), rand(0, 2, 64, 16, device=d),
        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)),
         shapes=[(0, 2, 0, 16), (0, 2, 0, 16), (0, 2, 0)]),
    Case("snapkv_compress_rows budget below window", lambda d: ripplekv_ext.snapkv_compress_rows(
        rand(2, 4, 8, 16, device=d), rand(2, 2, 64, 16, device=d), rand(2, 2, 64, 16, device=d),
        torch.tensor([20, 5]), torch.tensor([64, 30])),
         error=(RuntimeError, "budgets[1] must be >= window (8) when row 1 is compressed")),
    # A lone int where one value per row is expected: say what the argument must be.
    Case("snapkv_compress_rows lengths=64", lambda d: ripplekv_ext.snapkv_compress_rows(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=d), [20], 64),
         error=(TypeError, "snapkv_compress_rows: lengths must be an int64 [B] tensor or a list of ints")),
    # NaN in a real key raises, naming the row; NaN in a pad is never read.
    Case("snapkv_compress_rows NaN in a real key", lambda d: ripplekv_ext.snapkv_compress_rows(
        rand(2, 4, 8, 16, device=d), nan_at(rand(2, 2, 64, 16, device=d), 1, 0, 40, 0), rand(2, 2, 64, 16, device=d),
        torch.tensor([20, 20]), torch.tensor([64, 30])),
         error=(RuntimeError, "scores must not contain NaN, got NaN in batch row 1"),
         reference="scores must not contain NaN"),
    Case("snapkv_compress_rows NaN in a pad key", lambda d: ripplekv_ext.snapkv_compress_rows(
        rand(2, 4, 8, 16, device=d), nan_at(rand(2, 2, 64, 16, device=d), 1, 0, 10, 0), rand(2, 2, 64, 16, device=d),
        torch.tensor([20, 20]), torch.tensor([64, 30])),
         shapes=[(2, 2, 20, 16), (2, 2, 20, 16), (2, 2, 20)], check=lambda d, r: not bool(torch.isnan(r[0]).any())),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)
