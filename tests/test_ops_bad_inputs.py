"""The bad-input table of every op: case -> the exception type and a fragment of its message, or the empty output
expected. Each case runs on CPU and, where a GPU exists, on CUDA tensors.

Cases that could kill the process (SIGFPE in the CPU SnapKV driver on an empty batch) run in a subprocess, so a
crash shows as a failed test instead of ending the run. `python tests/test_ops_bad_inputs.py [cpu|cuda]` prints the
table with the behaviour of each case (the closing note's table).
"""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import pytest
import torch

import ripplekv_ext as rk
import ripplekv_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import DEVICES  # noqa: E402

I64_MAX = 2 ** 63 - 1


@dataclass
class Case:
    name: str
    call: Callable[[str], object]            # device -> the op's result
    error: Optional[Tuple[type, str]] = None  # (exception type, message fragment), or None: the call returns
    shapes: Optional[list] = None            # expected output shapes when it returns
    check: Optional[Callable] = None         # extra check of the result (device, result)
    crashed_before: bool = False             # once killed the process: run in a subprocess


def rand(*shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def idx(*shape, n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, shape, generator=g).to(device)


def other_device(device):
    # A device the call's other tensors are not on: meta everywhere (the fake kernel's dispatch path), CPU next to CUDA.
    return "cpu" if device == "cuda" else "meta"


def nan_at(t, *index):
    t = t.clone()
    t[index] = float("nan")
    return t


def _scores_nan_like_reference(device, result):
    assert torch.isnan(result).any(), "NaN inputs must give NaN scores"


def _packed_gather(device, offsets=None, bad_index=False, b=1):
    keys = [rand(b, 2, 12, 4, device=device, seed=s) for s in range(2)]
    values = [rand(b, 2, 12, 4, device=device, seed=s + 5) for s in range(2)]
    flat = idx(b, 2, 7, n=12, device=device)
    if bad_index:
        flat[..., -1] = -1
    off = torch.tensor([0, 3, 7] if offsets is None else offsets, device=device)
    return rk.gather_kv_packed(keys, values, flat, off)


CASES = [
    # Empty inputs give empty outputs of the right shape, on every op and backend.
    Case("snapkv_scores B=0", lambda d: rk.snapkv_scores(rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d)),
         shapes=[(0, 2, 56)], crashed_before=True),
    Case("snapkv_compress B=0", lambda d: rk.snapkv_compress(rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d),
                                                             rand(0, 2, 64, 16, device=d), 20),
         shapes=[(0, 2, 20, 16), (0, 2, 20, 16), (0, 2, 20)], crashed_before=True),
    Case("snapkv_compress B=0, budget >= N", lambda d: rk.snapkv_compress(
        rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d), rand(0, 2, 64, 16, device=d), 64),
         shapes=[(0, 2, 64, 16), (0, 2, 64, 16), (0, 2, 64)]),
    Case("h2o_scores B=0", lambda d: rk.h2o_scores(rand(0, 4, 32, 8, device=d), rand(0, 2, 32, 8, device=d)),
         shapes=[(0, 2, 32)]),
    Case("h2o_scores N=0", lambda d: rk.h2o_scores(rand(1, 4, 0, 8, device=d), rand(1, 2, 0, 8, device=d)),
         shapes=[(1, 2, 0)]),

    # Sizes that have no meaning raise, as the reference does.
    Case("snapkv_scores H_q=0", lambda d: rk.snapkv_scores(rand(1, 0, 8, 16, device=d), rand(1, 2, 64, 16, device=d)),
         error=(RuntimeError, "must be a positive multiple of the keys heads")),
    Case("h2o_scores H_q=0", lambda d: rk.h2o_scores(rand(1, 0, 32, 8, device=d), rand(1, 2, 32, 8, device=d)),
         error=(RuntimeError, "must be a positive multiple of the keys heads")),
    Case("snapkv_scores D=0", lambda d: rk.snapkv_scores(rand(1, 4, 8, 0, device=d), rand(1, 2, 64, 0, device=d)),
         error=(RuntimeError, "head dimension D (dim 3) must be >= 1, got 0")),
    Case("snapkv_compress D=0", lambda d: rk.snapkv_compress(rand(1, 4, 8, 0, device=d), rand(1, 2, 64, 0, device=d),
                                                             rand(1, 2, 64, 0, device=d), 20),
         error=(RuntimeError, "head dimension D (dim 3) must be >= 1, got 0")),
    Case("h2o_scores D=0", lambda d: rk.h2o_scores(rand(1, 4, 32, 0, device=d), rand(1, 2, 32, 0, device=d)),
         error=(RuntimeError, "head dimension D (dim 3) must be >= 1, got 0")),
    Case("snapkv_scores kernel_size=True", lambda d: rk.snapkv_scores(rand(1, 4, 8, 16, device=d),
                                                                       rand(1, 2, 64, 16, device=d), kernel_size=True),
         error=(TypeError, "kernel_size must be an integer, got bool")),
    Case("snapkv_compress kernel_size=True", lambda d: rk.snapkv_compress(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=d), 20, kernel_size=True),
         error=(TypeError, "kernel_size must be an integer, got bool")),

    # Budgets near 2**63 keep everything; a window that large cannot make N.
    Case("snapkv_compress budget 2**63-1", lambda d: rk.snapkv_compress(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=d), I64_MAX),
         shapes=[(1, 2, 64, 16), (1, 2, 64, 16), (1, 2, 64)]),

    # Every tensor on one device (meta included): no uninitialised memory, no silent no-op.
    Case("snapkv_scores q_window on another device", lambda d: rk.snapkv_scores(
        rand(1, 4, 8, 16, device=d).to(other_device(d)), rand(1, 2, 64, 16, device=d)),
         error=(RuntimeError, "every tensor must be on one device")),
    Case("snapkv_compress values on another device", lambda d: rk.snapkv_compress(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=other_device(d)), 20),
         error=(RuntimeError, "every tensor must be on one device")),
    Case("h2o_scores queries on another device", lambda d: rk.h2o_scores(
        rand(1, 4, 32, 8, device=other_device(d)), rand(1, 2, 32, 8, device=d)),
         error=(RuntimeError, "every tensor must be on one device")),

    # gather_kv_into validates everything before writing anything.

    # Per-row ops of left-padded batches: lengths and budgets int64 [B], one per row.
    Case("snapkv_compress_rows B=0", lambda d: rk.snapkv_compress_rows(
        rand(0, 4, 8, 16, device=d), rand(0, 2, 64, 16, device=d), rand(0, 2, 64, 16, device=d),
        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)),
         shapes=[(0, 2, 0, 16), (0, 2, 0, 16), (0, 2, 0)]),
    Case("snapkv_compress_rows budget below window", lambda d: rk.snapkv_compress_rows(
        rand(2, 4, 8, 16, device=d), rand(2, 2, 64, 16, device=d), rand(2, 2, 64, 16, device=d),
        torch.tensor([20, 5]), torch.tensor([64, 30])),
         error=(RuntimeError, "budgets[1] must be >= window (8) when row 1 is compressed")),
    Case("snapkv_scores lengths above N", lambda d: rk.snapkv_scores(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), lengths=torch.tensor([65])),
         error=(RuntimeError, "lengths[0] (real tokens of row 0) must be in [0, N] = [0, 64], got 65")),
    Case("h2o_scores lengths of another size", lambda d: rk.h2o_scores(
        rand(1, 4, 32, 8, device=d), rand(1, 2, 32, 8, device=d), lengths=torch.tensor([32, 32])),
         error=(RuntimeError, "lengths dim 0 (B) must be 1, got 2")),
    # A lone int where one value per row (or layer) is expected: say what the argument must be.
    Case("snapkv_scores lengths=5", lambda d: rk.snapkv_scores(rand(1, 4, 8, 16, device=d),
                                                               rand(1, 2, 64, 16, device=d), lengths=5),
         error=(TypeError, "snapkv_scores: lengths must be an int64 [B] tensor or a list of ints (one per batch row), "
                           "got int (5)")),
    Case("h2o_scores lengths=32", lambda d: rk.h2o_scores(rand(1, 4, 32, 8, device=d), rand(1, 2, 32, 8, device=d),
                                                          lengths=32),
         error=(TypeError, "h2o_scores: lengths must be an int64 [B] tensor or a list of ints")),
    Case("snapkv_compress_rows lengths=64", lambda d: rk.snapkv_compress_rows(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), rand(1, 2, 64, 16, device=d), [20], 64),
         error=(TypeError, "snapkv_compress_rows: lengths must be an int64 [B] tensor or a list of ints")),
    Case("snapkv_scores lengths as a tuple", lambda d: rk.snapkv_scores(
        rand(1, 4, 8, 16, device=d), rand(1, 2, 64, 16, device=d), lengths=(64,)), shapes=[(1, 2, 56)]),
    Case("snapkv_compress_rows NaN in a real key", lambda d: rk.snapkv_compress_rows(
        rand(2, 4, 8, 16, device=d), nan_at(rand(2, 2, 64, 16, device=d), 1, 0, 40, 0), rand(2, 2, 64, 16, device=d),
        torch.tensor([20, 20]), torch.tensor([64, 30])),
         error=(RuntimeError, "scores must not contain NaN, got NaN in batch row 1")),
    Case("snapkv_compress_rows NaN in a pad key", lambda d: rk.snapkv_compress_rows(
        rand(2, 4, 8, 16, device=d), nan_at(rand(2, 2, 64, 16, device=d), 1, 0, 10, 0), rand(2, 2, 64, 16, device=d),
        torch.tensor([20, 20]), torch.tensor([64, 30])),
         shapes=[(2, 2, 20, 16), (2, 2, 20, 16), (2, 2, 20)], check=lambda d, r: not bool(torch.isnan(r[0]).any())),

    # NaN policy: scoring ops propagate NaN into the scores; every selection raises, naming the row.
    Case("snapkv_scores NaN in a window key", lambda d: rk.snapkv_scores(
        rand(1, 4, 8, 16, device=d), nan_at(rand(1, 2, 64, 16, device=d), 0, 1, 60, 3)),
         shapes=[(1, 2, 56)], check=_scores_nan_like_reference),
    Case("snapkv_scores inf in q_window", lambda d: rk.snapkv_scores(
        rand(1, 4, 8, 16, device=d).index_fill(3, torch.tensor([0], device=d), float("inf")),
        rand(1, 2, 64, 16, device=d)), shapes=[(1, 2, 56)], check=_scores_nan_like_reference),
    Case("h2o_scores NaN in a key", lambda d: rk.h2o_scores(
        rand(1, 4, 32, 8, device=d), nan_at(rand(1, 2, 32, 8, device=d), 0, 0, 5, 0)),
         shapes=[(1, 2, 32)], check=_scores_nan_like_reference),
    Case("snapkv_compress NaN, budget == window", lambda d: rk.snapkv_compress(
        rand(1, 4, 8, 16, device=d), nan_at(rand(1, 2, 64, 16, device=d), 0, 1, 60, 3),
        rand(1, 2, 64, 16, device=d), 8), error=(RuntimeError, "scores must not contain NaN")),
    Case("snapkv_compress NaN, budget > window", lambda d: rk.snapkv_compress(
        nan_at(rand(1, 4, 8, 16, device=d), 0, 0, 0, 0), rand(1, 2, 64, 16, device=d),
        rand(1, 2, 64, 16, device=d), 20), error=(RuntimeError, "scores must not contain NaN")),
]

CASES_BY_NAME = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"


def run_case(case: Case, device: str) -> str:
    """Runs one case; raises AssertionError when the behaviour differs from the table. Returns the behaviour."""
    if case.error is not None:
        kind, fragment = case.error
        try:
            case.call(device)
        except kind as err:
            assert fragment in str(err), f"{case.name}: message {str(err)!r} lacks {fragment!r}"
            return f"{kind.__name__}: ...{fragment}..."
        raise AssertionError(f"{case.name}: expected {kind.__name__} ({fragment!r}), got a result")
    result = case.call(device)
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    assert [tuple(o.shape) for o in outputs] == [tuple(s) for s in case.shapes], \
        f"{case.name}: shapes {[tuple(o.shape) for o in outputs]}, expected {case.shapes}"
    assert all(o.device.type == device for o in outputs), f"{case.name}: an output left the device"
    if case.check is not None:
        ok = case.check(device, result)
        assert ok is None or ok, f"{case.name}: result check failed"
    return "returns " + ", ".join(str(tuple(s)) for s in case.shapes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_bad_input_table(name, device):
    case = CASES_BY_NAME[name]
    if case.crashed_before:
        # In its own process: this once died with SIGFPE, which must show as a failure, not end the run.
        code = f"import test_ops_bad_inputs as t; t.run_case(t.CASES_BY_NAME[{name!r}], {device!r})"
        proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{name} on {device}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    else:
        run_case(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["snapkv NaN key", "snapkv inf query", "h2o NaN key"])
def test_nan_scores_match_reference(case, device):
    # The policy is the reference's: NaN/inf inputs give NaN scores at the same positions on every backend.
    q, k = rand(1, 4, 8, 16, device=device), rand(1, 2, 64, 16, device=device)
    if case == "snapkv NaN key":
        args, ext, ref = (q, nan_at(k, 0, 1, 60, 3)), rk.snapkv_scores, ripplekv_ref.snapkv_scores
    elif case == "snapkv inf query":
        args, ext, ref = (nan_at(q, 0, 0, 2, 1).nan_to_num(posinf=float("inf"), nan=float("inf")), k), \
            rk.snapkv_scores, ripplekv_ref.snapkv_scores
    else:
        args, ext, ref = (rand(1, 4, 32, 8, device=device), nan_at(rand(1, 2, 32, 8, device=device), 0, 0, 5, 0)), \
            rk.h2o_scores, ripplekv_ref.h2o_scores
    got, want = ext(*args), ref(*args)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [c.name for c in CASES if c.error and c.error[0] is RuntimeError])
def test_reference_agrees_on_errors(name):
    # The reference must refuse what the ops refuse (errors of its own type), except device and overlap checks,
    # which it has no reason to make.
    case = CASES_BY_NAME[name]
    if any(word in name for word in ("device", "alias", "overlap", "stride-0", "out-of-range", "negative",
                                     "offsets", "window 2**63")):
        pytest.skip("an extension-only check")
    import ripplekv_ext.ops as ops
    saved = {n: getattr(rk, n) for n in ops.__all__}
    try:
        for n in ops.__all__:
            setattr(rk, n, getattr(ripplekv_ref, n))
        with pytest.raises((ValueError, RuntimeError, ZeroDivisionError)):
            case.call("cpu")
    finally:
        for n, f in saved.items():
            setattr(rk, n, f)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    counts = {}
    for c in CASES:
        try:
            behaviour = run_case(c, dev)
        except AssertionError as err:
            behaviour = f"MISMATCH: {err}"
        kind = behaviour.split(":")[0].split(" ")[0]
        counts[kind] = counts.get(kind, 0) + 1
        print(f"| {c.name} | {behaviour} |")
    print(counts)
