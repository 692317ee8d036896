"""snapkv_compress (fused) and snapkv_scores against the reference pipeline of torch ops, in the same run.

    .venv/bin/python -m pytest bench/bench_snapkv.py --benchmark-group-by=param:shape \
        --benchmark-columns=min,median,rounds

Memory: `bench_snapkv_compress_memory` runs each implementation once in a fresh Python process and reports its
peak extra memory, i.e. the peak resident set size during the call minus the resident size just before it (inputs
already allocated and touched; the kernel's high-water mark reset just before the call, /proc/self/clear_refs). RSS
sees every allocation (torch's allocator, the kernels' std::vector scratch, oneDNN buffers), which tracemalloc or the
torch profiler would each miss part of. Outputs are included for both
implementations (they have the same size). On CUDA it is torch.cuda.max_memory_allocated() minus the allocated
bytes before the call (every kernel scratch buffer goes through the caching allocator).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from ripplekv_ref.comparison import SCORE_TOL, assert_same_selection
from conftest import MODEL_SHAPES, synchronize

W = 32
RETENTION = 0.2
CASES = [("llama3.1-8b", 4096), ("llama3.1-8b", 16384), ("smollm2-135m", 2048)]
GPU_CASES = [("llama3.1-8b", 32768)]
IMPLS = {"reference": ripplekv_ref.snapkv_compress, "extension": ripplekv_ext.snapkv_compress}
SCORE_IMPLS = {"reference": ripplekv_ref.snapkv_scores, "extension": ripplekv_ext.snapkv_scores}


def make_inputs(model, n, device, dtype=torch.float16):
    s = MODEL_SHAPES[model]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s["B"], s["H_q"], W, s["D"], generator=g).to(device, dtype)
    k = torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, dtype)
    v = torch.randn(s["B"], s["H_kv"], n, s["D"], generator=g).to(device, dtype)
    return q, k, v


def shape_ids(device_cases):
    return [f"{m}-N{n}" for m, n in device_cases]


def cases_for(device):
    return CASES + (GPU_CASES if torch.device(device).type == "cuda" else [])


def parse(shape):
    model, n = shape.rsplit("-N", 1)
    return model, int(n)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", shape_ids(CASES + GPU_CASES))
def bench_snapkv_compress(benchmark, impl, shape, device):
    model, n = parse(shape)
    if (model, n) not in cases_for(device):
        pytest.skip("N = 32768 is a GPU-only shape (the CPU reference needs minutes)")
    q, k, v = make_inputs(model, n, device)
    budget = int(RETENTION * n)
    fn = IMPLS[impl]
    k_c, v_c, idx = fn(q, k, v, budget)
    if impl != "reference":  # the timed selection is the reference's (up to near ties), and so are its K/V
        _, _, idx_ref = ripplekv_ref.snapkv_compress(q, k, v, budget)
        assert_same_selection(idx, idx_ref, ripplekv_ref.snapkv_scores(q, k), W)
        k_ref, v_ref = ripplekv_ref.gather_kv(k, v, idx)
        assert torch.equal(k_c, k_ref) and torch.equal(v_c, v_ref)

    def run():
        fn(q, k, v, budget)
        synchronize(device)

    benchmark.pedantic(run, rounds=3 if n >= 16384 else 5, warmup_rounds=0)


@pytest.mark.parametrize("impl", list(SCORE_IMPLS))
@pytest.mark.parametrize("shape", shape_ids([("llama3.1-8b", 4096), ("smollm2-135m", 2048)]))
def bench_snapkv_scores(benchmark, impl, shape, device):
    q, k, _ = make_inputs(*parse(shape), device)
    fn = SCORE_IMPLS[impl]
    if impl != "reference":
        torch.testing.assert_close(fn(q, k), ripplekv_ref.snapkv_scores(q, k), **SCORE_TOL)

    def run():
        fn(q, k)
        synchronize(device)

    benchmark.pedantic(run, rounds=5, warmup_rounds=1)


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import ripplekv_ext, ripplekv_ref
    sys.path.insert(0, "bench")
    from bench_snapkv import make_inputs
    impl, model, n, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    fn = {"reference": ripplekv_ref.snapkv_compress, "extension": ripplekv_ext.snapkv_compress}[impl]
    q, k, v = make_inputs(model, n, device)
    budget = int(0.2 * n)
    small = make_inputs(model, 256, device)
    fn(*small, 64)  # load libraries, spin up threads, outside the measurement
    if device == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(q, k, v, budget); torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    else:
        # ru_maxrss never comes down (it holds the imports' and the inputs' peak): reset the kernel's high-water mark
        # of this process (VmHWM) to its current RSS, then read both.
        def status(field):
            line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
            return int(line.split()[1]) * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        fn(q, k, v, budget)
        extra = status("VmHWM") - before
    print(json.dumps({"extra_bytes": extra}))
""")


def peak_extra_bytes(impl, model, n, device):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, impl, model, str(n), str(torch.device(device).type)],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]


@pytest.mark.parametrize("shape", shape_ids([("llama3.1-8b", 16384)]))
def bench_snapkv_compress_memory(benchmark, shape, device):
    """Peak extra memory of one call, extension vs reference: at most a quarter, checked also when benchmarks are
    disabled (`make test`). The processes run on a fixed number of threads: the kernels' scratch is per thread."""
    model, n = parse(shape)
    ref = peak_extra_bytes("reference", model, n, device)
    ours = peak_extra_bytes("extension", model, n, device)
    benchmark.extra_info.update(reference_extra_MiB=ref / 2**20, extension_extra_MiB=ours / 2**20,
                                ratio=ours / ref)
    print(f"\nsnapkv_compress {shape} on {device}: peak extra memory reference {ref / 2**20:.1f} MiB, "
          f"extension {ours / 2**20:.1f} MiB, ratio {ours / ref:.3f}")
    assert ours <= ref / 4, f"extension's peak extra memory {ours / 2**20:.1f} MiB > a quarter of {ref / 2**20:.1f}"
    benchmark.pedantic(lambda: None, rounds=1)
