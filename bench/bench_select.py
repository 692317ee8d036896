"""select_topk and the packed multi-layer select + gather against the reference, in the same run.

    .venv/bin/python -m pytest bench/bench_select.py --benchmark-group-by=param:shape
"""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from conftest import MODEL_SHAPES, synchronize

W = 32
CASES = [("llama3.1-8b", 16384), ("smollm2-135m", 2048)]
IMPLS = {"reference": ripplekv_ref, "extension": ripplekv_ext}


def make_scores(model, n, device, layers=None):
    s = MODEL_SHAPES[model]
    g = torch.Generator().manual_seed(0)
    shape = (s["B"], s["H_kv"], n - W) if layers is None else (layers, s["B"], s["H_kv"], n - W)
    # Max-pooled scores have many exact ties: quantize to reproduce that.
    return (torch.rand(shape, generator=g) * 256).floor().to(device)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", [f"{m}-N{n}" for m, n in CASES])
def bench_select_topk(benchmark, impl, shape, device):
    model, n = shape.rsplit("-N", 1)
    scores = make_scores(model, int(n), device)
    budget = int(n) // 5
    mod = IMPLS[impl]
    if impl != "reference":  # the timed selection is the reference's, ties included
        assert torch.equal(mod.select_topk(scores, budget, W), ripplekv_ref.select_topk(scores, budget, W))

    def run():
        mod.select_topk(scores, budget, W)
        synchronize(device)

    benchmark(run)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", ["smollm2-135m-N2048-L30"])
def bench_packed_select_gather(benchmark, impl, shape, device):
    """Every layer of SmolLM2 (30 layers, unequal budgets) compressed after prefill: select + gather."""
    n, layers = 2048, 30
    s = MODEL_SHAPES["smollm2-135m"]
    scores = make_scores("smollm2-135m", n, device, layers)
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, torch.float16) for _ in range(layers)]
    values = [torch.randn_like(k) for k in keys]
    budgets = [int(b) for b in torch.linspace(200, 600, layers).round().tolist()]
    mod = IMPLS[impl]

    def run():
        flat, offsets = mod.select_topk_packed(scores, budgets, W)
        out = mod.gather_kv_packed(keys, values, flat, offsets)
        synchronize(device)
        return out

    if impl != "reference":  # the timed selection and gather are the reference's: indices, offsets, keys and values
        flat, offsets = mod.select_topk_packed(scores, budgets, W)
        flat_ref, offsets_ref = ripplekv_ref.select_topk_packed(scores, budgets, W)
        assert torch.equal(flat, flat_ref) and torch.equal(offsets, offsets_ref)
        k_flat, v_flat = run()
        k_ref, v_ref = ripplekv_ref.gather_kv_packed(keys, values, flat_ref, offsets_ref)
        assert torch.equal(k_flat, k_ref) and torch.equal(v_flat, v_ref)
    benchmark(run)
