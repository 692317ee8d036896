"""h2o_scores against the reference (chunked torch ops), in the same run.

    .venv/bin/python -m pytest bench/bench_h2o.py --benchmark-group-by=param:shape
"""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from conftest import MODEL_SHAPES, synchronize

CASES = [("smollm2-135m", 1024), ("llama3.1-8b", 1024)]
IMPLS = {"reference": ripplekv_ref.h2o_scores, "extension": ripplekv_ext.h2o_scores}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", [f"{m}-N{n}" for m, n in CASES])
def bench_h2o_scores(benchmark, impl, shape, device):
    model, n = shape.rsplit("-N", 1)
    n = int(n)
    s = MODEL_SHAPES[model]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s["B"], s["H_q"], n, s["D"], generator=g).to(device, torch.float16)
    k = torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, torch.float16)
    fn = IMPLS[impl]
    if impl != "reference":  # the timed scores are the reference's
        torch.testing.assert_close(fn(q, k, 256), ripplekv_ref.h2o_scores(q, k, 256), rtol=1e-4, atol=1e-4)

    def run():
        fn(q, k, 256)
        synchronize(device)

    benchmark.pedantic(run, rounds=3, warmup_rounds=0)
