"""select_topk_rows: per-row budgets of a left-padded batch, against the reference and against each row alone;
opcheck over the samples, and the bad-input table."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from devices import requires_cuda
from op_samples import nan_at, rand
from op_tables import Case, op_tests

W = 4
N = 30


def padded_scores(lengths, n=N, window=W, heads=3, seed=0, device="cpu", ties=False):
    """Scores [B, H, N - W] whose pad positions hold NaN: the op must never read them."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(len(lengths), heads, n - window, generator=g)
    if ties:  # coarse values: many exact ties, decided by position
        s = (s * 2).round()
    for b, n_b in enumerate(lengths):
        s[b, :, : n - n_b] = float("nan")
    return s.to(device)


def rows_alone(scores, budgets, window, lengths):
    """The contract: row b is select_topk of its real scores alone, shifted to absolute positions, right-aligned."""
    n = scores.shape[-1] + window
    kept = [min(c, n_b) for c, n_b in zip(budgets, lengths)]
    c_max = max(kept, default=0)
    out = torch.full((scores.shape[0], scores.shape[1], c_max), -1, dtype=torch.int64)
    for b, (n_b, c, c_b) in enumerate(zip(lengths, budgets, kept)):
        if c_b == 0:
            continue
        if n_b <= c:
            out[b, :, c_max - c_b:] = torch.arange(n - n_b, n)
        else:
            kept = ripplekv_ref.select_topk(scores[b:b + 1, :, n - n_b:].cpu(), c, window)
            out[b:b + 1, :, c_max - c_b:] = kept + n - n_b
    return out


CASES = {  # name: (lengths, budgets)
    "budgets differing by row": ([30, 25, 18, 12], [10, 16, 8, 6]),
    "budget covers the row": ([30, 9, 20], [12, 9, 40]),
    "all-pad rows": ([0, 30, 0], [10, 10, 10]),
    "rows shorter than the window": ([3, 30, 1], [10, 8, 2]),
    "window-only budgets": ([30, 20], [W, W]),
    "no padding": ([30, 30], [12, 20]),
    "every row kept whole": ([5, 7], [30, 30]),
    "single row": ([17], [9]),
}


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_rows_alone(case, ties, device):
    lengths, budgets = CASES[case]
    scores = padded_scores(lengths, device=device, ties=ties)
    got = ripplekv_ext.select_topk_rows(scores, torch.tensor(budgets), W, torch.tensor(lengths))
    assert got.dtype == torch.int64 and got.device == scores.device
    ref = ripplekv_ref.select_topk_rows(scores.cpu(), torch.tensor(budgets), W, torch.tensor(lengths))
    assert torch.equal(got.cpu(), ref)
    assert torch.equal(got.cpu(), rows_alone(scores, budgets, W, lengths))


def test_non_contiguous_scores_and_list_arguments(device):
    lengths, budgets = [30, 14, 22], [9, 7, 30]
    base = torch.randn(3, 3, 2 * (N - W), generator=torch.Generator().manual_seed(3)).to(device)
    scores = base[:, :, ::2]  # strided [B, H, N - W]
    for b, n_b in enumerate(lengths):
        scores[b, :, : N - n_b] = float("nan")
    transposed = scores.transpose(0, 1).contiguous().transpose(0, 1)  # [H, B, ...] memory seen as [B, H, ...]
    for s in (scores, transposed):
        got = ripplekv_ext.select_topk_rows(s, budgets, W, lengths)
        assert torch.equal(got.cpu(), ripplekv_ref.select_topk_rows(s.cpu(), torch.tensor(budgets), W,
                                                                    torch.tensor(lengths)))


def test_empty_batch_and_no_heads(device):
    assert ripplekv_ext.select_topk_rows(torch.zeros(0, 2, 10, device=device), [], W, []).shape == (0, 2, 0)
    got = ripplekv_ext.select_topk_rows(torch.zeros(2, 0, 10, device=device), [6, 8], W, [14, 3])
    assert got.shape == (2, 0, 6)


def test_nan_in_a_compressed_row_names_the_row(device):
    lengths = [30, 20]
    scores = padded_scores(lengths, device=device)
    scores[1, 2, 15] = float("nan")  # row 1's real prefix is [10, 26)
    with pytest.raises(RuntimeError, match=r"select_topk_rows: scores must not contain NaN, got NaN in batch row 1 "
                                           r"\(KV head 2, position 15\)"):
        ripplekv_ext.select_topk_rows(scores, [8, 8], W, lengths)
    # A row kept whole is not selected, so its scores are not read (as select_topk with N <= budget).
    got = ripplekv_ext.select_topk_rows(scores, [8, 20], W, lengths)
    assert torch.equal(got[1, :, -20:].cpu(), torch.arange(10, 30).expand(3, 20))


BAD = {
    "budget below window": (([30, 20], [8, 3]), r"budgets\[1\] must be >= window \(4\) when row 1 is compressed"),
    "negative budget": (([30, 20], [8, -1]), r"budgets\[1\] must be a non-negative number of tokens, got -1"),
    "length above N": (([31, 20], [8, 8]),
                       r"lengths\[0\] \(real tokens of row 0\) must be in \[0, N\] = \[0, 30\], got 31"),
    "negative length": (([30, -2], [8, 8]), r"lengths\[1\] .* must be in \[0, N\] = \[0, 30\], got -2"),
    "lengths size": (([30], [8, 8]), r"lengths dim 0 \(B\) must be 2, got 1"),
    "budgets size": (([30, 20], [8]), r"budgets dim 0 \(B\) must be 2, got 1"),
}


# Where the reference words the same refusal otherwise.
REFERENCE_MESSAGES = {"lengths size": r"lengths must have B = 2 entries, got 1",
                      "budgets size": r"budgets must have B = 2 entries, got 1"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case, device):
    (lengths, budgets), message = BAD[case]
    scores = torch.randn(2, 3, N - W, device=device)
    with pytest.raises(RuntimeError, match=message):
        ripplekv_ext.select_topk_rows(scores, budgets, W, lengths)
    with pytest.raises(ValueError, match=REFERENCE_MESSAGES.get(case, message)):
        ripplekv_ref.select_topk_rows(scores.cpu(), torch.tensor(budgets), W, torch.tensor(lengths))


def test_bad_tensor_arguments():
    scores = torch.randn(2, 3, N - W)
    with pytest.raises(RuntimeError, match=r"lengths must be Long, got Int"):
        ripplekv_ext.select_topk_rows(scores, [8, 8], W, torch.tensor([30, 20], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"budgets must be a 1-D tensor \[B\], got 2-D"):
        ripplekv_ext.select_topk_rows(scores, torch.tensor([[8, 8]]), W, [30, 20])
    with pytest.raises(RuntimeError, match=r"scores must be Float, got Half"):
        ripplekv_ext.select_topk_rows(scores.half(), [8, 8], W, [30, 20])


@requires_cuda
def test_cuda_lengths_on_the_device_or_the_cpu():
    lengths, budgets = [30, 11, 0], [9, 6, 5]
    scores = padded_scores(lengths, device="cuda")
    expected = ripplekv_ref.select_topk_rows(scores.cpu(), torch.tensor(budgets), W, torch.tensor(lengths))
    for where in ("cuda", "cpu"):
        got = ripplekv_ext.select_topk_rows(scores, torch.tensor(budgets, device=where), W,
                                            torch.tensor(lengths, device=where))
        assert torch.equal(got.cpu(), expected)


# ---- samples: budgets by row, all-pad and short rows, lengths on the CPU, strided, an empty batch; opcheck over each -

def select_topk_rows_samples(device):
    def args(scores, lengths, budgets, where=device):
        return (scores, torch.tensor(budgets, dtype=torch.int64, device=where), 4,
                torch.tensor(lengths, dtype=torch.int64, device=where))

    s = rand(3, 2, 30, device=device)
    return [("budgets by row", args(s, [34, 20, 10], [10, 15, 10])),
            ("all-pad, whole and short rows", args(s, [0, 12, 3], [10, 34, 8])),
            ("lengths on cpu", args(s, [34, 34, 30], [12, 12, 12], where="cpu")),
            ("strided", args(rand(3, 2, 60, device=device)[:, :, ::2], [34, 31, 5], [6, 7, 4])),
            ("empty batch", args(s[:0], [], []))]


SAMPLES = {"select_topk_rows": select_topk_rows_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    Case("select_topk_rows B=0", lambda d: ripplekv_ext.select_topk_rows(
        rand(0, 2, 40, device=d), torch.zeros(0, dtype=torch.long), 4, torch.zeros(0, dtype=torch.long)),
         shapes=[(0, 2, 0)]),
    Case("select_topk_rows every row all-pad", lambda d: ripplekv_ext.select_topk_rows(
        rand(2, 2, 40, device=d), torch.tensor([10, 10]), 4, torch.tensor([0, 0])), shapes=[(2, 2, 0)]),
    Case("select_topk_rows budget below window", lambda d: ripplekv_ext.select_topk_rows(
        rand(2, 2, 40, device=d), torch.tensor([10, 3]), 4, torch.tensor([44, 30])),
         error=(RuntimeError, "budgets[1] must be >= window (4) when row 1 is compressed")),
    Case("select_topk_rows length above N", lambda d: ripplekv_ext.select_topk_rows(
        rand(2, 2, 40, device=d), torch.tensor([10, 10]), 4, torch.tensor([45, 30])),
         error=(RuntimeError, "lengths[0] (real tokens of row 0) must be in [0, N] = [0, 44], got 45")),
    Case("select_topk_rows budgets of another size", lambda d: ripplekv_ext.select_topk_rows(
        rand(2, 2, 40, device=d), torch.tensor([10]), 4, torch.tensor([44, 30])),
         error=(RuntimeError, "budgets dim 0 (B) must be 2, got 1"),
         reference="budgets must have B = 2 entries, got 1"),
    Case("select_topk_rows lengths on the meta device", lambda d: ripplekv_ext.select_topk_rows(
        rand(2, 2, 40, device=d), torch.tensor([10, 10]), 4, torch.tensor([44, 30], device="meta")),
         error=(RuntimeError, "lengths must be on the CPU or on the device of the data")),
    # A lone int where one value per row is expected: say what the argument must be.
    Case("select_topk_rows budgets=10", lambda d: ripplekv_ext.select_topk_rows(rand(1, 2, 40, device=d), 10, 4, [44]),
         error=(TypeError, "select_topk_rows: budgets must be an int64 [B] tensor or a list of ints")),
    Case("select_topk_rows lengths='44'", lambda d: ripplekv_ext.select_topk_rows(
        rand(1, 2, 40, device=d), [10], 4, "44"),
         error=(TypeError, "select_topk_rows: lengths must be an int64 [B] tensor or a list of ints "
                           "(one per batch row), got str")),
    # NaN in a row that is compressed: the selection raises, naming the row.
    Case("select_topk_rows NaN in a compressed row", lambda d: ripplekv_ext.select_topk_rows(
        nan_at(rand(2, 2, 40, device=d), 1, 0, 30), torch.tensor([10, 10]), 4, torch.tensor([44, 30])),
         error=(RuntimeError, "scores must not contain NaN, got NaN in batch row 1 (KV head 0, position 30)"),
         reference="scores must not contain NaN, got NaN in batch row 1"),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)
