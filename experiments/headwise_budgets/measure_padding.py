"""What AdaKV's head-wise budgets hold in a padded per-head layout: slots held against the budget's.

At equal kept tokens (``"adakv"``) a layer of ``H`` KV heads keeps ``H x C`` tokens, but a compact cache padded to
its longest head holds ``H x max_h c_h`` slots. At equal bytes (``"adakv-padded"``) it holds at most ``H x C`` and
keeps fewer tokens. For each held-out prompt (the report's fidelity prompts) this prefills once, captures every
compressible layer's window queries and keys, and runs each policy's selection on them: per method and retention,
the slots held and the tokens kept, both as a share of the budget's ``H x C`` summed over layers and prompts.

    .venv/bin/python experiments/headwise_budgets/measure_padding.py --model smollm2 --prompts 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("uniform+adakv", "uniform+adakv-padded", "ripplekv+adakv", "ripplekv+adakv-padded")
PREFIX = {"smollm2": 2048, "gemma3-270m": 1024}  # the report's prompt lengths


def build_parser():
    p = argparse.ArgumentParser(prog="experiments/headwise_budgets/measure_padding.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=sorted(PREFIX))
    p.add_argument("--prompts", type=int, default=8, help="per text domain")
    p.add_argument("--retentions", default="0.1,0.2,0.3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="default: results/padding_MODEL.json")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from ripplekv_ext import KVCompressor, Policy, compress
    from ripplekv_ext.eval.fidelity import fidelity_examples
    from ripplekv_ext.eval.models import load_model, shipped_profile_path
    from ripplekv_ext.methods import make_policy
    from ripplekv_ext.budgets.profile_file import load_profile

    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(args.model)
    profile = load_profile(shipped_profile_path(args.model), model=model)
    retentions = [float(r) for r in args.retentions.split(",")]
    totals = {(m, r): {"held": 0, "kept": 0, "budget": 0} for m in METHODS for r in retentions}
    for text in ("kjv:evaluation", "essays:evaluation"):
        for example in fidelity_examples(tokenizer, PREFIX[args.model], 64, args.prompts, text):
            ids = example[:PREFIX[args.model]]  # the report's prefixes (its continuations are 64 tokens)
            steps = {}
            with compress(model, Policy.snapkv(0.01), on_compress=lambda s: steps.__setitem__(s.layer_idx, s)), \
                    torch.inference_mode():
                model(ids[None], use_cache=True, logits_to_keep=1)
            n = ids.shape[0]
            for method in METHODS:
                for retention in retentions:
                    compressor = KVCompressor.for_model(model, make_policy(method, retention, profile))
                    cell = totals[(method, retention)]
                    for layer, step in steps.items():
                        budget = compressor.layer_budget(layer, n)
                        indices = compressor.select(layer, step.queries, step.keys, step.scale)
                        heads = step.keys.shape[1]
                        cell["budget"] += heads * budget
                        cell["held"] += heads * (budget if indices is None else indices.shape[2])
                        cell["kept"] += heads * budget if indices is None else int((indices >= 0).sum())
            print(f"{text}: prompt done", flush=True)
    rows = [dict(method=m, retention=r, held_over_budget=c["held"] / c["budget"],
                 kept_over_budget=c["kept"] / c["budget"]) for (m, r), c in totals.items()]
    for row in rows:
        print(f"{row['method']:>24} {row['retention']:.0%}: holds {row['held_over_budget']:.3f}x the budget's slots, "
              f"keeps {row['kept_over_budget']:.3f}x its tokens")
    out = Path(args.out) if args.out else RESULTS / f"padding_{args.model}.json"
    out.write_text(json.dumps(dict(model=args.model, prompts_per_domain=args.prompts, prefix_len=PREFIX[args.model],
                                   rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
