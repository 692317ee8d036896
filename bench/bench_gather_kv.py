"""gather_kv: the extension against the reference (torch.gather), in the same run.

    make bench                                  # everything, grouped by shape
    .venv/bin/python -m pytest bench/bench_gather_kv.py --benchmark-group-by=param:shape

On a GPU, the report's `bytes` extra-info divided by the mean time is the achieved bandwidth
(each gathered element is read once and written once, for K and for V).
"""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from conftest import MODEL_SHAPES, synchronize

# (model, N, retention): C = retention * N tokens kept per head.
CASES = [("llama3.1-8b", 4096, 0.2), ("llama3.1-8b", 16384, 0.2), ("smollm2-135m", 2048, 0.2)]
IMPLS = {"reference": ripplekv_ref.gather_kv, "extension": ripplekv_ext.gather_kv}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", [f"{m}-N{n}" for m, n, _ in CASES])
def bench_gather_kv(benchmark, impl, shape, device):
    model, n, retention = next(c for c in CASES if f"{c[0]}-N{c[1]}" == shape)
    s = MODEL_SHAPES[model]
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, torch.float16)
    values = torch.randn_like(keys)
    c = int(retention * n)
    indices = torch.rand(s["B"], s["H_kv"], n, generator=g).argsort(-1)[..., :c].sort(-1).values.to(device)

    fn = IMPLS[impl]
    result = fn(keys, values, indices)
    expected = ripplekv_ref.gather_kv(keys, values, indices)
    assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])

    def run():
        fn(keys, values, indices)
        synchronize(device)

    benchmark.extra_info["bytes"] = 2 * 2 * keys.element_size() * s["B"] * s["H_kv"] * c * s["D"]
    benchmark(run)
