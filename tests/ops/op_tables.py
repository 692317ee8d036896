"""What each op's bad-input table is made of, shared by every op's test file (``tests/ops/test_<op>.py``).

A row (``Case``) is a call and what it must do: raise an exception whose message holds a fragment, or return outputs
of given shapes on the device of its inputs. Every op's file lists its rows as ``BAD_INPUTS`` and runs each on CPU
and, where a GPU exists, on CUDA tensors. Rows that could kill the process (SIGFPE in the CPU SnapKV driver on an
empty batch) run in a subprocess, so a crash shows as a failed test instead of ending the run.

``python tests/ops/op_tables.py [cpu|cuda]`` prints every op's table with the behaviour of each row.
"""

import contextlib
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

import ripplekv_ext
import ripplekv_ref

HERE = Path(__file__).resolve().parent

I64_MAX = 2 ** 63 - 1

# The file of each op's tests: it defines ``SAMPLES`` (op name -> ``samples(device)``) and ``BAD_INPUTS``.
OP_TEST_MODULES = ("test_gather_kv", "test_gather_kv_packed", "test_select_topk", "test_select_topk_packed",
                   "test_select_topk_rows", "test_snapkv_scores", "test_snapkv_compress", "test_snapkv_compress_rows",
                   "test_h2o_scores")


@dataclass
class Case:
    name: str
    call: Callable[[str], object]            # device -> the op's result
    error: Optional[Tuple[type, str]] = None  # (exception type, message fragment), or None: the call returns
    shapes: Optional[list] = None            # expected output shapes when it returns
    check: Optional[Callable] = None         # extra check of the result (device, result)
    crashed_before: bool = False             # could kill the process: run in a subprocess
    reference: Optional[str] = None          # the fragment of the reference's message, where it words it otherwise


def by_name(cases):
    """``{name: case}``; names must be unique (they are the test ids)."""
    named = {c.name: c for c in cases}
    assert len(named) == len(cases), "case names must be unique"
    return named


def other_device(device):
    # A device the call's other tensors are not on: meta everywhere (the fake kernel's dispatch path), CPU next to CUDA.
    return "cpu" if device == "cuda" else "meta"


def scores_nan_like_reference(device, result):
    assert torch.isnan(result).any(), "NaN inputs must give NaN scores"


def assert_same_nan_scores(got, want):
    """The reference's policy: NaN/inf inputs give NaN scores at the same positions, the others agree."""
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-5)


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


def check_row(module: str, cases: dict, name: str, device: str):
    """Runs row ``name`` of ``cases`` (the table of test module ``module``) on ``device``."""
    case = cases[name]
    if case.crashed_before:
        # In its own process: a SIGFPE must show as a failure, not end the run.
        code = (f"import {module} as t, op_tables; "
                f"op_tables.run_case(op_tables.by_name(t.BAD_INPUTS)[{name!r}], {device!r})")
        # The test module imports the helpers beside it and the ones all test folders share (tests/devices.py).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent),
                                                                         os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{name} on {device}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    else:
        run_case(case, device)


def refused_by_the_reference(cases):
    """The names of the rows whose op raises RuntimeError: the reference must refuse them too."""
    return [c.name for c in cases if c.error and c.error[0] is RuntimeError]


# Checks the reference has no reason to make: devices, memory overlap, index ranges the gather trusts.
EXTENSION_ONLY = ("device", "alias", "overlap", "stride-0", "out-of-range", "negative", "offsets", "window 2**63")


def extension_only(name: str) -> bool:
    return any(word in name for word in EXTENSION_ONLY)


@contextlib.contextmanager
def reference_ops():
    """Inside the block, ``ripplekv_ext.<op>`` is the reference's op of that name (what the rows call)."""
    import ripplekv_ext.ops as ops

    saved = {n: getattr(ripplekv_ext, n) for n in ops.__all__}
    try:
        for n in ops.__all__:
            setattr(ripplekv_ext, n, getattr(ripplekv_ref, n))
        yield
    finally:
        for n, f in saved.items():
            setattr(ripplekv_ext, n, f)


def opcheck_sample(samples, position: int, op: str, device):
    """torch.library.opcheck of ``op`` on sample ``position`` of ``samples(device)``: every check on the first
    sample, the cheaper ones on the rest (aot_dispatch_dynamic compiles each call)."""
    _, args = samples(device)[position]
    test_utils = None if position == 0 else ("test_schema", "test_autograd_registration", "test_faketensor")
    kwargs = {} if test_utils is None else {"test_utils": test_utils}
    torch.library.opcheck(getattr(torch.ops.ripplekv, op).default, args, **kwargs)


def sample_ids(samples_by_op):
    """(op, position) pairs with ids ``op-sample``, over every op's samples (built on the CPU)."""
    import pytest

    return [pytest.param(op, position, id=f"{op}-{name}")
            for op, samples in samples_by_op.items() for position, (name, _) in enumerate(samples("cpu"))]


def op_tests(module: str, samples: dict, bad_inputs: list):
    """The three tests every op file holds, built over its ``samples`` (op -> samples function) and its bad-input
    table: opcheck on each sample, each table row on CPU and CUDA, and the reference refusing what the op refuses
    with the same message (or the row's ``reference`` fragment).
    An op file assigns them to its own module-level ``test_...`` names, where pytest collects them."""
    import pytest

    from devices import DEVICES

    cases = by_name(bad_inputs)

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("op, position", sample_ids(samples))
    def test_opcheck_samples(op, position, device):
        opcheck_sample(samples[op], position, op, device)

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("name", list(cases))
    def test_bad_input_table(name, device):
        check_row(module, cases, name, device)

    shared = [n for n in refused_by_the_reference(bad_inputs) if not extension_only(n)]

    @pytest.mark.parametrize("name", shared)
    def test_reference_agrees_on_errors(name):
        # The reference must refuse what the op refuses, for the same reason (errors of its own type), except the
        # checks it has no reason to make (left out above).
        case = cases[name]
        with reference_ops(), pytest.raises((ValueError, RuntimeError)) as refused:
            case.call("cpu")
        fragment = case.reference or case.error[1]
        assert fragment in str(refused.value), f"the reference's message {str(refused.value)!r} lacks {fragment!r}"

    # An op whose every refusal is extension-only has no such test (None: pytest collects nothing by that name).
    return test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors if shared else None


def op_test_modules():
    sys.path.insert(0, str(HERE))
    return [importlib.import_module(name) for name in OP_TEST_MODULES]


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    counts = {}
    for module in op_test_modules():
        for c in module.BAD_INPUTS:
            try:
                behaviour = run_case(c, dev)
            except AssertionError as err:
                behaviour = f"MISMATCH: {err}"
            kind = behaviour.split(":")[0].split(" ")[0]
            counts[kind] = counts.get(kind, 0) + 1
            print(f"| {c.name} | {behaviour} |")
    print(counts)
