"""One request's prefill memory against prompt length: Full, one-shot compression, and bounded (rolling) prefill.

Each cell runs in a fresh Python process on one thread: the model is loaded, a short forward warms it up, the
kernel's high-water mark of the process is reset (``/proc/self/clear_refs``), then ``model.generate`` reads the
prompt and makes one token. Reported per cell: peak RSS above the loaded model (VmHWM minus VmRSS before the
prompt), and the peak KV bytes: the most the cache held at once (for a compressing run, read at every layer's
compression: the layers already compressed, the one being compressed whole, the others as they were; for Full, its
final cache), with the cache left after the prompt.

Methods: ``full`` (one forward), ``full-chunked`` (transformers' own ``prefill_chunk_size``, nothing compressed:
the working set of a chunked prefill), ``one-shot`` (``Policy.ripplekv`` at ``--retention``, the prompt in one
forward) and ``bounded_prefill`` (the same policy with ``prefill_chunk=--chunk``). SmolLM2-135M-Instruct up to its 8K
context, then the tiny random Llama (``--tiny-lengths``) beyond it.

    .venv/bin/python bench/e2e_bounded_prefill.py --out bench/results/e2e_bounded_prefill.json

The figure (``--out`` with ``.png``) is drawn after the run; ``--plot-only`` redraws it from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "e2e_bounded_prefill.json"
METHODS = ("full", "full-chunked", "one-shot", "rolling")

_CELL = r"""
import json, sys, torch
from ripplekv_ext import Policy, compress
from ripplekv_ext.eval.models import load_model, shipped_profile_path
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.integrations.transformers import output_cache
from ripplekv_ext.budgets.profile_file import load_profile
model_name, n, method = sys.argv[1], int(sys.argv[2]), sys.argv[3]
retention, chunk = float(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
if model_name == "tiny":
    model = tiny_model("llama", num_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=n + 64)
    sensitivity = [1.0 + (i % 3) for i in range(8)]
else:
    model, _, _ = load_model(model_name)
    sensitivity = load_profile(shipped_profile_path(model_name), model=model)
ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
policy = Policy.ripplekv(sensitivity, retention, prefill_chunk=chunk if method == "rolling" else None)

def layer_bytes(layer):
    keys = getattr(layer, "keys", None)
    return 0 if keys is None or not hasattr(keys, "nbytes") else keys.nbytes + layer.values.nbytes

peak = [0]
holder = {}
def observe(step):
    cache = holder["session"].cache
    others = sum(layer_bytes(l) for i, l in enumerate(cache.layers) if i != step.layer_idx)
    peak[0] = max(peak[0], others + step.keys.nbytes + step.values.nbytes)

def status(field):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(field + ":"))

options = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
with torch.inference_mode():
    model.generate(ids[:, :64], **options)  # warm up outside the measurement
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    if method in ("one-shot", "rolling"):
        with compress(model, policy, on_compress=observe) as session:
            holder["session"] = session
            out = model.generate(ids, **options)
    else:
        kwargs = {"prefill_chunk_size": chunk} if method == "full-chunked" else {}
        out = model.generate(ids, **options, **kwargs)
    rss = status("VmHWM") - before
cache = output_cache(out)
final = sum(layer_bytes(l) for l in cache.layers)
print(json.dumps({"peak_rss_above_model": rss, "peak_kv_bytes": max(peak[0], final), "final_kv_bytes": final}))
"""


def build_parser():
    p = argparse.ArgumentParser(prog="bench/e2e_bounded_prefill.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1000,2000,4000,8000", help="SmolLM2 prompt lengths")
    p.add_argument("--tiny-lengths", default="8000,16000,32000", help="tiny random Llama prompt lengths")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot-only", action="store_true", help="redraw the figure (--out with .png) from --out")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    cells = [("smollm2", int(n)) for n in args.lengths.split(",") if n]
    cells += [("tiny", int(n)) for n in args.tiny_lengths.split(",") if n]
    out = Path(args.out)
    from ripplekv_ext.eval.plots import plot_prefill_memory

    if args.plot_only:
        print(plot_prefill_memory(json.loads(out.read_text()), out.with_suffix(".png")))
        return 0
    settings = {"retention": args.retention, "chunk": args.chunk, "methods": methods}
    results = {"figure": "bounded prefill memory", "settings": settings, "threads": 1, "cells": {}}
    if out.is_file():
        previous = json.loads(out.read_text())
        if previous.get("settings") == settings:
            results["cells"] = previous.get("cells", {})
    from e2e_bench import machine_description
    from ripplekv_ext.jsonio import write_json_atomic

    results["machine"] = machine_description()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for model, n in cells:
        for method in methods:
            key = f"{model}/{n}/{method}"
            if key in results["cells"]:
                continue
            done = subprocess.run([sys.executable, "-c", _CELL, model, str(n), method, str(args.retention),
                                   str(args.chunk)], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"{key} failed:\n{done.stderr[-3000:]}")
            results["cells"][key] = json.loads(done.stdout.strip().splitlines()[-1])
            write_json_atomic(out, results)
            cell = results["cells"][key]
            print(f"{key:<28} peak RSS +{cell['peak_rss_above_model'] / 2**20:7.0f} MiB  peak KV "
                  f"{cell['peak_kv_bytes'] / 2**20:7.1f} MiB  left {cell['final_kv_bytes'] / 2**20:6.1f} MiB",
                  flush=True)
    print(plot_prefill_memory(results, out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
