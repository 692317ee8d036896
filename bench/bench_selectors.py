"""The selectors RippleKV can run inside a layer, whole (window scoring + selection), side by side in one run:
SnapKV's, AdaptiveRecent's (one scoring, a recent region), PeakSpan's (one scoring pooled two ways, a recent
region, peaks then spans) and PeakSpan's weighted by the values' norms (the default).

    .venv/bin/python -m pytest bench/bench_selectors.py --benchmark-group-by=param:shape
"""

import pytest
import torch

from ripplekv_ext import AdaptiveRecentSelector, PeakSpanSelector, SnapKVSelector
from conftest import MODEL_SHAPES, synchronize

W = 32
CASES = [("llama3.1-8b", 16384), ("smollm2-135m", 2048)]
SELECTORS = {"snapkv": SnapKVSelector(), "adaptive-recent": AdaptiveRecentSelector(),
             "peak-span": PeakSpanSelector(value_weighted=False), "peak-span-value-weighted": PeakSpanSelector()}


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
    assert kept.shape == (s["B"], s["H_kv"], budget)
    if selector == "peak-span":  # every slot a peak is AdaptiveRecent, position for position
        assert torch.equal(PeakSpanSelector(1.0, value_weighted=False).select(queries, keys, budget, W),
                           AdaptiveRecentSelector().select(queries, keys, budget, W))

    def run():
        chosen.select(queries, keys, budget, W, **extra)
        synchronize(device)

    benchmark(run)
