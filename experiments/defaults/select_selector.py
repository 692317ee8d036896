"""Choose the selector defaults from data: RecentSnapKVSelector's recent share, and RippleKV's default selector.

Every candidate is scored by fidelity, the mean KL(Full || compressed) over a teacher-forced continuation of
``--cont-len`` tokens after ``--prompt-len``-token prompts, at each of ``--retentions`` (lower is better), on two
text domains: the KJV and Paul Graham's essays (``ripplekv_ext.eval.corpus``). Candidates are *selected* on the
calibration splits (KJV windows after every token the shipped profile was measured on; the calibration essays) and
*confirmed* on the held-out splits (KJV books and essays no profile saw).

Candidates: the published methods whose selection reads only the window (StreamingLLM, SnapKV, PyramidKV,
RippleKV) and, for each share ``f`` in ``--fractions``, RecentSnapKVSelector under uniform and RippleKV budgets.
Each prompt is prefilled once (``SharedPrefill``); each cell (split, candidate, retention) is written to ``--out``
as soon as it is measured, so an interrupted run resumes where it stopped.

A recent share buys running-text fidelity with scored slots, which retrieval needs. ``--retrieval`` scores the
candidates on a calibration needle grid instead (``CALIBRATION_NEEDLES``: lengths and depths the report's needle
grid does not use, the question inside the prompt, at ``--retrieval-retention``), so that the share can be chosen
as the largest whose retrieval is no worse than SnapKV's before any held-out retrieval is looked at.

Eight generations score in thirds of a phrase: too coarse to rank selectors. ``--answer-kl`` scores retrieval the
way fidelity scores text: the KL(Full || compressed) over Full's own greedy answer, teacher-forced (its first
``ANSWER_TOKENS`` tokens), on calibration retrieval prompts with the question inside: the needle at 2 lengths x 8
depths and 16 passkey prompts (``CALIBRATION_ANSWERS``; neither the report's lengths nor its seed), at
``--retrieval-retention``. Every prompt is prefilled once for all candidates.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/defaults/select_selector.py --examples 8
    OMP_NUM_THREADS=1 .venv/bin/python experiments/defaults/select_selector.py --model gemma3-270m --prompt-len 1024 \
        --examples 8
    OMP_NUM_THREADS=1 .venv/bin/python experiments/defaults/select_selector.py --answer-kl \
        --out experiments/defaults/results/select_selector_smollm2_answers.json

``--compare-profile`` scores RippleKV's default on a second profile beside the first, on the same prompts (how
gemma-3-270m's Fisher profile was chosen over its perturbation one; add ``--answer-kl`` for retrieval):

    OMP_NUM_THREADS=1 .venv/bin/python experiments/defaults/select_selector.py --model gemma3-270m --prompt-len 1024 \
        --examples 16 --splits select-kjv,select-essays \
        --only streamingllm,snapkv,pyramidkv,uniform+adaptive-recent,ripplekv+adaptive-recent \
        --compare-profile ripplekv_ext/eval/profiles/gemma3-270m_profile_P1024_T64_n6.json \
        --out experiments/defaults/results/select_selector_gemma3_profiles.json

Runs with one thread unless ``--threads`` says more (the machine is shared); the results file records the load
average at each cell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ripplekv_ext import (PeakSpanSelector, Policy, RippleKVAllocator, RippleKVRatioAllocator, SnapKVSelector,
                          UniformAllocator)
from ripplekv_ext.budgets.allocators import DEFAULT_RATIO
from ripplekv_ext.policies import DEFAULT_WINDOW

from variant_selectors import AdaptiveRecentSelector, RecentSnapKVSelector  # beside this file
from select_defaults import Scorer, cut_examples  # experiments/defaults/select_defaults.py, beside this file

RESULTS = Path(__file__).resolve().parent / "results"
FORMAT = "ripplekv-select-selector"
# (lengths, depths in percent) of the calibration needle grid: none of the report's (1024/1536/2048 x 0/25/50/75/100).
CALIBRATION_NEEDLES = ((1280, 1792), (10, 40, 60, 90))
# --answer-kl: the needle at (prompt length - 512, prompt length) x these depths, and passkey prompts of the
# prompt length at 8 even depths from seed 1 (the report's are seed 0); Full's answer is cut to ANSWER_TOKENS.
CALIBRATION_ANSWERS = {"needle_depths": (10, 20, 30, 40, 60, 70, 80, 90), "passkey_examples": 16, "passkey_seed": 1}
ANSWER_TOKENS = 24
SPLITS = {"select-kjv": "kjv:calibration", "select-essays": "essays:calibration",
          "confirm-kjv": "kjv:evaluation", "confirm-essays": "essays:evaluation"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a known model (ripplekv_ext.eval.models.GGUF_MODELS)")
    p.add_argument("--examples", type=int, default=8, help="prompts per split (default 8)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--cont-len", type=int, default=64)
    p.add_argument("--retentions", default="0.1,0.2,0.3")
    p.add_argument("--fractions", default="0.25,0.5,0.75")
    p.add_argument("--splits", default=",".join(SPLITS))
    p.add_argument("--profile", type=Path, default=None,
                   help="the RippleKV profile to score (default: the one shipped for --model), e.g. a --fast one")
    p.add_argument("--compare-profile", type=Path, default=None,
                   help="a second profile: adds RippleKV's default (adaptive-recent) on it as a candidate, scored "
                        "on the same prompts (KJV prompts start after both profiles' text)")
    p.add_argument("--exponents", default=None,
                   help="comma-separated exponents: also score RippleKV's budgets with weights s ** exponent")
    p.add_argument("--only", default=None, help="comma-separated candidate names to score (default: all)")
    p.add_argument("--retrieval", action="store_true", help="score the calibration needle grid instead of KL")
    p.add_argument("--answer-kl", action="store_true",
                   help="score KL over Full's answers on calibration needle and passkey prompts instead")
    p.add_argument("--answer-length", type=int, default=None,
                   help="--answer-kl's prompt length (default: 1792 for smollm2, 896 otherwise)")
    p.add_argument("--retrieval-retention", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="default experiments/defaults/results/select_selector_<model>.json")
    args = p.parse_args(argv)
    for name in ("examples", "prompt_len", "cont_len", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.retentions = [float(x) for x in args.retentions.split(",")]
        args.fractions = [float(x) for x in args.fractions.split(",")]
        if args.exponents is not None:
            args.exponents = [float(x) for x in args.exponents.split(",")]
    except ValueError:
        p.error("--retentions, --fractions and --exponents take comma-separated numbers, e.g. 0.1,0.2")
    if not all(0 < r <= 1 for r in args.retentions) or not all(0 <= f <= 1 for f in args.fractions):
        p.error("retentions must be in (0, 1] and fractions in [0, 1]")
    if not all(0 <= e < float("inf") for e in args.exponents or []):
        p.error(f"--exponents must be finite numbers >= 0, got {args.exponents}")
    args.splits = args.splits.split(",")
    unknown = [s for s in args.splits if s not in SPLITS]
    if unknown:
        p.error(f"--splits takes {', '.join(SPLITS)}, got {unknown}")
    if args.retrieval and args.answer_kl:
        p.error("--retrieval and --answer-kl are two scorings: pick one")
    if args.answer_length is None:
        args.answer_length = 1792 if args.model == "smollm2" else 896
    if args.answer_length <= 600:
        p.error(f"--answer-length must exceed 600 (the shorter needle prompt is 512 tokens less), got "
                f"{args.answer_length}")
    args.out = args.out or RESULTS / f"select_selector_{args.model}.json"
    args.window = DEFAULT_WINDOW
    return args


def candidates(profile, fractions, other=None, exponents=()):
    """name -> policy at a retention; the published methods first ("ripplekv" is the paper's pairing, with SnapKV).
    ``other``: (candidate name, profile) of a second profile to score RippleKV's default on. ``exponents``: RippleKV's
    budgets with weights ``s ** exponent`` beside the default's, and the paper's ``R ** z`` (R = 1.75, min-max)."""
    out = {"streamingllm": lambda r: Policy.streamingllm(r), "snapkv": lambda r: Policy.snapkv(r),
           "pyramidkv": lambda r: Policy.pyramidkv(r),
           "ripplekv": lambda r: Policy.ripplekv(profile, r, selector=SnapKVSelector())}
    for f in fractions:
        out[f"uniform+recent-snapkv f={f:g}"] = lambda r, f=f: Policy(UniformAllocator(), RecentSnapKVSelector(f), r)
        out[f"ripplekv+recent-snapkv f={f:g}"] = lambda r, f=f: Policy(RippleKVAllocator(profile),
                                                                       RecentSnapKVSelector(f), r)
    out["uniform+adaptive-recent"] = lambda r: Policy(UniformAllocator(), AdaptiveRecentSelector(), r)
    out["ripplekv+adaptive-recent"] = lambda r: Policy(RippleKVAllocator(profile), AdaptiveRecentSelector(), r)
    # SnapKV's other pooling: averaged scores favour contiguous spans over isolated peaks (docs/defaults.md).
    out["ripplekv+adaptive-recent avg"] = lambda r: Policy(RippleKVAllocator(profile),
                                                          AdaptiveRecentSelector(pooling="avg"), r)
    # Half the scored slots to max-pooled peaks, half to averaged spans (PeakSpanSelector, docs/defaults.md).
    out["uniform+peak-span"] = lambda r: Policy(UniformAllocator(), PeakSpanSelector(value_weighted=False), r)
    out["ripplekv+peak-span"] = lambda r: Policy(RippleKVAllocator(profile), PeakSpanSelector(value_weighted=False), r)
    # Each position's attention mass times its value's norm before the pooling (VATP; docs/defaults.md).
    out["uniform+peak-span value-weighted"] = lambda r: Policy(UniformAllocator(),
                                                               PeakSpanSelector(value_weighted=True), r)
    out["ripplekv+peak-span value-weighted"] = lambda r: Policy(RippleKVAllocator(profile),
                                                                PeakSpanSelector(value_weighted=True), r)
    out["ripplekv+snapkv value-weighted"] = lambda r: Policy(RippleKVAllocator(profile),
                                                             SnapKVSelector(value_weighted=True), r)
    out[f"ripplekv R={DEFAULT_RATIO:g}+adaptive-recent"] = lambda r: Policy(
        RippleKVRatioAllocator(profile, DEFAULT_RATIO), AdaptiveRecentSelector(), r)
    for e in exponents:
        out[f"ripplekv s^{e:g}+adaptive-recent"] = lambda r, e=e: Policy(RippleKVAllocator(profile, exponent=e),
                                                                        AdaptiveRecentSelector(), r)
    if other is not None:
        name, other_profile = other
        out[name] = lambda r: Policy(RippleKVAllocator(other_profile), AdaptiveRecentSelector(), r)
    return out


def summary(cells: dict, retentions) -> dict:
    """Per split group (select / confirm) and retention: each candidate's mean KL over the group's examples (both
    domains), its rank, and its mean paired difference to the best published method there."""
    from ripplekv_ext.eval.fidelity import paired_kl_comparison

    out = {}
    for group in ("select", "confirm"):
        for r in retentions:
            per_candidate = {}
            for cell in cells.values():
                if cell["split"].startswith(group) and cell["retention"] == r:
                    per_candidate.setdefault(cell["candidate"], {})[cell["split"]] = cell["kl_per_example"]
            splits = sorted({s for v in per_candidate.values() for s in v})
            complete = {name: sum((v[s] for s in splits), []) for name, v in per_candidate.items()
                        if all(s in v for s in splits)}
            if not complete:
                continue
            published = [n for n in ("streamingllm", "snapkv", "pyramidkv", "ripplekv") if n in complete]
            best = min(published, key=lambda n: sum(complete[n])) if published else None
            rows = []
            for name, values in sorted(complete.items(), key=lambda kv: sum(kv[1])):
                row = {"candidate": name, "kl": sum(values) / len(values), "examples": len(values)}
                if best and name != best:
                    row["vs_best_published"] = {k: (None if isinstance(v, float) and v != v else v)
                                                for k, v in paired_kl_comparison(values, complete[best]).items()}
                rows.append(row)
            out[f"{group} @{r:g}"] = {"splits": splits, "best_published": best, "rows": rows}
    return out


def retrieval(model, tokenizer, policies, args, data, log) -> int:
    """Phrase recall of each candidate on the calibration needle grid (one cell per candidate)."""
    from ripplekv_ext import compress
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.needle import make_needle
    from ripplekv_ext.eval.runner import evaluate, greedy_generate_fn

    lengths, depths = CALIBRATION_NEEDLES
    examples = make_needle(tokenizer, lengths, depths)
    r = args.retrieval_retention
    for name, make in {"full": None, **policies}.items():
        key = f"retrieval/{name}/{r:g}"
        if key in data["cells"]:
            continue
        start = time.perf_counter()
        compression = None if make is None else (lambda p=make(r): compress(model, p))
        report = evaluate(examples, greedy_generate_fn(model, tokenizer, compression), progress=False)
        scores = [result.score for result in report.results]
        cell = {"split": "retrieval", "candidate": name, "retention": r, "phrase_recall": scores,
                "mean": sum(scores) / len(scores), "all_phrases": sum(s == 1.0 for s in scores),
                "seconds": time.perf_counter() - start}
        data["cells"][key] = cell
        write_json_atomic(args.out, data)
        log(f"{key}: phrase recall {cell['mean']:.2f}, all three phrases in {cell['all_phrases']}/{len(scores)} "
            f"({cell['seconds']:.0f} s)")
    return 0


def answer_prompts(tokenizer, length: int) -> list:
    """The --answer-kl prompts: the needle at two lengths x CALIBRATION_ANSWERS' depths, then the passkey ones."""
    from ripplekv_ext.eval.needle import make_needle
    from ripplekv_ext.eval.synthetic import even_depths, make_synthetic

    examples = make_needle(tokenizer, (length - 512, length), CALIBRATION_ANSWERS["needle_depths"])
    return examples + make_synthetic("passkey", tokenizer, length=length,
                                     num_examples=CALIBRATION_ANSWERS["passkey_examples"],
                                     seed=CALIBRATION_ANSWERS["passkey_seed"], depths=even_depths(8))


def answer_kl(model, tokenizer, policies, args, data, log) -> int:
    """Mean KL(Full || compressed) over Full's greedy answer (teacher-forced) per task, one cell per candidate."""
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.fidelity import SharedPrefill, kl_per_position
    from ripplekv_ext.policies import DEFAULT_WINDOW

    r = args.retrieval_retention
    shared = SharedPrefill(model, DEFAULT_WINDOW, r)
    prompts = []  # (task, prompt ids, Full's answer ids, Full's logits over it)
    start = time.perf_counter()
    for example in answer_prompts(tokenizer, args.answer_length):
        ids = torch.tensor([example.input_ids])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=min(example.max_new_tokens, ANSWER_TOKENS), do_sample=False)
        answer = out[:, ids.shape[1]:]
        prompts.append((example.task, ids, answer, shared.logits_fn(Policy.full())(ids, answer)))
    log(f"{len(prompts)} prompts prefilled and answered by Full in {time.perf_counter() - start:.0f} s")
    for name, make in policies.items():
        key = f"answers/{name}/{r:g}"
        if key in data["cells"]:
            continue
        start = time.perf_counter()
        logits_fn = shared.logits_fn(make(r))
        kl = {"needle": [], "passkey": []}
        for task, ids, answer, full in prompts:
            kl[task].append(kl_per_position(full, logits_fn(ids, answer)).mean().item())
        cell = {"split": "answers", "candidate": name, "retention": r,
                **{f"{task}_kl_per_example": values for task, values in kl.items()},
                **{f"{task}_kl": sum(values) / len(values) for task, values in kl.items()},
                "seconds": time.perf_counter() - start}
        data["cells"][key] = cell
        write_json_atomic(args.out, data)
        log(f"{key}: KL over Full's answers, needle {cell['needle_kl']:.4f}, passkey {cell['passkey_kl']:.4f} "
            f"({cell['seconds']:.0f} s)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.models import load_model, shipped_profile_path
    from ripplekv_ext.budgets.profile_file import load_profile

    # Options left at their defaults are not part of the settings, so a file written before they existed resumes.
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("out", "splits", "threads")
                and not (k in ("profile", "compare_profile", "only", "exponents") and v is None)
                and not (k in ("retrieval", "retrieval_retention") and not (args.retrieval or args.answer_kl))
                and not (k in ("answer_kl", "answer_length") and not args.answer_kl)}
    data = {"format": FORMAT, "settings": settings, "cells": {}}
    if args.out.exists():
        data = json.loads(args.out.read_text())
        if data.get("format") != FORMAT or data.get("settings") != settings:
            sys.exit(f"{args.out} holds a run with other settings; pass --out for a new file")
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    model, tokenizer, _ = load_model(args.model)
    profile = load_profile(args.profile or shipped_profile_path(args.model), model=model)
    other = None if args.compare_profile is None else load_profile(args.compare_profile, model=model)
    profile_tokens = max(p.calibration["num_examples"] * (p.calibration["prefix_len"] + p.calibration["cont_len"])
                         for p in (profile, other) if p is not None)
    compared = None if other is None else f"ripplekv+adaptive-recent ({args.compare_profile.stem})"
    policies = candidates(profile, args.fractions, None if other is None else (compared, other), args.exponents or [])
    if args.only:
        wanted = args.only.split(",")
        unknown = [name for name in wanted if name not in policies]
        if unknown:
            sys.exit(f"--only: unknown candidates {unknown}; known: {list(policies)}")
        policies = {name: policies[name] for name in wanted + ([compared] if compared else [])}
    if args.retrieval:
        return retrieval(model, tokenizer, policies, args, data, log)
    if args.answer_kl:
        return answer_kl(model, tokenizer, policies, args, data, log)
    for split in args.splits:
        source = SPLITS[split]
        skip = profile_tokens if source == "kjv:calibration" else 0  # the profile's own text is never scored
        scorer = Scorer(model, cut_examples(tokenizer, source, args, skip), args.prompt_len, min(args.retentions),
                        args.window)
        for name, make in policies.items():
            for r in args.retentions:
                key = f"{split}/{name}/{r:g}"
                if key in data["cells"]:
                    continue
                start = time.perf_counter()
                kl = scorer.kl_per_example(make(r))
                data["cells"][key] = {"split": split, "candidate": name, "retention": r, "kl_per_example": kl,
                                      "kl": sum(kl) / len(kl), "seconds": time.perf_counter() - start,
                                      "load_average": os.getloadavg()[0]}
                data["summary"] = summary(data["cells"], args.retentions)
                write_json_atomic(args.out, data)
                log(f"{key}: KL {sum(kl) / len(kl):.4f} ({time.perf_counter() - start:.0f} s, "
                    f"load {os.getloadavg()[0]:.1f})")
    for group, table in data.get("summary", {}).items():
        log(f"{group} ({', '.join(table['splits'])}; best published: {table['best_published']})")
        for row in table["rows"]:
            diff = row.get("vs_best_published", {}).get("mean_difference")
            log(f"  {row['candidate']:32s} {row['kl']:.4f}" + (f"  {diff:+.4f}" if diff is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
