"""What bounded (rolling) prefill costs in quality: one-shot compression against the same policy read in chunks.

For each model, domain and retention: the answer KL ``KL(P_full || P_method)`` over a ``--cont-len`` continuation
teacher-forced after a ``--prompt-len`` prompt (held-out windows of the KJV and of Paul Graham's essays), for
RippleKV one-shot, RippleKV rolling at each of ``--chunks`` (``Policy(..., prefill_chunk=C)``: every chunk attends to
the compressed cache of the chunks before it, each layer keeping its final budget from the first chunk on), and
SnapKV one-shot; with paired intervals (example by example) of each rolling run against one-shot RippleKV and
against one-shot SnapKV. At ``--task-retention`` (20%): passkey (filler haystack) and needle-in-a-haystack
accuracy, with Wilson intervals.

Every run is its own prefill (a rolling prefill cannot reuse another's). Results are written after every cell to
``--out`` (atomically) and a rerun with the same settings resumes. One thread (``--threads``).

    .venv/bin/python experiments/bounded_prefill_quality/e2e_bounded_prefill_quality.py --model smollm2 \
        --out experiments/bounded_prefill_quality/results/bounded_prefill_quality_smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

# bench/e2e_bench.py's machine_description: bench/ is a folder of scripts, not a package, so its folder goes on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from e2e_bench import machine_description  # noqa: E402
from ripplekv_ext import compress  # noqa: E402
from ripplekv_ext.jsonio import write_json_atomic  # noqa: E402
from ripplekv_ext.eval.fidelity import fidelity_examples, kl_per_position, paired_kl_comparison  # noqa: E402
from ripplekv_ext.eval.models import load_model, shipped_profile_path  # noqa: E402
from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402
from ripplekv_ext.methods import make_policy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="experiments/bounded_prefill_quality/e2e_bounded_prefill_quality.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or gemma3-270m")
    p.add_argument("--domains", default="kjv,essays")
    p.add_argument("--examples", type=int, default=8, help="windows per domain (default 8)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--cont-len", type=int, default=64)
    p.add_argument("--retentions", default="0.1,0.2,0.3")
    p.add_argument("--chunks", default="256,512,1024")
    p.add_argument("--task-retention", type=float, default=0.2)
    p.add_argument("--task-examples", type=int, default=10, help="passkey prompts (default 10)")
    p.add_argument("--no-tasks", action="store_true", help="answer KL only")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None,
                   help="default: experiments/bounded_prefill_quality/results/bounded_prefill_quality_MODEL.json")
    return p


def run_names(chunks) -> list[str]:
    return ["ripplekv", "snapkv"] + [f"ripplekv-rolling-{chunk}" for chunk in chunks]


def runs(profile, retention: float, chunks) -> dict:
    """run name -> policy at ``retention``."""
    ripplekv = make_policy("ripplekv", retention, profile)
    out = {"ripplekv": ripplekv, "snapkv": make_policy("snapkv", retention)}
    for chunk in chunks:
        out[f"ripplekv-rolling-{chunk}"] = dataclasses.replace(ripplekv, prefill_chunk=chunk)
    return out


@torch.inference_mode()
def continuation_logits(model, policy, prompt, continuation):
    """Logits ``[T, V]`` predicting each continuation token after ``prompt`` (read in the policy's chunks)."""
    context = compress(model, policy) if policy is not None else contextlib.nullcontext()
    with context as session:
        chunk = None if policy is None else policy.prefill_chunk
        n = prompt.shape[1]
        cache = None
        parts = [(0, n)] if chunk is None else [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
        with contextlib.nullcontext() if chunk is None else session.chunked_prefill(n):
            for start, end in parts:
                kwargs = {} if cache is None else {cache_argument(): cache}
                out = model(prompt[:, start:end], use_cache=True, logits_to_keep=1, **kwargs)
                cache = output_cache(out)
        logits = [out.logits[0, -1:].float()]
        logits.append(model(continuation[:, :-1], use_cache=True, **{cache_argument(): cache}).logits[0].float())
    return torch.cat(logits)


def kl_cells(model, tokenizer, profile, args, results, out) -> None:
    for domain in args.domains:
        windows = fidelity_examples(tokenizer, args.prompt_len, args.cont_len, args.examples,
                                    source=f"{domain}:evaluation")
        for index in range(args.examples):
            prompt = windows[index:index + 1, :args.prompt_len]
            continuation = windows[index:index + 1, args.prompt_len:]
            full = None
            for retention in args.retentions:
                for name, policy in runs(profile, retention, args.chunks).items():
                    cell = results["kl"].setdefault(f"{domain}/{name}@{retention:g}", {"policy": repr(policy),
                                                                                        "per_example": {}})
                    if str(index) in cell["per_example"]:
                        continue
                    if full is None:
                        full = continuation_logits(model, None, prompt, continuation)
                    start = time.perf_counter()
                    kl = kl_per_position(full, continuation_logits(model, policy, prompt, continuation)).mean().item()
                    cell["per_example"][str(index)] = kl
                    write_json_atomic(out, results)
                    print(f"{domain} example {index} {name}@{retention:g}: KL {kl:.4f} "
                          f"({time.perf_counter() - start:.0f}s)", flush=True)


def summarize_kl(results, args) -> dict:
    summary = {}
    for domain in args.domains:
        for retention in args.retentions:
            cells = {name: results["kl"].get(f"{domain}/{name}@{retention:g}", {}).get("per_example", {})
                     for name in run_names(args.chunks)}
            common = sorted(set.intersection(*(set(c) for c in cells.values())), key=int) if cells else []
            if not common:
                continue
            values = {name: [cells[name][i] for i in common] for name in cells}
            row = {name: sum(v) / len(v) for name, v in values.items()}
            for name in values:
                if name.startswith("ripplekv-rolling"):
                    for baseline in ("ripplekv", "snapkv"):
                        row[f"{name} vs {baseline}"] = paired_kl_comparison(values[name], values[baseline])
            summary[f"{domain}@{retention:g}"] = dict(row, examples=len(common))
    return summary


def task_cells(model, tokenizer, profile, args, results, out) -> None:
    from ripplekv_ext.eval.needle import make_needle
    from ripplekv_ext.eval.runner import evaluate, greedy_generate_fn
    from ripplekv_ext.eval.synthetic import even_depths, make_synthetic
    from ripplekv_ext.profiler.stats import wilson_interval

    tasks = {"passkey": make_synthetic("passkey", tokenizer, length=args.prompt_len, num_examples=args.task_examples,
                                       depths=even_depths(5)),
             "needle": make_needle(tokenizer)}
    policies = {"full": None, **runs(profile, args.task_retention, args.chunks)}
    for task, examples in tasks.items():
        for name, policy in policies.items():
            key = f"{task}/{name}"
            if key in results["tasks"]:
                continue
            start = time.perf_counter()
            compression = None if policy is None else (lambda p=policy: compress(model, p))
            report = evaluate(examples, greedy_generate_fn(model, tokenizer, compression), progress=False)
            scores = [r.score for r in report.results]
            found = int(round(sum(scores)))
            low, high = wilson_interval(found, len(scores), 0.95)
            results["tasks"][key] = {"found": found, "examples": len(scores), "wilson_low": low, "wilson_high": high,
                                     "scores": scores, "policy": repr(policy)}
            write_json_atomic(out, results)
            print(f"{task} {name}: {found}/{len(scores)} ({time.perf_counter() - start:.0f}s)", flush=True)


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.domains = [d for d in args.domains.split(",") if d]
    args.retentions = [float(r) for r in args.retentions.split(",") if r]
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    torch.set_num_threads(args.threads)
    from ripplekv_ext.budgets.profile_file import load_profile

    model, tokenizer, model_name = load_model(args.model)
    profile = load_profile(shipped_profile_path(args.model), model=model)
    out = Path(args.out or RESULTS / f"bounded_prefill_quality_{args.model}.json")
    settings = {k: getattr(args, k) for k in ("domains", "examples", "prompt_len", "cont_len", "retentions", "chunks",
                                              "task_retention", "task_examples")}
    results = {"figure": "bounded prefill quality", "model": model_name, "settings": settings,
               "profile": shipped_profile_path(args.model).name, "threads": args.threads,
               "machine": machine_description(), "kl": {}, "tasks": {}}
    if out.is_file():
        previous = json.loads(out.read_text())
        if previous.get("settings") == settings:
            results["kl"], results["tasks"] = previous.get("kl", {}), previous.get("tasks", {})
            print(f"resuming {out}", flush=True)
    kl_cells(model, tokenizer, profile, args, results, out)
    results["summary"] = summarize_kl(results, args)
    write_json_atomic(out, results)
    if not args.no_tasks:
        task_cells(model, tokenizer, profile, args, results, out)
    write_json_atomic(out, results)
    for key, row in results["summary"].items():
        shown = "  ".join(f"{name} {value:.4f}" for name, value in row.items() if isinstance(value, float))
        print(f"{key}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
