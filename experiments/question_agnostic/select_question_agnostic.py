"""Compress once, ask anything: which question-agnostic scoring keeps what a later question needs, on real text.

The question is asked after the context was compressed alone (``compress_context`` then ``continue_context``), at
``--retention`` (20%) with ``Policy.ripplekv``'s default budgets and selection: passkeys hidden in real prose
(``passkey_text``: held-out KJV or essays running text, 5 depths) and the needle-in-a-haystack grid, for each
``compress_context`` scoring (``probe``: "Repeat the text above." as the window; ``surprisal``: half of each
layer's context slots by the probe, half by the context's most surprising spans; ``reconstruction``: KVzip's
context reconstruction; ``tail``: the context's own last tokens; ``probe:NAME``: another question-agnostic
instruction of ``PROBES`` as the window; ``h2o``: H2O's attention accumulated over every context query, no window of
its own, under the same
budgets) beside Full; Wilson intervals. Also each scoring's
cost: the seconds of ``compress_context``. ``--seed 0`` is the calibration set,
``--seed 1`` the held-out one (other passkeys, and the needle at other lengths and depths). With ``--fidelity N``:
the text-fidelity KL of contexts compressed this way (N held-out KJV and N essay windows of 2,048 + 64 tokens, as the
report's fidelity part; KL(Full || compressed) at the continuation's positions 2-64, teacher-forced after
``compress_context``) beside ``tail``, the context's own last
tokens, which is what one-shot compression of a prefix does. Results after every cell to ``--out``; a rerun resumes.
One thread.

    .venv/bin/python experiments/question_agnostic/select_question_agnostic.py --model smollm2 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SCORINGS = ("probe", "surprisal", "reconstruction", "tail", "h2o")
# Other question-agnostic instructions scored as the probe is (``probe:NAME``): none names the task's answer.
PROBES = {
    "facts": "\n\nList every name, number and date in the text above.",
    "repeat-facts": "\n\nRepeat the text above. Then list every name, number and date in it.",
    "summary": "\n\nSummarize the text above.",
    "question": "\n\nAnswer a question about the text above.",
}

# The needle grid of a held-out run (any seed but 0): cells the calibration grid (1,024-2,048 tokens, depths 0-100%)
# does not hold.
HELD_OUT_NEEDLES = dict(lengths=(1280, 1792), depths=(10, 35, 60, 85))


def build_parser():
    p = argparse.ArgumentParser(prog="experiments/question_agnostic/select_question_agnostic.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--examples", type=int, default=20, help="passkey_text prompts (4 per depth)")
    p.add_argument("--length", type=int, default=None, help="passkey_text tokens (default: the task's)")
    p.add_argument("--scorings", default=",".join(SCORINGS))
    p.add_argument("--tasks", default="passkey_text,needle")
    p.add_argument("--fidelity", type=int, default=0,
                   help="text windows per domain for the fidelity KL (0: none; at least 2, for the paired interval)")
    p.add_argument("--out", default=None)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [s for s in args.scorings.split(",")
               if s not in SCORINGS and not (s.startswith("probe:") and s.split(":", 1)[1] in PROBES)]
    if args.fidelity == 1 or args.fidelity < 0:
        parser.error(f"--fidelity must be 0 (none) or at least 2 windows per domain (the paired interval needs two), "
                     f"got {args.fidelity}")
    if unknown:
        parser.error(f"unknown scoring(s) {', '.join(unknown)}: use {', '.join(SCORINGS)} or probe:NAME with NAME "
                     f"one of {', '.join(PROBES)}")
    torch.set_num_threads(1)
    from ripplekv_ext import Policy, continue_context
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.models import load_model, shipped_profile_path
    from ripplekv_ext.eval.needle import make_needle
    from ripplekv_ext.eval.runner import evaluate, greedy_options
    from ripplekv_ext.eval.synthetic import even_depths, make_synthetic
    from ripplekv_ext.budgets.profile_file import load_profile
    from ripplekv_ext.profiler.stats import wilson_interval

    model, tokenizer, name = load_model(args.model)
    policy = Policy.ripplekv(load_profile(shipped_profile_path(args.model), model=model), args.retention)
    options = greedy_options(model, tokenizer)
    tasks = {}
    if "passkey_text" in args.tasks:
        tasks["passkey_text"] = make_synthetic("passkey_text", tokenizer, length=args.length,
                                               num_examples=args.examples, seed=args.seed, depths=even_depths(5))
    if "needle" in args.tasks:
        # Seed 0: the report's grid; another seed: other lengths and depths in the same haystack (held out).
        tasks["needle"] = make_needle(tokenizer) if args.seed == 0 else make_needle(tokenizer, **HELD_OUT_NEEDLES)
    out = Path(args.out or RESULTS / f"select_question_agnostic_{args.model}_s{args.seed}.json")
    results = json.loads(out.read_text()) if out.is_file() else {}
    results.update({"figure": "question-agnostic scoring on real text", "model": name, "seed": args.seed,
                    "retention": args.retention, "policy": repr(policy), "threads": 1})
    cells = results.setdefault("cells", {})
    for task, examples in tasks.items():
        for scoring in ["full"] + args.scorings.split(","):
            key = f"{task}/{scoring}"
            if key in cells:
                continue
            seconds = []

            def generate(input_ids, max_new_tokens, context_tokens):
                context = input_ids[:, :context_tokens]
                start = time.perf_counter()
                with torch.inference_mode():
                    cache = compressed(model, tokenizer, context, policy, scoring)
                    seconds.append(time.perf_counter() - start)
                    output = continue_context(model, cache, input_ids[:, context_tokens:], copy_cache=False,
                                              max_new_tokens=max_new_tokens, **options)
                return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)

            report = evaluate(examples, generate, progress=False, protocol="after")
            scores = [r.score for r in report.results]
            found = sum(scores)
            low, high = wilson_interval(int(round(found)), len(scores), 0.95) if task != "needle" else (None, None)
            cells[key] = {"score_sum": found, "examples": len(scores), "wilson_low": low, "wilson_high": high,
                          "scores": scores, "compress_seconds_median": sorted(seconds)[len(seconds) // 2]}
            write_json_atomic(out, results)
            print(f"{task} {scoring}: {found:.1f}/{len(scores)}  compress_context "
                  f"{cells[key]['compress_seconds_median']:.1f}s",
                  flush=True)
    if args.fidelity:
        fidelity(args, model, tokenizer, policy, cells, results, out)
    return 0


def compressed(model, tokenizer, context, policy, scoring: str):
    """``context`` compressed alone by ``scoring``: ``full`` (nothing dropped), ``h2o`` (H2O's selector under the
    policy's budgets), ``probe:NAME`` (an instruction of ``PROBES`` as the probe) or a ``compress_context`` scoring."""
    from ripplekv_ext import Policy, compress_context
    from ripplekv_ext.selection.selectors import H2OSelector

    if scoring == "full":
        return compress_context(model, context, Policy.full())
    if scoring == "h2o":
        return compress_context(model, context, dataclasses.replace(policy, selector=H2OSelector()), scoring="tail")
    if scoring.startswith("probe:"):
        probe = tokenizer(PROBES[scoring.split(":", 1)[1]], add_special_tokens=False)["input_ids"]
        return compress_context(model, context, policy, probe_ids=torch.tensor([probe]))
    return compress_context(model, context, policy, tokenizer=tokenizer, scoring=scoring)


def fidelity(args, model, tokenizer, policy, cells, results, out):
    """KL(Full || compressed) per text window, each scoring (``tail`` always: one-shot compression's), with the
    paired difference from ``tail``."""
    from ripplekv_ext.integrations.transformers import cache_argument
    from ripplekv_ext import compress
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.fidelity import fidelity_examples, kl_per_position, paired_kl_comparison


    prefix_len, cont_len = 2048, 64
    scorings = ["tail"] + [s for s in args.scorings.split(",") if s not in ("tail", "h2o")]
    for text in ("kjv:evaluation", "essays:evaluation"):
        ids = fidelity_examples(tokenizer, prefix_len, cont_len, args.fidelity, text)
        full_logits = []
        with torch.inference_mode():
            for row in ids:  # continuation token t + 1 is predicted at position prefix_len + t
                logits = model(row[None], logits_to_keep=cont_len).logits[0, :-1].float()
                full_logits.append(logits)
        domain = f"fidelity_{text.split(':')[0]}"
        for scoring in scorings:
            key = f"{domain}/{scoring}"
            if key in cells:
                continue
            kl = []
            for row, full in zip(ids, full_logits):
                with torch.inference_mode():
                    cache = compressed(model, tokenizer, row[None, :prefix_len], policy, scoring)
                    with compress(model, policy):  # compressed layers are continued inside the hook
                        logits = model(row[None, prefix_len:], use_cache=True,
                                       **{cache_argument(): cache}).logits[0, :-1]
                kl.append(kl_per_position(full, logits.float()).mean().item())
            cells[key] = {"kl_mean": sum(kl) / len(kl), "kl": kl, "examples": len(kl), "prefix_len": prefix_len,
                          "cont_len": cont_len}
            if scoring != "tail":
                cells[key]["against_tail"] = paired_kl_comparison(kl, cells[f"{domain}/tail"]["kl"])
            write_json_atomic(out, results)
            print(f"{key}: KL {cells[key]['kl_mean']:.4f} over {len(kl)} windows", flush=True)


if __name__ == "__main__":
    sys.exit(main())
