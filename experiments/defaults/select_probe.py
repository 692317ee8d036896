"""Choose compress_context's question-agnostic scoring from data: what scores a context before its question.

Protocol "after" (``ripplekv_ext.eval.runner``): each prompt's context is compressed alone (``compress_context``),
then the question is asked after it. Candidates, each at ``--retention``:

* ``tail``: the context's own last ``W`` tokens as the window (SnapKV), the scoring before a probe existed;
* ``keynorm``: ``KeyNormSelector``, which reads no query;
* ``probe:<name>``: a short text prefilled after the context as the window and dropped afterwards (``PROBES``),
  with SnapKV, or with RecentSnapKV (``+recent``: the context's tail kept by position too).

Tasks: the synthetic passkey (``--seed``, ``--length``) and the needle-in-a-haystack test (its depths spread over
``--examples``), both retrieval, where a question-free window fails. Every cell is written to ``--out`` as soon as it
is measured, so an interrupted run resumes.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/defaults/select_probe.py --examples 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ripplekv_ext import KeyNormSelector, Policy, UniformAllocator
from variant_selectors import RecentSnapKVSelector  # beside this file

RESULTS = Path(__file__).resolve().parent / "results" / "select_probe_smollm2.json"
FORMAT = "ripplekv-select-probe"
PROBES = {"repeat": "\n\nRepeat the text above.", "summarize": "\n\nSummarize the text above.",
          "important": "\n\nWhat is the most important piece of information in the text above?"}


def candidates(retention: float) -> dict:
    """name -> (policy, probe text or None)."""
    snapkv = Policy.snapkv(retention)
    recent = Policy(UniformAllocator(), RecentSnapKVSelector(), retention)
    out = {"full": (Policy.full(), None), "tail": (snapkv, None), "tail+recent": (recent, None),
           "keynorm": (Policy(UniformAllocator(), KeyNormSelector(), retention), None)}
    for name, text in PROBES.items():
        out[f"probe:{name}"] = (snapkv, text)
        out[f"probe:{name}+recent"] = (recent, text)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=5)
    p.add_argument("--length", type=int, default=1700, help="prompt length in tokens")
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default="passkey,needle")
    p.add_argument("--candidates", default=None, help="comma-separated (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.models import load_smollm2
    from ripplekv_ext.eval.needle import make_needle
    from ripplekv_ext.eval.runner import context_generate_fn, evaluate
    from ripplekv_ext.eval.synthetic import make_synthetic

    settings = {"examples": args.examples, "length": args.length, "retention": args.retention, "seed": args.seed}
    data = {"format": FORMAT, "settings": settings, "cells": {}}
    if args.out.exists():
        data = json.loads(args.out.read_text())
        if data.get("format") != FORMAT or data.get("settings") != settings:
            sys.exit(f"{args.out} holds a run with other settings; pass --out for a new file")
    model, tokenizer = load_smollm2()
    policies = candidates(args.retention)
    wanted = args.candidates.split(",") if args.candidates else list(policies)

    def generate_fn(policy, text):
        probe = None if text is None else torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        return context_generate_fn(model, tokenizer, policy, probe_ids=probe, default_probe=False)

    for task in args.tasks.split(","):
        if task == "needle":
            depths = [100 * i / max(args.examples - 1, 1) for i in range(args.examples)]
            examples = make_needle(tokenizer, lengths=(args.length,), depths=depths)
        else:
            examples = make_synthetic(task, tokenizer, length=args.length, num_examples=args.examples, seed=args.seed)
        for name in wanted:
            key = f"{task}/{name}"
            if key in data["cells"]:
                continue
            policy, text = policies[name]
            start = time.perf_counter()
            report = evaluate(examples, generate_fn(policy, text), progress=False, protocol="after")
            data["cells"][key] = {"task": task, "candidate": name, "probe": text, "policy": policy.name,
                                  "score": report.mean(), "scores": [r.score for r in report.results],
                                  "probe_tokens": 0 if text is None else len(tokenizer(text, add_special_tokens=False)
                                                                              ["input_ids"]),
                                  "seconds": time.perf_counter() - start}
            write_json_atomic(args.out, data)
            print(f"{key}: {report.mean():.1f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
