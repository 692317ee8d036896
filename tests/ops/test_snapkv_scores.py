"""snapkv_scores against the reference, hand-worked values and adversarial inputs (snapkv_compress: its own file);
opcheck over the samples, and the bad-input table."""

import os
import subprocess
import sys

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from ripplekv_ref.comparison import SCORE_TOL, assert_same_selection
from devices import COMPILE_BACKEND, DEVICES, requires_cuda
from op_samples import FLOAT_DTYPES, bnhd, nan_at, rand
from op_tables import Case, assert_same_nan_scores, op_tests, other_device, scores_nan_like_reference


def make_window(B, H_q, H_kv, W, N, D, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(B, H_q, W, D, generator=g)).to(dtype=dtype, device=device)
    k = torch.randn(B, H_kv, N, D, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, H_kv, N, D, generator=g).to(dtype=dtype, device=device)
    return q, k, v


def test_assert_same_selection_catches_planted_bugs():
    scores = torch.arange(10.0).view(1, 1, 10)
    ref = ripplekv_ref.select_topk(scores, 6, 2)  # positions 6..9 and the window 10, 11
    assert_same_selection(ref, ref, scores, 2)
    planted = {"a repeated index": [6, 6, 8, 9, 10, 11], "descending": [7, 6, 8, 9, 10, 11],
               "a lower score kept": [5, 7, 8, 9, 10, 11], "the window dropped": [5, 6, 7, 8, 9, 11],
               "a pad after a position": [6, 7, 8, 9, 10, -1]}
    for name, wrong in planted.items():
        with pytest.raises(AssertionError):
            assert_same_selection(torch.tensor([[wrong]]), ref, scores, 2)
            pytest.fail(name)


SHAPES = [  # (B, H_q, H_kv, W, N, D)
    (1, 1, 1, 1, 2, 8),      # the smallest valid problem
    (2, 4, 2, 8, 100, 16),
    (1, 8, 1, 5, 77, 32),    # G = 8
    (1, 3, 3, 31, 32, 64),   # W = N - 1, G = 1
    (1, 9, 3, 32, 300, 64),  # SmolLM2 heads
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_scores_match_reference(shape, pooling, dtype, device):
    B, H_q, H_kv, W, N, D = shape
    q, k, _ = make_window(B, H_q, H_kv, W, N, D, dtype, device)
    ours = ripplekv_ext.snapkv_scores(q, k, pooling=pooling)
    ref = ripplekv_ref.snapkv_scores(q, k, pooling=pooling)
    assert ours.dtype == torch.float32 and ours.shape == (B, H_kv, N - W) and ours.device == k.device
    torch.testing.assert_close(ours, ref, **SCORE_TOL)


@pytest.mark.parametrize("kernel_size, group_reduce, scale", [(1, "max", None), (3, "mean", 0.3), (9, "max", 2.0)])
def test_scores_options(kernel_size, group_reduce, scale, device):
    q, k, _ = make_window(2, 6, 2, 7, 90, 16, torch.float32, device, seed=3)
    ours = ripplekv_ext.snapkv_scores(q, k, kernel_size, "max", group_reduce, scale)
    ref = ripplekv_ref.snapkv_scores(q, k, kernel_size, "max", group_reduce, scale)
    torch.testing.assert_close(ours, ref, **SCORE_TOL)


def test_scores_uniform_attention_by_hand(device):
    # Zero queries attend uniformly: window query i (of W = 2, N = 5) sees 4 + i keys.
    q = torch.zeros(1, 2, 2, 4, device=device)
    k = torch.randn(1, 1, 5, 4, device=device)
    expected = torch.full((1, 1, 3), 1 / 4 + 1 / 5, device=device)
    torch.testing.assert_close(ripplekv_ext.snapkv_scores(q, k, kernel_size=1), expected)


def test_scores_large_logits_stay_finite(device):
    # Logits of several hundred: a softmax without the max subtraction would overflow.
    q, k, _ = make_window(1, 2, 1, 4, 200, 32, torch.float32, device, seed=5, scale=40.0)
    ours = ripplekv_ext.snapkv_scores(q, k)
    assert bool(torch.isfinite(ours).all())
    torch.testing.assert_close(ours, ripplekv_ref.snapkv_scores(q, k), **SCORE_TOL)


@pytest.mark.parametrize("layout", ["bnhd_transposed", "strided_dim"])
def test_non_contiguous(layout, device):
    q, k, v = make_window(2, 4, 2, 6, 70, 16, torch.float16, device, seed=2)
    if layout == "bnhd_transposed":
        q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        q, k = torch.cat([q, q], -1)[..., ::2], torch.cat([k, k], -1)[..., ::2]
    assert not k.is_contiguous()
    torch.testing.assert_close(ripplekv_ext.snapkv_scores(q, k), ripplekv_ref.snapkv_scores(q, k), **SCORE_TOL)


LENGTHS_CASES = {  # name: (N, W, lengths)
    "rows of different lengths": (60, 6, [60, 45, 20, 7]),
    "all-pad and short rows": (40, 8, [0, 40, 8, 3]),
    "no padding": (30, 4, [30, 30]),
}


@pytest.mark.parametrize("case", list(LENGTHS_CASES))
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_scores_with_lengths_equal_each_row_alone(case, pooling, dtype, device):
    n, w, lengths = LENGTHS_CASES[case]
    q, k, _ = make_window(len(lengths), 6, 2, w, n, 16, dtype, "cpu", seed=7)
    for b, n_b in enumerate(lengths):
        k[b, :, : n - n_b] = float("nan")  # pads: never read
    q, k = q.to(device), k.to(device)
    ours = ripplekv_ext.snapkv_scores(q, k, pooling=pooling, lengths=torch.tensor(lengths))
    assert ours.shape == (len(lengths), 2, n - w) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ripplekv_ref.snapkv_scores(q, k, pooling=pooling, lengths=torch.tensor(lengths)),
                               **SCORE_TOL)
    for b, n_b in enumerate(lengths):
        assert bool(torch.isneginf(ours[b, :, : max(0, min(n - n_b, n - w))]).all())
        if n_b > w:  # the row alone: softmax over its real keys, pooling padded at its own boundary
            alone = ripplekv_ext.snapkv_scores(q[b:b + 1], k[b:b + 1, :, n - n_b:], pooling=pooling)
            torch.testing.assert_close(ours[b:b + 1, :, n - n_b:], alone, **SCORE_TOL)
        else:
            assert bool(torch.isneginf(ours[b]).all())


def test_scores_with_lengths_non_contiguous_and_lists(device):
    q, k, _ = make_window(2, 4, 2, 5, 50, 16, torch.float32, device, seed=8)
    q, k = q.transpose(1, 2).contiguous().transpose(1, 2), torch.cat([k, k], -1)[..., ::2]
    ours = ripplekv_ext.snapkv_scores(q, k, lengths=[50, 23])
    torch.testing.assert_close(ours, ripplekv_ref.snapkv_scores(q, k, lengths=torch.tensor([50, 23])), **SCORE_TOL)


def test_scores_with_bad_lengths(device):
    q, k, _ = make_window(2, 4, 2, 5, 50, 16, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"lengths\[1\] \(real tokens of row 1\) must be in \[0, N\] = \[0, 50\], "
                                           r"got 51"):
        ripplekv_ext.snapkv_scores(q, k, lengths=[50, 51])
    with pytest.raises(RuntimeError, match=r"lengths dim 0 \(B\) must be 2, got 3"):
        ripplekv_ext.snapkv_scores(q, k, lengths=[50, 5, 5])
    with pytest.raises(RuntimeError, match=r"lengths must be Long, got Float"):
        ripplekv_ext.snapkv_scores(q, k, lengths=torch.tensor([50.0, 5.0]))


def test_opcheck(device):
    q, k, v = make_window(1, 4, 2, 4, 24, 8, torch.float16, device)
    torch.library.opcheck(torch.ops.ripplekv.snapkv_scores.default, (q, k, 3, "avg", "max", 0.5))
    torch.library.opcheck(torch.ops.ripplekv.snapkv_compress.default, (q, k, v, 10))
    torch.library.opcheck(torch.ops.ripplekv.snapkv_compress.default, (q, k, v, 30))


def test_torch_compile_fullgraph(device):
    q, k, v = make_window(1, 4, 2, 4, 40, 8, torch.float32, device)

    def compress(q, k, v):
        k_c, v_c, idx = ripplekv_ext.snapkv_compress(q, k * 1, v, 12)
        return k_c + 0, v_c, idx, ripplekv_ext.snapkv_scores(q, k) * 2

    k_c, v_c, idx, scores = torch.compile(compress, fullgraph=True, backend=COMPILE_BACKEND)(q, k, v)
    assert torch.equal(idx, ripplekv_ext.snapkv_compress(q, k, v, 12)[2])
    torch.testing.assert_close(scores, 2 * ripplekv_ref.snapkv_scores(q, k), **SCORE_TOL)


def _bad_scores_calls(device):
    q, k, _ = make_window(1, 4, 2, 4, 10, 8, torch.float32, device)
    return {
        "q rank": ((q[0], k), r"snapkv_scores: q_window must be a 4-D tensor \[B, H_q, W, D\], got 3-D"),
        "keys rank": ((q, k[0]), r"keys must be a 4-D tensor \[B, H_kv, N, D\], got 3-D"),
        "dtype": ((q.double(), k.double()), r"q_window must be float32, float16 or bfloat16, got Double"),
        "dtype mix": ((q, k.half()), r"keys must have the dtype of q_window \(Float\), got Half"),
        "heads": ((q[:, :3], k),
                  r"q_window heads \(H_q = 3\) must be a positive multiple of the keys heads \(H_kv = 2\)"),
        "head dim": ((q, k[..., :4]), r"keys dim 3 \(D\) must be 8, got 4"),
        "batch": ((q, torch.cat([k, k])), r"keys dim 0 \(B\) must be 1, got 2"),
        "W >= N": ((q, k[:, :, :4]), r"window W \(q_window dim 2\) must be in \[1, N\) = \[1, 4\), got 4"),
        "kernel": ((q, k, 4), r"kernel_size must be a positive odd number .*, got 4"),
        "pooling": ((q, k, 7, "min"), r"pooling must be 'max' or 'avg', got 'min'"),
        "reduce": ((q, k, 7, "max", "sum"), r"group_reduce must be 'mean' or 'max', got 'sum'"),
    }


@pytest.mark.parametrize("case", list(_bad_scores_calls("cpu")))
def test_scores_bad_input(case, device):
    args, message = _bad_scores_calls(device)[case]
    with pytest.raises(RuntimeError, match=message):
        ripplekv_ext.snapkv_scores(*args)


@requires_cuda
def test_bad_device_mix():
    q, k, v = make_window(1, 4, 2, 4, 10, 8, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"every tensor must be on one device, got q_window on cuda:0, keys on cpu"):
        ripplekv_ext.snapkv_scores(q, k.cpu())


# Run in a fresh process: the CPU store budget (RIPPLEKV_SNAPKV_STORE_MIB) is read once per process.
_STORE_BUDGET_SCRIPT = """
import torch, ripplekv_ext, ripplekv_ref
for n in (1024, 5000):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 8, 32, 16, generator=g), torch.randn(2, 4, n, 16, generator=g),
               torch.randn(2, 4, n, 16, generator=g))
    torch.testing.assert_close(ripplekv_ext.snapkv_scores(q, k), ripplekv_ref.snapkv_scores(q, k), rtol=1e-5, atol=1e-5)
    idx = ripplekv_ext.snapkv_compress(q, k, v, n // 5)[2]
    assert torch.equal(idx, ripplekv_ref.snapkv_compress(q, k, v, n // 5)[2]), n
print("ok")
"""


@pytest.mark.parametrize("kernel", ["default", "portable"])
def test_cpu_store_budget_groups_and_fallback(kernel, tmp_path):
    """With a 1 MiB store budget, one row's kept exps take about 0.27 MiB at N = 1024 (G = 2, W = 32), so the 8 rows
    are scored in groups of 3, 3 and 2; at N = 5000 a row's take 1.3 MiB, more than the budget, so both passes run
    from the keys. The scores and the selection must not change."""
    env = {**os.environ, "RIPPLEKV_SNAPKV_STORE_MIB": "1"}
    if kernel == "portable":
        env["RIPPLEKV_DISABLE_AVX2"] = "1"
    # From an empty folder: `-c` puts the current folder first on sys.path, and a source tree there would shadow the
    # installed package.
    result = subprocess.run([sys.executable, "-c", _STORE_BUDGET_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@requires_cuda
def test_cuda_batch_heads_beyond_grid_y():
    # B * H_q = 65,536 rows: more than gridDim.y allows; B * H now rides on grid.x.
    q, k, v = make_window(2048, 32, 8, 2, 8, 8, torch.float32, "cuda")
    torch.testing.assert_close(ripplekv_ext.snapkv_scores(q, k, kernel_size=3),
                               ripplekv_ref.snapkv_scores(q, k, kernel_size=3), **SCORE_TOL)
    torch.testing.assert_close(ripplekv_ext.h2o_scores(q, k[:, :, :2]), ripplekv_ref.h2o_scores(q, k[:, :, :2]),
                               **SCORE_TOL)


@requires_cuda
def test_cuda_head_dim_beyond_shared_memory_says_so():
    q, k, _ = make_window(1, 2, 1, 2, 8, 4096, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match=r"head dimension D = 4096 needs \d+ bytes of shared memory per block"):
        ripplekv_ext.snapkv_scores(q, k)
    with pytest.raises(RuntimeError, match=r"head dimension D = 4096 needs"):
        ripplekv_ext.h2o_scores(q, k[:, :, :2])


@requires_cuda
def test_cuda_graph_capture_of_scoring_and_compression():
    # Engines capture decode steps: snapkv_compress and select_topk must launch without host syncs while
    # captured, and replay must give the eager result.
    q, k, v = make_window(2, 8, 2, 4, 300, 64, torch.float16, "cuda")
    eager = ripplekv_ext.snapkv_compress(q, k, v, 40)
    scores = ripplekv_ext.snapkv_scores(q, k)
    eager_idx = ripplekv_ext.select_topk(scores, 40, 4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, lazy init)
        ripplekv_ext.snapkv_compress(q, k, v, 40)
        ripplekv_ext.select_topk(scores, 40, 4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ripplekv_ext.snapkv_compress(q, k, v, 40)
        captured_idx = ripplekv_ext.select_topk(scores, 40, 4)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
    assert torch.equal(captured_idx, eager_idx)


# ---- samples: every float dtype, options, no pooling, a transposed cache, an empty batch, lengths; opcheck over each -

def snapkv_scores_samples(device):
    out = []
    for dtype in FLOAT_DTYPES:
        out.append((f"{dtype}", (rand(1, 4, 4, 16, device=device, dtype=dtype),
                                 rand(1, 2, 40, 16, device=device, dtype=dtype, seed=1), 7, "max", "mean", None)))
    q, k = rand(2, 4, 4, 16, device=device), rand(2, 2, 40, 16, device=device, seed=1)
    out.append(("avg, group max, scale", (q, k, 3, "avg", "max", 0.5)))
    out.append(("no pooling", (q, k, 1, "max", "mean", None)))
    out.append(("bnhd", (bnhd(q), bnhd(k), 5, "max", "mean", None)))
    out.append(("empty batch", (q[:0], k[:0], 7, "max", "mean", None)))
    out.append(("lengths", (q, k, 7, "max", "mean", None, torch.tensor([40, 17], device=device))))
    out.append(("lengths on cpu, short row", (bnhd(q), bnhd(k), 5, "avg", "max", None, torch.tensor([3, 40]))))
    return out


SAMPLES = {"snapkv_scores": snapkv_scores_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

BAD_INPUTS = [
    # An empty batch gives empty scores. In a subprocess (crashed_before): a SIGFPE in the CPU driver would end the run.
    Case("snapkv_scores B=0", lambda d: ripplekv_ext.snapkv_scores(
        rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d)),
         shapes=[(0, 2, 56)], crashed_before=True),
    # Sizes that have no meaning raise, as the reference does.
    Case("snapkv_scores H_q=0", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 0, 8, 16, device=d), rand(1, 2, 64, 16, device=d)),
         error=(RuntimeError, "must be a positive multiple of the keys heads"),
         reference="must be a positive multiple of the key heads"),
    Case("snapkv_scores D=0", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 0, device=d), rand(1, 2, 64, 0, device=d)),
         error=(RuntimeError, "head dimension D (dim 3) must be >= 1, got 0")),
    Case("snapkv_scores kernel_size=True", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), kernel_size=True),
         error=(TypeError, "kernel_size must be an integer, got bool")),
    # Every tensor on one device (meta included): no uninitialised memory, no silent no-op.
    Case("snapkv_scores q_window on another device", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d).to(other_device(d)), rand(1, 2, 64, 16, device=d)),
         error=(RuntimeError, "every tensor must be on one device")),
    # lengths: int64 [B], one per row.
    Case("snapkv_scores lengths above N", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), lengths=torch.tensor([65])),
         error=(RuntimeError, "lengths[0] (real tokens of row 0) must be in [0, N] = [0, 64], got 65")),
    Case("snapkv_scores lengths=5", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), lengths=5),
         error=(TypeError, "snapkv_scores: lengths must be an int64 [B] tensor or a list of ints (one per batch row), "
                           "got int (5)")),
    Case("snapkv_scores lengths as a tuple", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), lengths=(64,)), shapes=[(1, 2, 56)]),
    # NaN policy: scoring propagates NaN into the scores (the selection that follows raises).
    Case("snapkv_scores NaN in a window key", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d), nan_at(rand(1, 2, 64, 16, device=d), 0, 1, 60, 3)),
         shapes=[(1, 2, 56)], check=scores_nan_like_reference),
    Case("snapkv_scores inf in q_window", lambda d: ripplekv_ext.snapkv_scores(
        rand(1, 4, 8, 16, device=d).index_fill(3, torch.tensor([0], device=d), float("inf")),
        rand(1, 2, 64, 16, device=d)), shapes=[(1, 2, 56)], check=scores_nan_like_reference),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["snapkv NaN key", "snapkv inf query"])
def test_nan_scores_match_reference(case, device):
    # The policy is the reference's: NaN/inf inputs give NaN scores at the same positions on every backend.
    q, k = rand(1, 4, 8, 16, device=device), rand(1, 2, 64, 16, device=device)
    if case == "snapkv NaN key":
        args = (q, nan_at(k, 0, 1, 60, 3))
    else:
        args = (nan_at(q, 0, 0, 2, 1).nan_to_num(posinf=float("inf"), nan=float("inf")), k)
    assert_same_nan_scores(ripplekv_ext.snapkv_scores(*args), ripplekv_ref.snapkv_scores(*args))
