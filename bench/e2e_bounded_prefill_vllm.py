"""Bounded prefill inside vLLM: at a fixed KV pool, the longest prompt that completes and the peak concurrency on
long prompts, for stock vLLM, the plugin compressing once after the prompt, the plugin compressing every
``--prefill-chunk`` prompt tokens, and the same with compression while decoding (``--decode-every``,
``--decode-budget``), which bounds what a request can generate too: only then may the pool hold less than
``max_model_len`` (vLLM admits any request up to it, and a short prompt may generate that far).

The pool holds ``--blocks`` blocks of ``--block-size`` tokens of every layer (64 x 32: 2,048 tokens); the model is
the tiny random Llama of ``e2e_serving_vllm.py --quick`` (4 layers, head size 64). **Longest prompt:** one request
of each length in ``--lengths`` (``--new`` tokens each), an engine per length whose ``max_model_len`` fits it;
"completes" is an engine that starts and a request that finishes. **Concurrency:** ``--requests`` requests of
``--mix-min`` to ``--mix-max`` prompt tokens submitted at t = 0 to one engine (``e2e_serving_vllm.run``: peak running
requests, tokens/s, preemptions). Engines in this process, one thread; run with the vLLM environment's Python::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/e2e_bounded_prefill_vllm.py \
        --out bench/results/e2e_bounded_prefill_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from e2e_serving_vllm import Workload, run, tiny_model  # (sets vLLM's offline environment first)

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "e2e_bounded_prefill_vllm.json"


def build_parser():
    p = argparse.ArgumentParser(prog="bench/e2e_bounded_prefill_vllm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--decode-every", type=int, default=64)
    p.add_argument("--decode-budget", type=int, default=1024)
    p.add_argument("--lengths", default="1024,1536,2016,2048,3072,4096,6144,8192,10240,12288")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--mix-min", type=int, default=1024)
    p.add_argument("--mix-max", type=int, default=1984)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    return p


def settings_of(args) -> dict:
    one_shot = {"method": "snapkv", "retention": args.retention}
    rolling = {**one_shot, "prefill_chunk": args.prefill_chunk}
    return {"stock": None, "one-shot": one_shot, "rolling": rolling,
            "rolling-decode": {**rolling, "decode_every": args.decode_every, "decode_budget": args.decode_budget}}


def completes(model, n, args, ripplekv) -> dict:
    generator = torch.Generator().manual_seed(args.seed)
    request = Workload([("0", torch.randint(3, 2048, (n,), generator=generator).tolist(), args.new)])
    try:
        row = run(model, request, args, ripplekv)
    except (ValueError, RuntimeError) as err:  # the engine refuses a max_model_len its pool cannot hold
        # pydantic wraps the plugin's refusal in "1 validation error for VllmConfig": keep the reason.
        reason = next((line for line in str(err).splitlines() if "ripplekv" in line), str(err).splitlines()[0])
        return {"completes": False, "error": " ".join(reason.split())[:400]}
    return {"completes": row["generated_tokens"] == args.new, "min_free_blocks": row["min_free_blocks"],
            "seconds": row["seconds"]}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lengths = [int(n) for n in args.lengths.split(",") if n]
    result = {"figure": "bounded prefill in vLLM", "pool_tokens": args.blocks * args.block_size,
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "longest": {}, "concurrency": {}}
    with tempfile.TemporaryDirectory() as scratch:
        model, _ = tiny_model(Path(scratch), max_position_embeddings=max(lengths) + args.new + args.block_size)
        for name, ripplekv in settings_of(args).items():
            runs = {}
            for n in lengths:
                runs[str(n)] = completes(model, n, args, ripplekv)
                print(f"{name:<9} prompt {n:>6}: {'completes' if runs[str(n)]['completes'] else 'does not'}",
                      flush=True)
            done = [n for n in lengths if runs[str(n)]["completes"]]
            result["longest"][name] = {"longest_completed": max(done, default=0), "runs": runs}
        generator = torch.Generator().manual_seed(args.seed)
        lengths_mix = torch.randint(args.mix_min, args.mix_max + 1, (args.requests,), generator=generator).tolist()
        requests = Workload([(str(i), torch.randint(3, 2048, (n,), generator=generator).tolist(), args.new)
                             for i, n in enumerate(lengths_mix)])
        for name, ripplekv in settings_of(args).items():
            row = run(model, requests, args, ripplekv)
            row.pop("tokens", None)
            result["concurrency"][name] = row
            print(f"{name:<9} mix of {args.requests}: peak {row['peak_requests']} running, "
                  f"{row['generated_tokens_per_s']:.1f} gen tok/s, preemptions {row['preemptions']}", flush=True)
    stock = result["longest"]["stock"]["longest_completed"]
    for row in result["longest"].values():
        row["vs_stock"] = row["longest_completed"] / stock if stock else None
    out = Path(args.out)
    from ripplekv_ext.jsonio import write_json_atomic

    write_json_atomic(out, result)
    print(json.dumps({k: v["longest_completed"] for k, v in result["longest"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
