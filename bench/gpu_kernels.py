"""The GPU kernel table: every routed CUDA op, its fused kernel, the torch reference and what ``auto`` runs, side by
side in one run at Llama-3.1-8B shapes (B=1, H_q=32, H_kv=8, D=128, W=32, 20% kept), N = 2K..32K, bf16 and fp16.

Writes one JSON file with a row per (op, dtype, N): ``ext_us`` (the fused kernel, ``torch.ops.ripplekv``), ``ref_us``
(``ripplekv_ref``), ``auto_us`` (``ripplekv_ext.ops`` under ``RIPPLEKV_CUDA_PATH=auto``: the kernel or the reference by
``ops/cuda_path.py``'s table), ``speedup`` (ref / ext), ``auto_speedup`` (ref / auto: the floor is 1), ``hbm_fraction``
(the bytes the op must move / the fused kernel's time / the device's peak bandwidth) and ``extra_mib`` (the fused
kernel's peak memory beyond its inputs and outputs). Medians after warm-up, CUDA events. The rows say where each
op's crossover lies: ``FUSED_UP_TO`` in ``ripplekv_ext/ops/cuda_path.py`` is written from them.

    python bench/gpu_kernels.py --out "$OUT/gpu_kernels_h200.json"       # on the GPU (bench/gpu_check.sh runs it)
    python bench/gpu_kernels.py --dry-run --out /tmp/gpu_kernels.json    # CPU rehearsal: small shapes, 2 rounds

The dry run times CPU tensors with the same code (a wall clock for the events), so that nothing in it fails on the
device for a reason a CPU could have caught.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

LLAMA_8B = dict(name="llama-3.1-8b", h_q=32, h_kv=8, d=128, w=32)
DRY_SHAPE = dict(name="dry-run", h_q=8, h_kv=2, d=64, w=8)
# Peak HBM bandwidth by device name (bytes per second); --peak-gbs for another device.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
OPS = ("snapkv_compress", "snapkv_scores", "select_topk", "gather_kv", "h2o_scores")
# H2O reads every query against every key: its reference is quadratic in N, so it is timed at the shorter lengths.
H2O_MAX_N = 8192


def build_parser():
    p = argparse.ArgumentParser(prog="bench/gpu_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--peak-gbs", type=float, default=None, help="device peak bandwidth, GB/s (default: by name)")
    p.add_argument("--dry-run", action="store_true", help="CPU tensors, N 256 and 512, 2 rounds, one dtype")
    return p


class Timer:
    """Median microseconds of ``fn()`` over ``rounds`` after ``warmup`` calls: CUDA events on a GPU, a wall clock on
    the CPU."""

    def __init__(self, device: torch.device, rounds: int, warmup: int):
        self.device, self.rounds, self.warmup = device, rounds, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.rounds):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)


def extra_mib(device: torch.device, fn, held_bytes: int) -> float | None:
    """Peak memory of one ``fn()`` beyond what was allocated before it and ``held_bytes`` of its outputs (GPU only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return max(peak - held_bytes, 0) / 2**20


def op_case(op: str, shape: dict, n: int, dtype: torch.dtype, device: torch.device, retention: float):
    """``(ext, ref, auto, bytes_moved, output_bytes)`` for one op at one length: three zero-argument calls on the same
    inputs, the bytes the op must move at least, and the bytes of its outputs."""
    import ripplekv_ref
    from ripplekv_ext import ops

    g = torch.Generator(device="cpu").manual_seed(n)
    h_q, h_kv, d, w = shape["h_q"], shape["h_kv"], shape["d"], shape["w"]
    elt = torch.empty((), dtype=dtype).element_size()
    budget = max(int(n * retention), w)

    def randn(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    q, k, v = randn(1, h_q, w, d), randn(1, h_kv, n, d), randn(1, h_kv, n, d)
    kv_bytes = h_kv * n * d * elt
    kept_bytes = h_kv * budget * d * elt
    if op == "snapkv_compress":
        args = (q, k, v, budget)
        # K read once to score; the kept K and V read and written; the indices written.
        return (lambda: torch.ops.ripplekv.snapkv_compress(*args, 7, "max", "mean", None),
                lambda: ripplekv_ref.snapkv_compress(*args), lambda: ops.snapkv_compress(*args),
                q.nbytes + kv_bytes + 4 * kept_bytes + h_kv * budget * 8, 2 * kept_bytes + h_kv * budget * 8)
    if op == "snapkv_scores":
        out_bytes = h_kv * (n - w) * 4
        return (lambda: torch.ops.ripplekv.snapkv_scores(q, k, 7, "max", "mean", None, None),
                lambda: ripplekv_ref.snapkv_scores(q, k), lambda: ops.snapkv_scores(q, k),
                q.nbytes + kv_bytes + out_bytes, out_bytes)
    if op == "select_topk":
        scores = torch.rand(1, h_kv, n - w, generator=g).to(device)
        out_bytes = h_kv * budget * 8
        return (lambda: torch.ops.ripplekv.select_topk(scores, budget, w),
                lambda: ripplekv_ref.select_topk(scores, budget, w), lambda: ops.select_topk(scores, budget, w),
                scores.nbytes + out_bytes, out_bytes)
    if op == "gather_kv":
        idx = torch.sort(torch.randperm(n, generator=g)[:budget]).values.to(device).expand(1, h_kv, budget).contiguous()
        return (lambda: torch.ops.ripplekv.gather_kv(k, v, idx), lambda: ripplekv_ref.gather_kv(k, v, idx),
                lambda: ops.gather_kv(k, v, idx), 4 * kept_bytes + idx.nbytes, 2 * kept_bytes)
    if op == "h2o_scores":
        queries = randn(1, h_q, n, d)
        out_bytes = h_kv * n * 4
        return (lambda: torch.ops.ripplekv.h2o_scores(queries, k, 1024, None, "mean", None),
                lambda: ripplekv_ref.h2o_scores(queries, k), lambda: ops.h2o_scores(queries, k),
                queries.nbytes + kv_bytes + out_bytes, out_bytes)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ripplekv_ext.jsonio import write_json_atomic

    if args.dry_run:
        device, shape = torch.device("cpu"), DRY_SHAPE
        lengths, dtypes, rounds, warmup = [256, 512], [torch.float32], 2, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_kernels: no CUDA device (use --dry-run to rehearse on the CPU)")
        device, shape = torch.device("cuda"), LLAMA_8B
        lengths = [int(x) for x in args.lengths.split(",") if x]
        dtypes = [getattr(torch, name) for name in args.dtypes.split(",") if name]
        rounds, warmup = args.rounds, args.warmup
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    peak = args.peak_gbs * 1e9 if args.peak_gbs else next(
        (bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
    ops_to_run = [op for op in args.ops.split(",") if op]
    timer = Timer(device, rounds, warmup)
    results = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "rounds": rounds,
               "shape": shape["name"], "peak_bytes_per_s": peak, "rows": []}
    saved_path = os.environ.get("RIPPLEKV_CUDA_PATH")
    os.environ["RIPPLEKV_CUDA_PATH"] = "auto"  # the wrappers' own choice, whatever the caller's environment says
    try:
        for op in ops_to_run:
            for dtype in dtypes:
                for n in lengths:
                    if op == "h2o_scores" and n > H2O_MAX_N and not args.dry_run:
                        continue
                    ext, ref, auto, nbytes, out_bytes = op_case(op, shape, n, dtype, device, args.retention)
                    ext_us, ref_us, auto_us = timer(ext), timer(ref), timer(auto)
                    row = {"op": op, "shape": shape["name"], "dtype": str(dtype).replace("torch.", ""), "n": n,
                           "ext_us": ext_us, "ref_us": ref_us, "auto_us": auto_us, "speedup": ref_us / ext_us,
                           "auto_speedup": ref_us / auto_us,
                           "hbm_fraction": nbytes / (ext_us * 1e-6) / peak if peak else None,
                           "extra_mib": extra_mib(device, ext, out_bytes)}
                    results["rows"].append(row)
                    write_json_atomic(Path(args.out), results)
                    print(f"{op:16s} {row['dtype']:9s} N={n:6d}  ext {ext_us:9.1f} us  ref {ref_us:9.1f} us  "
                          f"auto {auto_us:9.1f} us  speedup {row['speedup']:5.2f}x  auto {row['auto_speedup']:5.2f}x",
                          flush=True)
        from ripplekv_ext.ops.cuda_path import FUSED_UP_TO, crossovers

        measured = crossovers(results["rows"])
        print("crossovers these rows give (FUSED_UP_TO, ripplekv_ext/ops/cuda_path.py):", measured)
        if any(FUSED_UP_TO.get(op) != limit for op, limit in measured.items()):
            print(f"  the committed table differs: {FUSED_UP_TO}")
    finally:
        if saved_path is None:
            os.environ.pop("RIPPLEKV_CUDA_PATH", None)
        else:
            os.environ["RIPPLEKV_CUDA_PATH"] = saved_path
    return 0


if __name__ == "__main__":
    sys.exit(main())
