"""The torch composites a CUDA call runs above its op's crossover (ripplekv_ext/ops/composite/): each equal to the
reference implementation (python/ripplekv_ref) on every sample of its op, and each row of its op's bad-input table
behaving as the table says with the composite path forced. No GPU here: CPU calls count as CUDA calls (as in
test_cuda_path.py), which is what routes them to the composites."""

import pytest
import torch

import ripplekv_ref
from op_tables import by_name, op_test_modules, run_case, sample_ids
from ripplekv_ext.ops import composite, cuda_path

MODULES = {module.__name__: module for module in op_test_modules()}
SAMPLES = {op: samples for module in MODULES.values() for op, samples in module.SAMPLES.items()
           if op in composite.__all__}
ROWS = [pytest.param(module, name, id=f"{module[len('test_'):]}-{name}") for module in
        ("test_snapkv_scores", "test_snapkv_compress", "test_select_topk", "test_h2o_scores", "test_gather_kv")
        for name in by_name(MODULES[module].BAD_INPUTS)]


@pytest.fixture
def composite_path(monkeypatch):
    monkeypatch.setattr(cuda_path, "is_cuda_call", lambda tensor: isinstance(tensor, torch.Tensor))
    monkeypatch.setenv(cuda_path.ENV, "torch")


def test_every_routed_op_has_its_composite():
    assert set(composite.__all__) == set(cuda_path.FUSED_UP_TO)


@pytest.mark.parametrize("op, position", sample_ids(SAMPLES))
def test_composite_equals_the_reference(op, position):
    _, args = SAMPLES[op]("cpu")[position]
    got, want = getattr(composite, op)(*args), getattr(ripplekv_ref, op)(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(torch.isnan(g), torch.isnan(w))
        assert torch.equal(g.nan_to_num(0.0), w.nan_to_num(0.0))  # the same torch calls: bit for bit


@pytest.mark.parametrize("module, name", ROWS)
def test_bad_input_table_on_the_composite_path(module, name, composite_path):
    case = by_name(MODULES[module].BAD_INPUTS)[name]
    if case.crashed_before:
        pytest.skip("a row that once crashed the CPU kernel runs in its own process in the op's own file")
    run_case(case, "cpu")
