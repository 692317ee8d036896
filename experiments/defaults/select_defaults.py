"""Choose RippleKV's defaults from data: the ratio R, the normalisation, the profile's target and sigma.

Every candidate is scored by fidelity: the mean KL(Full || compressed) over a teacher-forced continuation of
``--cont-len`` tokens after ``--prompt-len``-token prompts, at ``--retention`` (SnapKV selection in every layer,
RippleKV budgets; lower is better). Candidates are *selected* on calibration text (the KJV calibration split,
from windows after those the profiles were measured on) and *confirmed* on held-out text (the evaluation split,
books the profiles never saw).

Two stages, each candidate a cell of ``--out`` written atomically as soon as it is measured, so an interrupted
run resumes where it stopped (a file written with other settings is refused, not overwritten):

* ``allocation``: R in ``--ratios`` x normalisation in ``--normalizations``, on the profile that ships with the
  package (cheap: one compressed prefill per candidate and example), plus uniform SnapKV as the baseline.
* ``profile``: new profiles (``--targets`` at sigma 0.1, ``--sigmas`` at target values), measured small
  (``--profile-prefix-len``/``--profile-cont-len``/``--profile-examples``, so they compare with each other, not
  with the shipped profile's larger run), each scored with RippleKV at the library's default R and normalisation.
  Profiles are cached under ``$RIPPLEKV_CACHE_DIR/select_defaults/`` and resume too.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/defaults/select_defaults.py --examples 3 --profile-examples 3

Runs with one thread (the machine is shared); the results file records the load average at each cell.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from ripplekv_ext import compress
from ripplekv_ext.budgets import allocators
from ripplekv_ext.policies import DEFAULT_WINDOW, Policy

RESULTS = Path(__file__).resolve().parent / "results" / "select_defaults.json"
FORMAT = "ripplekv-select-defaults"
SPLITS = {"select": "kjv:calibration", "confirm": "kjv:evaluation"}
BASELINE_TARGET, BASELINE_SIGMA = "values", 0.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=3, help="prompts per split (default 3)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--cont-len", type=int, default=32)
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--ratios", default="1.25,1.5,1.75,2.0")
    p.add_argument("--normalizations", default="zscore,minmax")
    p.add_argument("--targets", default="values,keys,both")
    p.add_argument("--sigmas", default="0.05,0.1,0.3")
    p.add_argument("--profile-prefix-len", type=int, default=512)
    p.add_argument("--profile-cont-len", type=int, default=32)
    p.add_argument("--profile-examples", type=int, default=3)
    p.add_argument("--stages", default="allocation,profile")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for name in ("examples", "prompt_len", "cont_len", "window", "profile_prefix_len", "profile_cont_len",
                 "profile_examples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.retention <= 1.0:
        p.error(f"--retention must be in (0, 1], got {args.retention}")
    try:
        args.ratios = [float(x) for x in args.ratios.split(",")]
        args.sigmas = [float(x) for x in args.sigmas.split(",")]
    except ValueError:
        p.error("--ratios and --sigmas take comma-separated numbers, e.g. 1.25,1.5")
    args.normalizations = args.normalizations.split(",")
    args.targets = args.targets.split(",")
    args.stages = args.stages.split(",")
    for stage in args.stages:
        if stage not in ("allocation", "profile"):
            p.error(f"--stages takes allocation and/or profile, got {stage!r}")
    return args


def load_results(path: Path, settings: dict) -> dict:
    if not path.exists():
        return {"format": FORMAT, "settings": settings, "cells": {}, "profiles": {}}
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT or data.get("settings") != settings:
        sys.exit(f"{path} holds a run with other settings ({data.get('settings')}); pass --out for a new file")
    return data


def cut_examples(tokenizer, source: str, args, skip_tokens: int) -> torch.Tensor:
    """``args.examples`` windows of ``source``, after the first ``skip_tokens`` tokens (the profiles' text)."""
    from ripplekv_ext.eval.corpus import load_texts, token_examples

    length = args.prompt_len + args.cont_len
    skip = math.ceil(skip_tokens / length)
    texts, _ = load_texts(source)
    return token_examples(tokenizer, texts, args.prompt_len, args.cont_len, skip + args.examples)[skip:]


class Scorer:
    """KL of a policy against Full on fixed examples, each example's prompt read once
    (``ripplekv_ext.eval.fidelity.SharedPrefill``); ``check_against_hook`` confirms the shortcut gives what plain
    runs give."""

    def __init__(self, model, examples: torch.Tensor, prompt_len: int, retention: float, window: int):
        from ripplekv_ext.eval.fidelity import SharedPrefill

        self.model, self.examples, self.prompt_len = model, examples, prompt_len
        self.shared = SharedPrefill(model, window, retention)
        self._full = [None] * len(examples)

    def _split(self, i):
        row = self.examples[i:i + 1]
        return row[:, :self.prompt_len], row[:, self.prompt_len:]

    def full_logits(self, i: int) -> torch.Tensor:
        if self._full[i] is None:
            self._full[i] = self.compressed_logits(i, Policy.full())
        return self._full[i]

    def compressed_logits(self, i: int, policy: Policy) -> torch.Tensor:
        return self.shared.logits_fn(policy)(*self._split(i))

    def kl_per_example(self, policy: Policy) -> list[float]:
        from ripplekv_ext.eval.fidelity import kl_per_position

        return [kl_per_position(self.full_logits(i), self.compressed_logits(i, policy)).mean().item()
                for i in range(len(self.examples))]

    def check_against_hook(self, policy: Policy, i: int = 0) -> dict:
        """Largest |logit| differences between this shortcut and plain runs (Full, and compressed by ``policy``)."""
        from ripplekv_ext.eval.fidelity import continuation_logits_fn

        split = self._split(i)
        hook = continuation_logits_fn(self.model, lambda: compress(self.model, policy))(*split)
        full = continuation_logits_fn(self.model)(*split)
        return {"full": float((full - self.full_logits(i)).abs().max()),
                "compressed": float((hook - self.compressed_logits(i, policy)).abs().max())}


def default_ratio_and_normalize() -> tuple[float, str]:
    """The library's current defaults (read from the allocator's signature, so this report follows them)."""
    import inspect

    params = inspect.signature(allocators.ripplekv_weights).parameters
    return params["ratio"].default, params["normalize"].default


def candidates(args, shipped, profiles: dict):
    """(stage, name, policy factory) for every candidate; factories build the policy only when needed."""
    yield "allocation", "snapkv", lambda: Policy.snapkv(args.retention, args.window)
    for ratio in args.ratios:
        for norm in args.normalizations:
            yield ("allocation", f"ripplekv R={ratio:g} {norm}",
                   lambda r=ratio, n=norm: Policy.ripplekv(shipped, args.retention, args.window, ratio=r, normalize=n))
    ratio, norm = default_ratio_and_normalize()
    for name, sensitivity in profiles.items():
        yield ("profile", f"ripplekv {name}",
               lambda s=sensitivity: Policy.ripplekv(s, args.retention, args.window, ratio=ratio, normalize=norm))


def profile_variants(args) -> list[tuple[str, float]]:
    """(target, sigma) pairs: every target at the baseline sigma, every sigma at the baseline target."""
    pairs = [(t, BASELINE_SIGMA) for t in args.targets] + [(BASELINE_TARGET, s) for s in args.sigmas]
    return list(dict.fromkeys(pairs))


def measure_profile(model, tokenizer, target: str, sigma: float, args, log) -> dict:
    from ripplekv_ext.eval.corpus import calibration_examples
    from ripplekv_ext.eval.models import cache_dir
    from ripplekv_ext.profiler import profile_model

    name = (f"{target}_s{sigma:g}_P{args.profile_prefix_len}_T{args.profile_cont_len}"
            f"_n{args.profile_examples}")
    start = time.perf_counter()
    examples, source = calibration_examples(tokenizer, "kjv:calibration", args.profile_prefix_len,
                                            args.profile_cont_len, args.profile_examples)
    profile = profile_model(model, examples=examples, source=source, prefix_len=args.profile_prefix_len,
                            cont_len=args.profile_cont_len, num_examples=args.profile_examples, sigma=sigma,
                            target=target, out_path=cache_dir() / "select_defaults" / f"{name}.json",
                            progress=False)
    log(f"profile target={target} sigma={sigma:g}: {time.perf_counter() - start:.0f} s this run, "
        f"split-half spearman {profile.stability.get('split_half_spearman')}")
    return {"target": target, "sigma": sigma, "layers": profile.layers, "sensitivity": profile.sensitivity,
            "split_half_spearman": profile.stability.get("split_half_spearman"),
            "seconds": profile.cost.get("seconds")}


def summary(cells: dict) -> list[dict]:
    """Per candidate and split: mean KL, its rank (1 = lowest), and the per-example comparison with the library's
    current default (``ripplekv R=<default> <normalisation>`` on the shipped profile): wins out of the examples and
    the mean KL difference with a paired bootstrap interval (negative: the candidate is better)."""
    from ripplekv_ext.eval.fidelity import paired_kl_comparison

    ratio, norm = default_ratio_and_normalize()
    default = f"ripplekv R={ratio:g} {norm}"
    rows = []
    for name in sorted({c["candidate"] for c in cells.values()}):
        row = {"candidate": name}
        for split in SPLITS:
            cell, base = cells.get(f"{split}/{name}"), cells.get(f"{split}/{default}")
            if cell:
                row[split] = cell["kl"]
                if base and name != default:
                    comparison = paired_kl_comparison(cell["kl_per_example"], base["kl_per_example"])
                    # JSON has no NaN: the interval of a single example is null.
                    row[f"{split}_vs_default"] = {k: None if isinstance(v, float) and math.isnan(v) else v
                                                  for k, v in comparison.items()}
        rows.append(row)
    for split in SPLITS:
        for rank, r in enumerate(sorted((r for r in rows if split in r), key=lambda r: r[split]), 1):
            r[f"{split}_rank"] = rank
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from ripplekv_ext.eval.models import load_smollm2, shipped_profile_path
    from ripplekv_ext.budgets.profile_file import load_profile
    from ripplekv_ext.jsonio import write_json_atomic

    settings = {k: v for k, v in vars(args).items() if k not in ("out", "stages")}
    data = load_results(args.out, settings)
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    model, tokenizer = load_smollm2()
    shipped_path = shipped_profile_path("smollm2")
    shipped = load_profile(shipped_path, model=model)
    data["shipped_profile"] = {"file": shipped_path.name, **shipped.method, **shipped.calibration}
    data["defaults_when_run"] = dict(zip(("ratio", "normalize"), default_ratio_and_normalize()))
    # Calibration prompts start after every token a profile was measured on.
    profile_tokens = max(shipped.calibration["num_examples"] * (shipped.calibration["prefix_len"]
                                                                 + shipped.calibration["cont_len"]),
                         args.profile_examples * (args.profile_prefix_len + args.profile_cont_len))
    scorers = {split: Scorer(model, cut_examples(tokenizer, source, args, profile_tokens if split == "select" else 0),
                             args.prompt_len, args.retention, args.window)
               for split, source in SPLITS.items()}
    if "shortcut_check" not in data:
        # The shortcut must give what plain runs give; a difference beyond float noise would void every cell.
        check = scorers["select"].check_against_hook(Policy.ripplekv(shipped, args.retention, args.window))
        log(f"one-prefill shortcut vs plain runs, max |logit difference|: {check}")
        if max(check.values()) > 1e-3:
            sys.exit("the one-prefill shortcut does not reproduce plain runs; not measuring")
        data["shortcut_check"] = {"max_abs_logit_difference": check, "example": "select 0",
                                  "policy": "ripplekv, default R and normalisation"}

    def save():
        data["summary"] = summary(data["cells"])
        write_json_atomic(args.out, data)

    def run_cells(stage: str):
        for cand_stage, name, make_policy in candidates(args, shipped, {
                k: v["sensitivity"] for k, v in data["profiles"].items()}):
            for split in SPLITS:
                key = f"{split}/{name}"
                if cand_stage != stage or key in data["cells"]:
                    continue
                start = time.perf_counter()
                kl = scorers[split].kl_per_example(make_policy())
                data["cells"][key] = {"candidate": name, "split": split, "kl_per_example": kl,
                                      "kl": sum(kl) / len(kl), "seconds": time.perf_counter() - start,
                                      "load_average": os.getloadavg()[0]}
                save()
                log(f"{key}: KL {sum(kl) / len(kl):.4f} ({time.perf_counter() - start:.0f} s, "
                    f"load {os.getloadavg()[0]:.1f})")

    if "allocation" in args.stages:
        run_cells("allocation")
    if "profile" in args.stages:
        for target, sigma in profile_variants(args):
            name = f"target={target} sigma={sigma:g}"
            if name not in data["profiles"]:
                data["profiles"][name] = measure_profile(model, tokenizer, target, sigma, args, log)
                save()
            run_cells("profile")  # score each profile as soon as it exists
    save()
    for row in data["summary"]:
        log(f"{row['candidate']:34s} " + "  ".join(
            f"{split} {row[split]:.4f} (#{row[split + '_rank']}"
            + (f", {row[split + '_vs_default']['mean_difference']:+.4f} vs default" if split + "_vs_default" in row
               else "") + ")" for split in SPLITS if split in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
