"""Sensitivity profiler: full forward passes (naive) against replaying the layers below the perturbed one
(reuse), in the same run, on the same examples; both must give the same profile.

    .venv/bin/python -m pytest bench/bench_profiler.py --benchmark-group-by=param:case
    RIPPLEKV_BENCH_SMOLLM2=1 ...   # also SmolLM2-135M at P=1024, T=64 (one example; slow on a laptop CPU)

Read the ratio of the two means: the expected speedup is ~2x for many layers (the perturbed layer is on
average halfway down), less where the LM head dominates (large vocabularies, short models).
"""

import os

import numpy as np
import pytest
import torch

from ripplekv_ext.eval.models import load_smollm2
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.profiler import profile_model

CASES = {"tiny-llama-L12-P128-T16": dict(num_layers=12, prefix_len=128, cont_len=16)}
if os.environ.get("RIPPLEKV_BENCH_SMOLLM2"):
    CASES["smollm2-P1024-T64"] = dict(num_layers=None, prefix_len=1024, cont_len=64)

_models = {}


def _setup(case):
    spec = CASES[case]
    if case not in _models:
        if spec["num_layers"] is None:
            model, _ = load_smollm2()
        else:
            model = tiny_model("llama", seed=0, num_layers=spec["num_layers"], hidden_size=256, intermediate_size=512,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=32)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, spec["prefix_len"] + spec["cont_len"]),
                            generator=torch.Generator().manual_seed(0))
        _models[case] = (model, ids)
    return _models[case], spec


@pytest.mark.parametrize("impl", ["naive", "reuse"])
@pytest.mark.parametrize("shape", list(CASES))  # named shape so `make bench` can group by it
def bench_profiler(benchmark, shape, impl):
    case = shape
    (model, ids), spec = _setup(case)

    def run(reuse=(impl == "reuse")):
        return profile_model(model, examples=ids, prefix_len=spec["prefix_len"], cont_len=spec["cont_len"],
                             num_examples=1, reuse=reuse, progress=False)

    profile = benchmark.pedantic(run, rounds=1, iterations=1)
    # The other implementation on the same examples, untimed: both must give the same profile.
    other = run(reuse=impl != "reuse")
    np.testing.assert_allclose(profile.per_example, other.per_example, rtol=1e-5, atol=1e-12)
    assert profile.cost["tokens_processed"] != other.cost["tokens_processed"]  # the two really differ in work
    benchmark.extra_info["tokens_processed"] = profile.cost["tokens_processed"]
