"""The selectors RippleKV can run inside a layer, whole (window scoring + selection), side by side in one run:
SnapKV's, PeakSpan's (one scoring pooled two ways, a recent region, peaks then spans) and PeakSpan's weighted by
the values' norms (the default).

    .venv/bin/python -m pytest bench/bench_selectors.py --benchmark-group-by=param:shape
"""

import pytest
import torch

import ripplekv_ref
from ripplekv_ext import PeakSpanSelector
from ripplekv_ext.methods import SELECTORS as METHOD_SELECTORS
from ripplekv_ref.selectors import peak_span_select
from conftest import MODEL_SHAPES, synchronize

W = 32
CASES = [("llama3.1-8b", 16384), ("smollm2-135m", 2048)]
# The package's selectors by their method names, and the previous default (PeakSpan without the values' weights).
SELECTORS = {"snapkv": METHOD_SELECTORS["snapkv"](), "peak-span": METHOD_SELECTORS["peak-span"](),
             "peak-span-unweighted": PeakSpanSelector(value_weighted=False)}
REFERENCES = {
    "snapkv": lambda q, k, v, budget: ripplekv_ref.snapkv_compress(q, k, v, budget)[2],
    "peak-span": lambda q, k, v, budget: peak_span_select(q, k, budget, W, 0.5, values=v),
    "peak-span-unweighted": lambda q, k, v, budget: peak_span_select(q, k, budget, W, 0.5),
}


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("shape", [f"{m}-N{n}" for m, n in CASES])
def bench_selector(benchmark, selector, shape, device):
    model, n = shape.rsplit("-N", 1)
    n, s = int(n), MODEL_SHAPES[model]
    g = torch.Generator().manual_seed(0)
    queries = torch.randn(s["B"], s["H_q"], W, s["D"], generator=g).to(device, torch.float16)
    keys = torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, torch.float16)
    values = torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, torch.float16)
    budget = n // 5
    chosen = SELECTORS[selector]
    extra = {"values": values} if chosen.needs_values else {}
    kept = chosen.select(queries, keys, budget, W, **extra)
    # The timed selection is the reference's (python/ripplekv_ref), position for position.
    assert torch.equal(kept.cpu(), REFERENCES[selector](queries.cpu(), keys.cpu(), values.cpu(), budget))

    def run():
        chosen.select(queries, keys, budget, W, **extra)
        synchronize(device)

    benchmark(run)
