"""What a stable SmolLM2 profile costs, and which estimator buys stability cheapest.

    # 1. collect per-example, per-layer KLs of several estimator / P / T settings (resumable, 1 thread):
    .venv/bin/python experiments/profiling/profile_cost.py sweep --runs fisher:1024:64:12 fisher:256:64:20 \
        fisher:256:128:14 perturb:256:64:6 antithetic:256:64:2
    # 2. tables from what was collected (no model runs): stability, agreement with today's 16-example
    #    profile and the diagnostic's damage, for each setting at every example count, with its token cost:
    .venv/bin/python experiments/profiling/profile_cost.py analyze
    # 3. the cost model checked against timed profiles on two model sizes, and batched vs one-at-a-time:
    .venv/bin/python experiments/profiling/profile_cost.py cost
    # 4. the formula projected to Llama-3.1-8B / 70B on one H200 (a stated projection, no runs):
    .venv/bin/python experiments/profiling/profile_cost.py project

Run kinds in `sweep`: `perturb:P:T:N` is the profiler's estimator (hidden-state reuse, one draw; per-layer KLs
are saved for every T' in {16, 32, T} from the same run, since continuation position t sees only tokens up to
t); `antithetic:P:T:N` adds the negated draw of the same noise; `fisher:P:T:N` is `estimator="fisher"`.
Everything runs with 1 thread; results go to experiments/profiling/results/profile_sweep.json after every example.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.profiler.stats import spearman, split_half_spearman

RESULTS = Path(__file__).resolve().parent / "results"
SWEEP = RESULTS / "profile_sweep.json"
# today's 16-example profile (P=1024, T=64): the profiling-cost figure of bench/e2e_bench.py
REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "results" / "e2e_profile.json"
DIAGNOSTIC = RESULTS / "smollm2_diagnostic_P1024_T64_n8.json"  # isolated damage per layer at r = 0.1, 0.2, 0.3
SUB_T = (16, 32)
SIGMA, SEED = 0.1, 0


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _parse_run(spec: str):
    kind, p, t, n = spec.split(":")
    if kind not in ("perturb", "antithetic", "fisher"):
        raise ValueError(f"run kind must be perturb, antithetic or fisher, got {kind!r} in {spec!r}")
    return kind, int(p), int(t), int(n)


def _perturbation_rows(model, ids, prefix_len, layers, example, signs, batch_rows):
    """[layers, signs, T] per-position KLs, batched as the profiler's batch_rows does."""
    from ripplekv_ext.profiler import ContinuationRunner, perturber

    with torch.inference_mode():
        runner = ContinuationRunner(model, ids, prefix_len)
        runs = [(l, perturber("values", SIGMA, SEED, example, l, 0, s)) for l in layers for s in signs]
        kls = torch.cat([runner.kl_rows(runs[i:i + batch_rows]) for i in range(0, len(runs), batch_rows)])
    return kls.view(len(layers), len(signs), -1)


def sweep(args) -> None:
    from ripplekv_ext.eval.corpus import kjv_text, token_examples
    from ripplekv_ext.eval.models import load_smollm2
    from ripplekv_ext.profiler import fisher_example

    model, tokenizer = load_smollm2()
    layers = list(range(model.config.num_hidden_layers))
    data = _load(SWEEP) or {"model": "SmolLM2-135M-Instruct fp32", "sigma": SIGMA, "seed": SEED,
                            "source": "kjv:calibration", "threads": 1, "runs": {}}
    for spec in args.runs:
        kind, p, t, n = _parse_run(spec)
        key = f"{kind}/P{p}/T{t}"
        run = data["runs"].setdefault(key, {"per_example": {}, "seconds": [], "load": []})
        examples = token_examples(tokenizer, [kjv_text("calibration")], p, t, n)
        for e in range(len(run["seconds"]), n):
            start = time.perf_counter()
            if kind == "fisher":
                values = fisher_example(model, examples[e], p, layers, sigma=SIGMA, seed=SEED, samples=1,
                                        target="values", example_index=e)
                run["per_example"].setdefault(str(t), []).append(values)
            else:
                signs = (1.0, -1.0) if kind == "antithetic" else (1.0,)
                per_sign = _perturbation_rows(model, examples[e], p, layers, e, signs, args.batch_rows)
                kls = per_sign.mean(1)
                for sub in (*[s for s in SUB_T if s < t], t):
                    run["per_example"].setdefault(str(sub), []).append(kls[:, :sub].mean(1).tolist())
                if kind == "antithetic":  # also the + draw alone (the plain estimator), to compare with the pair
                    run["per_example"].setdefault(f"{t}+", []).append(per_sign[:, 0].mean(1).tolist())
            run["seconds"].append(time.perf_counter() - start)
            run["load"].append(os.getloadavg()[0])
            write_json_atomic(SWEEP, data)
            print(f"{key}: example {e + 1}/{n} in {run['seconds'][-1]:.1f} s (load {run['load'][-1]:.1f})",
                  file=sys.stderr)


# ---- analysis (no model runs) ---------------------------------------------------------------------------

def tokens_per_example(kind: str, p: int, t: int, num_layers: int = 30, draws: int = 1) -> float:
    """The profiler's own count (profiler.tokens_processed) for one example of all `num_layers` layers."""
    from ripplekv_ext.profiler import tokens_processed

    return tokens_processed(1, p, t, list(range(num_layers)), draws, num_layers, [kind != "fisher"],
                            estimator="fisher" if kind == "fisher" else "perturbation",
                            antithetic=kind == "antithetic")


def diagnostic_spearman(sensitivity) -> float:
    """Mean |Spearman| of `sensitivity` with the stored isolated damage at each retention (the diagnostic's
    summary number, recomputed for another profile without rerunning the damage)."""
    diag = _load(DIAGNOSTIC)
    return float(np.mean([abs(spearman(sensitivity, r["damage"])) for r in diag["retentions"].values()]))


def analyze(args) -> dict:
    data = _load(SWEEP)
    reference = _load(REFERENCE)["figures"]["profile"]["sensitivity"]
    table = {"reference": "e2e_profile.json: 16 examples, P=1024, T=64, perturbation",
             "reference_diagnostic_spearman": diagnostic_spearman(reference), "rows": []}
    for key, run in data.get("runs", {}).items():
        kind, p, _ = key.split("/")
        for t_key, rows in run["per_example"].items():
            t = int(t_key.rstrip("+"))
            label_kind = "perturb" if t_key.endswith("+") else kind
            for n in range(2, len(rows) + 1):
                mean = np.mean(rows[:n], axis=0).tolist()
                table["rows"].append({
                    "estimator": label_kind, "P": int(p[1:]), "T": t, "examples": n,
                    "tokens": int(n * tokens_per_example(label_kind, int(p[1:]), t)),
                    "split_half": split_half_spearman(rows[:n]), "vs_reference": spearman(mean, reference),
                    "diagnostic": diagnostic_spearman(mean)})
    write_json_atomic(RESULTS / "profile_stability.json", table)
    budget = args.tokens
    print(f"reference diagnostic Spearman (16-example profile): {table['reference_diagnostic_spearman']:.3f}")
    print(f"{'estimator':>10} {'P':>5} {'T':>3} {'n':>3} {'tokens':>7} {'split':>6} {'vs16':>6} {'diag':>6}")
    for r in table["rows"]:
        if r["tokens"] <= budget or args.all:
            print(f"{r['estimator']:>10} {r['P']:>5} {r['T']:>3} {r['examples']:>3} {r['tokens']:>7} "
                  f"{r['split_half'] or float('nan'):6.3f} {r['vs_reference']:6.3f} {r['diagnostic']:6.3f}")
    return table


# ---- the cost model, checked against timed profiles ---------------------------------------------------

COST = RESULTS / "profile_cost.json"


def cost(args) -> None:
    """Timed profiles of SmolLM2 (30 layers) and of a random Llama with SmolLM2's widths and fewer layers, each
    estimator at the same P, T and examples: tokens (the profiler's count) and seconds, so the measured seconds per
    token can be compared across estimators (one model) and with the model's size (two models)."""
    from ripplekv_ext.eval.corpus import kjv_text, token_examples
    from ripplekv_ext.eval.models import load_smollm2
    from ripplekv_ext.profiler import profile_model

    smollm2, tokenizer = load_smollm2()
    small_config = copy.deepcopy(smollm2.config)
    small_config.num_hidden_layers = args.small_layers
    torch.manual_seed(0)
    small = type(smollm2)(small_config).eval()
    examples = token_examples(tokenizer, [kjv_text("calibration")], args.prefix_len, args.cont_len, args.examples)
    data = _load(COST) or {"prefix_len": args.prefix_len, "cont_len": args.cont_len, "examples": args.examples,
                           "threads": 1, "runs": {}}
    variants = {"perturbation": {}, "perturbation, batched": {"batch_rows": 32}, "fisher": {"estimator": "fisher"}}
    for model_name, model in (("SmolLM2-135M (30 layers)", smollm2),
                              (f"random Llama, SmolLM2 widths ({args.small_layers} layers)", small)):
        params = sum(p.numel() for p in model.parameters())
        for variant, kwargs in variants.items():
            key = f"{model_name} / {variant}"
            if key in data["runs"]:
                continue
            load = os.getloadavg()[0]
            prof = profile_model(model, examples=examples, prefix_len=args.prefix_len, cont_len=args.cont_len,
                                 num_examples=args.examples, progress=False, **kwargs)
            data["runs"][key] = {"model": model_name, "variant": variant, "layers": len(prof.layers),
                                 "parameters": params, "tokens": prof.cost["tokens_processed"],
                                 "seconds": prof.cost["seconds"], "load_before": load,
                                 "load_after": os.getloadavg()[0]}
            write_json_atomic(COST, data)
            run = data["runs"][key]
            print(f"{key}: {run['tokens']} tokens, {run['seconds']:.1f} s, "
                  f"{1e3 * run['seconds'] / run['tokens']:.2f} ms/token (load {load:.1f})", file=sys.stderr)


# ---- projection to large models (a stated projection, not a measurement) ---------------------------------

# name: (layers, parameters, bytes per weight). FLOPs per token ~ 2 * parameters (attention over P <= 1024 tokens
# adds < 2% at these widths).
LARGE_MODELS = {"Llama-3.1-8B bf16": (32, 8.0e9, 2), "Llama-3.1-70B fp8": (80, 70.6e9, 1),
                "Llama-3.1-70B bf16, offloaded": (80, 70.6e9, 2)}
# One H200 (H100: same compute, 3.35 TB/s): dense bf16 989 TFLOP/s (fp8 2x) at an assumed 50% sustained; HBM
# 4.8 TB/s at 80%; weights streamed from host memory over PCIe 5 at an assumed 25 GB/s when offloaded.
GPU = {"flops": 0.5 * 989e12, "hbm": 0.8 * 4.8e12, "pcie": 25e9}


def passes_per_example(kind: str, layers: int, draws: int = 1, batch_rows: int = 1) -> float:
    """Whole-model weight reads per example: prefix + reference, then each perturbed continuation reads the layers
    from its own on ((L - l) / L of the weights, with reuse), batched rows share one read of the deepest span;
    Fisher reads the weights once forward and about twice backward."""
    if kind == "fisher":
        return 2 + 2 * draws
    spans = [(layers - l) / layers for l in range(layers)] * draws
    if batch_rows > 1:  # each batch reads from its shallowest row's layer on
        spans = [max(spans[i:i + batch_rows]) for i in range(0, len(spans), batch_rows)]
    return 2 + sum(spans)


def project(args) -> dict:
    rows = []
    for name, (layers, params, bytes_per_weight) in LARGE_MODELS.items():
        offloaded = "offloaded" in name
        flops = GPU["flops"] * (2 if bytes_per_weight == 1 else 1)
        for label, kind, p, t, n, batch in (("plain (P=1024, T=64, 13 ex)", "perturb", 1024, 64, 13, 1),
                                            ("plain, batched rows (32)", "perturb", 1024, 64, 13, 32),
                                            ("fast: Fisher (P=256, T=64, 20 ex)", "fisher", 256, 64, 20, 1)):
            tokens = n * tokens_per_example(kind, p, t, layers)
            compute_s = tokens * 2 * params / flops
            read_s = n * passes_per_example(kind, layers, batch_rows=batch) * params * bytes_per_weight / (
                GPU["pcie"] if offloaded else GPU["hbm"])
            rows.append({"model": name, "profile": label, "tokens": int(tokens), "compute_s": compute_s,
                         "weight_read_s": read_s, "projected_s": compute_s + read_s})
    print(f"{'model':<30} {'profile':<34} {'tokens':>7} {'compute s':>9} {'weights s':>9} {'total s':>8}")
    for r in rows:
        print(f"{r['model']:<30} {r['profile']:<34} {r['tokens']:>7} {r['compute_s']:9.1f} {r['weight_read_s']:9.1f} "
              f"{r['projected_s']:8.1f}")
    data = _load(COST)
    data["projection"] = {"assumptions": {"gpu": "one H200", **GPU, "flops_per_token": "2 * parameters"},
                          "rows": rows}
    write_json_atomic(COST, data)
    return data


def main(argv=None) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("sweep", help="collect per-example KLs of several settings (resumable)")
    p.add_argument("--runs", nargs="+", required=True, help="kind:P:T:N, kind in perturb, antithetic, fisher")
    p.add_argument("--batch-rows", type=int, default=30, help="perturbed rows per batched continuation")
    p.set_defaults(func=sweep)
    p = sub.add_parser("analyze", help="stability / agreement tables from the sweep (no model runs)")
    p.add_argument("--tokens", type=int, default=9000, help="show settings within this token budget")
    p.add_argument("--all", action="store_true", help="show every example count")
    p.set_defaults(func=analyze)
    p = sub.add_parser("cost", help="timed profiles of two model sizes and each estimator (resumable)")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--cont-len", type=int, default=64)
    p.add_argument("--examples", type=int, default=2)
    p.add_argument("--small-layers", type=int, default=8, help="layers of the smaller random model")
    p.set_defaults(func=cost)
    p = sub.add_parser("project", help="projected profiling time of Llama-3.1-8B / 70B on one H200 (no runs)")
    p.set_defaults(func=project)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
