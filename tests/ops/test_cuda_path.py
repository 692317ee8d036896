"""Which path a CUDA call runs (ripplekv_ext/ops/cuda_path.py): the rule per op and length, the forcing variable, and
that each op wrapper runs what the rule picks. No GPU here: `is_cuda_call` is the one place the device is asked, so
the tests make CPU calls count as CUDA calls and check which implementation ran and that both give the same result
(the torch composite, tests/ops/test_composite.py holding it to the reference; the other side is the CPU kernel, the
CUDA kernels' twin in every op test)."""

import json
from pathlib import Path

import pytest
import torch

import ripplekv_ref
from ripplekv_ext import ops
from ripplekv_ext.ops import composite, cuda_path
from ripplekv_ref.comparison import assert_same_selection

H200_TABLE = Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu_kernels_h200.json"


@pytest.fixture
def as_cuda(monkeypatch):
    """CPU calls count as CUDA calls; returns the names of the torch composites that ran."""
    monkeypatch.setattr(cuda_path, "is_cuda_call", lambda tensor: isinstance(tensor, torch.Tensor))
    ran = []
    for name in cuda_path.FUSED_UP_TO:
        original = getattr(composite, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(composite, name, spy)
    return ran


def test_auto_follows_the_table_and_the_variable_forces_either(monkeypatch):
    monkeypatch.delenv(cuda_path.ENV, raising=False)
    assert cuda_path.cuda_path("snapkv_compress", 2048) == "fused"
    assert cuda_path.cuda_path("snapkv_compress", 2049) == "torch"
    assert cuda_path.cuda_path("snapkv_scores", 16) == "torch"
    assert cuda_path.cuda_path("select_topk", 8192) == "fused"
    assert cuda_path.cuda_path("select_topk", 8193) == "torch"
    assert cuda_path.cuda_path("h2o_scores", 16) == "torch"
    assert cuda_path.cuda_path("gather_kv", 1 << 20) == "fused"
    for forced in ("fused", "torch"):
        monkeypatch.setenv(cuda_path.ENV, forced)
        assert {cuda_path.cuda_path(op, n) for op in cuda_path.FUSED_UP_TO for n in (16, 1 << 20)} == {forced}
    monkeypatch.setenv(cuda_path.ENV, " Auto ")
    assert cuda_path.cuda_path("snapkv_compress", 2049) == "torch"


def test_the_table_is_the_committed_h200_measurement():
    rows = json.loads(H200_TABLE.read_text())["rows"]
    assert {row["op"] for row in rows} == set(cuda_path.FUSED_UP_TO)
    assert cuda_path.crossovers(rows) == cuda_path.FUSED_UP_TO


def test_crossovers_keep_the_lengths_up_to_the_first_loss_in_any_dtype():
    def row(op, n, speedup):
        return {"op": op, "n": n, "speedup": speedup}

    rows = [row("a", 2048, 1.5), row("a", 2048, 1.0), row("a", 4096, 2.0), row("a", 4096, 0.99),
            row("a", 8192, 1.2), row("b", 2048, 0.5), row("c", 2048, 3.0), row("c", 4096, 1.0)]
    assert cuda_path.crossovers(rows) == {"a": 2048, "b": 0, "c": None}


def test_bad_settings_are_refused_by_name(monkeypatch):
    monkeypatch.setenv(cuda_path.ENV, "cuda")
    with pytest.raises(ValueError, match=r"RIPPLEKV_CUDA_PATH='cuda': expected one of fused, torch, auto"):
        cuda_path.cuda_path("gather_kv", 16)
    monkeypatch.delenv(cuda_path.ENV)
    with pytest.raises(KeyError, match="no CUDA path rule for op 'select_topk_rows'"):
        cuda_path.cuda_path("select_topk_rows", 16)


def test_cpu_calls_never_consult_the_rule(monkeypatch):
    monkeypatch.setenv(cuda_path.ENV, "not-a-path")  # would raise if read
    scores = torch.rand(1, 2, 64)
    assert torch.equal(ops.select_topk(scores, 16, 4), ripplekv_ref.select_topk(scores, 16, 4))


def _snapkv_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 8, 32, generator=g)
    k = torch.randn(1, 2, n, 32, generator=g)
    v = torch.randn(1, 2, n, 32, generator=g)
    return q, k, v


# op, arguments at a length N, and the N below / above its crossover under auto.
CALLS = {
    "snapkv_compress": lambda n: (_snapkv_inputs(n), dict(budget=n // 4)),
    "select_topk": lambda n: ((torch.rand(1, 2, n - 8, generator=torch.Generator().manual_seed(1)),),
                              dict(budget=n // 4, window=8)),
}


@pytest.mark.parametrize("op, below, above", [("snapkv_compress", 2048, 2056), ("select_topk", 8192, 8200)])
def test_auto_runs_the_kernel_below_the_crossover_and_torch_above(op, below, above, as_cuda, monkeypatch):
    monkeypatch.setenv(cuda_path.ENV, "auto")
    for n, expected in ((below, []), (above, [op])):
        as_cuda.clear()
        args, kwargs = CALLS[op](n)
        getattr(ops, op)(*args, **kwargs)
        assert as_cuda == expected, (op, n)


def test_every_routed_op_runs_the_composite_when_forced(as_cuda, monkeypatch):
    monkeypatch.setenv(cuda_path.ENV, "torch")
    q, k, v = _snapkv_inputs(64)
    idx = ops.snapkv_compress(q, k, v, 24)[2]
    ops.snapkv_scores(q, k)
    ops.select_topk(torch.rand(1, 2, 56), 24, 8)
    ops.h2o_scores(torch.randn(1, 4, 64, 32), k)
    ops.gather_kv(k, v, idx)
    assert as_cuda == ["snapkv_compress", "snapkv_scores", "select_topk", "h2o_scores", "gather_kv"]
    as_cuda.clear()
    out = (k.new_empty(1, 2, 24, 32), v.new_empty(1, 2, 24, 32))
    ops.gather_kv(k, v, idx, out=out)  # the in-place form has no composite
    assert as_cuda == []
    monkeypatch.setenv(cuda_path.ENV, "fused")
    ops.snapkv_compress(q, k, v, 24)
    ops.h2o_scores(torch.randn(1, 4, 64, 32), k)
    assert as_cuda == []


def _both_paths(monkeypatch, call):
    results = {}
    for path in ("fused", "torch"):
        monkeypatch.setenv(cuda_path.ENV, path)
        results[path] = call()
    return results["fused"], results["torch"]


def test_both_paths_select_the_same_tokens_ties_included(as_cuda, monkeypatch):
    # Scores of four values over 20,000 positions: nearly every kept token is decided by the tie rule.
    scores = torch.randint(0, 4, (2, 3, 20000), generator=torch.Generator().manual_seed(2)).float()
    fused, composite = _both_paths(monkeypatch, lambda: ops.select_topk(scores, 5000, 32))
    assert as_cuda == ["select_topk"]
    assert torch.equal(fused, composite)
    q, k, v = _snapkv_inputs(6000, seed=3)
    (k_f, v_f, idx_f), (k_t, v_t, idx_t) = _both_paths(monkeypatch, lambda: ops.snapkv_compress(q, k, v, 1500))
    assert_same_selection(idx_f, idx_t, ripplekv_ref.snapkv_scores(q, k), window=8)
    assert torch.equal(k_f, torch.gather(k, 2, idx_f[..., None].expand(-1, -1, -1, 32)))
    assert torch.equal(k_t, torch.gather(k, 2, idx_t[..., None].expand(-1, -1, -1, 32)))
    s_f, s_t = _both_paths(monkeypatch, lambda: ops.snapkv_scores(q, k))
    torch.testing.assert_close(s_f, s_t, rtol=1e-5, atol=1e-6)
    queries = torch.randn(1, 4, 512, 32, generator=torch.Generator().manual_seed(4))
    h_f, h_t = _both_paths(monkeypatch, lambda: ops.h2o_scores(queries, k[:, :, :512]))
    torch.testing.assert_close(h_f, h_t, rtol=1e-5, atol=1e-5)


def test_both_paths_refuse_nan_scores(as_cuda, monkeypatch):
    scores = torch.rand(1, 2, 20000)
    scores[0, 1, 777] = float("nan")
    for path in ("fused", "torch"):
        monkeypatch.setenv(cuda_path.ENV, path)
        with pytest.raises((ValueError, RuntimeError), match="NaN"):
            ops.select_topk(scores, 5000, 32)
    assert as_cuda == ["select_topk"]


def test_a_tensor_of_too_few_dimensions_stays_on_the_kernel(as_cuda, monkeypatch):
    monkeypatch.setenv(cuda_path.ENV, "torch")
    with pytest.raises(RuntimeError, match=r"snapkv_scores: keys must be a 4-D tensor .* got 3-D"):
        ops.snapkv_scores(torch.randn(1, 4, 8, 32), torch.randn(2, 64, 32))
    assert as_cuda == []
