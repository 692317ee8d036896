"""End-to-end benchmarks on a real model: profiling cost, compression overhead, memory, decode speed, a peer.

Every figure is measured side by side in one run and reported as a ratio to its baseline in the same run
(prefill with compression / prefill without, cache bytes / full cache bytes, compressed decode tokens/s / Full
decode tokens/s), because absolute seconds on a shared machine mean little. Each ``measure_*`` function returns
a plain dict (``e2e_measure.py``: profile, overhead, memory, decode; ``e2e_peer.py``: the kvpress peer); ``main``
runs the chosen figures, prints tables and writes them all to one JSON file (atomically).

    .venv/bin/python bench/e2e_bench.py --quick                    # every figure at 512/1K tokens, ~1-2 min
    .venv/bin/python bench/e2e_bench.py --figures overhead memory  # the full sizes (2K and 8K tokens)
    .venv/bin/python bench/e2e_bench.py --figures decode --out bench/results/e2e_decode.json

This is the benchmark harness of the source checkout, not part of the installed package: it measures the library
through its public API only (``ripplekv_ext.compress(..., on_compress=...)`` times the compression step).

Prompts are windows of the evaluation split of the bundled King James Bible (never the calibration text the
profiler reads); the model is SmolLM2-135M-Instruct unless ``--model`` names a local transformers folder.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import torch

from e2e_measure import (COMPRESSED_METHODS, measure_decode, measure_memory, measure_overhead,
                         measure_profile_cost)
from e2e_batch import measure_batch, print_batch_table
from e2e_paths import portable_path
from e2e_peer import measure_peer
from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.cli.common import CliError, check_model_arg, check_output_file
from ripplekv_ext.cli.parser import OneLineErrorParser, one_retention, positive_int
from ripplekv_ext.eval.models import DEFAULT_MODEL, default_profile_path, load_model, shipped_profile_path

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # this harness lives in bench/ of a source checkout
FIGURES = ("profile", "overhead", "memory", "decode", "peer", "batch")


# ---- command line ------------------------------------------------------------------------------------------

def find_profile(model, explicit: Optional[str] = None):
    """The RippleKV profile to use: ``explicit``, else the CLI's default location, else the SmolLM2 profile that
    ships with the package, else a measured SmolLM2 profile in bench/results; None when there is none."""
    from ripplekv_ext.budgets.profile_file import load_profile

    if explicit:
        return load_profile(explicit, model=model), portable_path(explicit)
    candidates = [default_profile_path(DEFAULT_MODEL), shipped_profile_path(DEFAULT_MODEL)]
    candidates += sorted(p for p in RESULTS_DIR.glob("smollm2_profile*.json") if not p.name.endswith(".partial.json"))
    for path in candidates:
        if path is not None and Path(path).is_file():
            try:
                return load_profile(path, model=model), portable_path(path)
            except ValueError:
                continue  # made for another model or unreadable: try the next one
    return None, None


def machine_description() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": "cpu"}
    try:
        info["load_average_at_start"] = list(os.getloadavg())
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def method_name(text: str) -> str:
    from ripplekv_ext.methods import check_method

    try:
        return check_method(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:  # the first token comes out of the prefill: one more is the least that times a decode step
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return value


def check_args(args) -> None:
    """What can be wrong with the request, checked before the model loads (a minute for SmolLM2)."""
    check_model_arg(args.model)
    if args.profile and not Path(args.profile).expanduser().is_file():
        raise CliError(f"--profile {args.profile} is not a file; omit it to use the default profile")
    check_output_file("--out", args.out)


def build_parser() -> argparse.ArgumentParser:
    # Types validate every value as it is parsed: a bad one is one line and exit 2, before the model loads.
    p = OneLineErrorParser(prog="bench/e2e_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES[:4]),
                   help="which figures to measure (default: all but the optional peer)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes (512/1K-token prompts, P=256 T=32 profiles): about a minute per figure")
    p.add_argument("--model", default="smollm2", help="'smollm2' (bundled) or a local transformers folder")
    p.add_argument("--profile", default=None, help="RippleKV profile JSON (default: the CLI's default location, "
                   "then bench/results; without one, the profile figure's measurement or a small fresh one)")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                   help="prompt lengths for overhead (2048 8192)")
    p.add_argument("--tokens", type=positive_int, default=None, help="prompt length for memory, decode, peer (8192)")
    p.add_argument("--retention", type=one_retention, default=0.2, help="retention for overhead, decode and peer")
    p.add_argument("--retentions", type=one_retention, nargs="+", default=[0.1, 0.2, 0.5],
                   help="retentions for memory")
    p.add_argument("--methods", type=method_name, nargs="+", default=list(COMPRESSED_METHODS))
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds of the overhead measurement")
    p.add_argument("--new-tokens", type=at_least_two, default=64, help="generated tokens for decode")
    p.add_argument("--prefix-len", type=positive_int, default=None, help="profile figure: P (1024)")
    p.add_argument("--cont-len", type=positive_int, default=None, help="profile figure: T (64)")
    p.add_argument("--max-examples", type=positive_int, default=None, help="profile figure: examples (16)")
    p.add_argument("--peer-examples", type=positive_int, default=2, help="peer figure: examples for the KL")
    p.add_argument("--peer-pooling", choices=("avg", "max"), default="avg",
                   help="peer figure: our SnapKV pooling (avg, kvpress's setting; max, our default)")
    p.add_argument("--peer-step-rounds", type=positive_int, default=7,
                   help="peer figure: rounds of alternately replayed compression steps for the speed ratio")
    p.add_argument("--peer-python", default=None, help="peer figure: a Python that imports kvpress (default: "
                   ".venv-peer/bin/python from `make peer-env`)")
    p.add_argument("--batch-prompts", type=positive_int, default=8, help="batch figure: prompts in the batch")
    p.add_argument("--batch-tokens", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="batch figure: prompt lengths, spread from MIN to MAX (1024 2048)")
    p.add_argument("--batch-methods", type=method_name, nargs="+", default=["ripplekv"],
                   help="batch figure: methods compressed batched and one prompt at a time")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="bench/results/e2e.json", help="JSON output (written atomically)")
    return p


def _sizes(args):
    quick = args.quick
    return {"lengths": args.lengths or ([512, 1024] if quick else [2048, 8192]),
            "tokens": args.tokens or (1024 if quick else 8192),
            "prefix_len": args.prefix_len or (256 if quick else 1024),
            "cont_len": args.cont_len or (32 if quick else 64),
            "max_examples": args.max_examples or (6 if quick else 16),
            "batch_tokens": args.batch_tokens or ([256, 512] if quick else [1024, 2048])}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except CliError as err:
        print(f"bench/e2e_bench.py: error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = _sizes(args)
    model, tokenizer, model_name = load_model(args.model)
    dtype = next(model.parameters()).dtype
    results = {"model": model_name, "dtype": str(dtype).replace("torch.", ""), "machine": machine_description(),
               "sizes": sizes, "argv": list(sys.argv[1:] if argv is None else argv), "figures": {}}
    profile, profile_source = find_profile(model, args.profile)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if "profile" in args.figures:
        log(f"profile cost: P={sizes['prefix_len']} T={sizes['cont_len']}, up to {sizes['max_examples']} examples")
        fig = measure_profile_cost(model, tokenizer, sizes["prefix_len"], sizes["cont_len"], sizes["max_examples"],
                                   progress=True)
        results["figures"]["profile"] = fig
        if profile is None:
            profile, profile_source = fig["sensitivity"], "measured by this run's profile figure"
    needs_profile = (any(f in args.figures for f in ("overhead", "memory", "decode")) and \
        any(m.split("+")[0] == "ripplekv" for m in args.methods)) or \
        ("batch" in args.figures and any(m.split("+")[0] == "ripplekv" for m in args.batch_methods))
    if needs_profile and profile is None:
        log("no RippleKV profile found: measuring a small one (P=256, T=16, 4 examples)")
        profile = measure_profile_cost(model, tokenizer, 256, 16, 4)["sensitivity"]
        profile_source = "measured by this run (P=256, T=16, 4 examples)"
    results["profile_source"] = profile_source
    if "overhead" in args.figures:
        log(f"overhead: prefill with/without compression at {sizes['lengths']} tokens, {args.repeats} rounds")
        results["figures"]["overhead"] = measure_overhead(model, tokenizer, sizes["lengths"], args.methods,
                                                          args.retention, profile, args.repeats)
    if "memory" in args.figures:
        log(f"memory: cache bytes and peak RSS at {sizes['tokens']} tokens")
        results["figures"]["memory"] = measure_memory(model, tokenizer, sizes["tokens"], args.methods,
                                                      args.retentions, profile)
    if "decode" in args.figures:
        log(f"decode: {args.new_tokens} tokens after {sizes['tokens']} tokens")
        results["figures"]["decode"] = measure_decode(model, tokenizer, sizes["tokens"], args.new_tokens,
                                                      args.retention, args.methods, profile)
    if "peer" in args.figures:
        log(f"peer: ours vs kvpress at {sizes['tokens']} tokens")
        from ripplekv_ext.eval.models import smollm2_folder

        model_dir = smollm2_folder() if args.model == "smollm2" else args.model
        results["figures"]["peer"] = measure_peer(model, tokenizer, model_dir, sizes["tokens"],
                                                  retention=args.retention, num_examples=args.peer_examples,
                                                  pooling=args.peer_pooling,
                                                  step_rounds=args.peer_step_rounds, peer_python=args.peer_python)
    if "batch" in args.figures:
        low, high = sizes["batch_tokens"]
        log(f"batch: {args.batch_prompts} prompts of {low}-{high} tokens, batched and one at a time")
        results["figures"]["batch"] = measure_batch(model, tokenizer, args.batch_prompts, low, high, args.retention,
                                                    args.new_tokens, args.batch_methods, profile, log)
    results["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    write_json_atomic(args.out, _json_safe(results))
    print_tables(results)
    print(f"wrote {args.out}")
    return 0


def _console():
    from rich.console import Console

    # Piped output (logs, CI) would otherwise be cut to 80 columns and truncate method names.
    return Console(width=None if sys.stdout.isatty() else 120)


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def print_tables(results: dict, console=None) -> None:
    from rich.table import Table

    console = console or _console()
    m = results["machine"]
    console.print(f"[bold]{results['model']}[/] ({results['dtype']}) on {m.get('cpu_model', m['processor'])}, "
                  f"{m['threads']} threads, load {_fmt(m.get('load_average_at_start', [None])[0], '.1f')}")
    figs = results["figures"]
    if "profile" in figs:
        f = figs["profile"]
        t = Table(title=f"Profiling cost (P={f['prefix_len']}, T={f['cont_len']}); "
                        f"examples for split-half Spearman >= {f['threshold']}: {_fmt(f['examples_needed'])}")
        for c in ("examples", "seconds", "forward tokens", "tokens (no reuse)", "split-half Spearman"):
            t.add_column(c, justify="right")
        for r in f["rows"]:
            t.add_row(str(r["examples"]), _fmt(r["seconds"], ".1f"), str(r["tokens"]), str(r["tokens_naive"]),
                      _fmt(r["split_half_spearman"], ".3f"))
        console.print(t)
    if "overhead" in figs:
        f = figs["overhead"]
        t = Table(title=f"Compression overhead at retention {f['retention']:g} (target ratio < 1.05)")
        for c in ("tokens", "method", "prefill s", "ratio", "compress s", "compress share"):
            t.add_column(c, justify="right")
        for n, rows in f["lengths"].items():
            for name, r in rows.items():
                t.add_row(n, name, _fmt(r["prefill_s"], ".2f"), _fmt(r["ratio"], ".3f"), _fmt(r["compress_s"], ".3f"),
                          _fmt(r["compress_fraction"], ".1%"))
        console.print(t)
    if "memory" in figs:
        f = figs["memory"]
        t = Table(title=f"Memory at {f['n_tokens']} tokens ({f['dtype']})")
        for c in ("method", "cache MiB", "cache / full", "rounded retention", "expected == actual", "peak RSS MiB",
                  "peak extra MiB"):
            t.add_column(c, justify="right")
        mib = lambda b: None if b is None else b / 2 ** 20  # noqa: E731
        for name, r in f["rows"].items():
            t.add_row(name, _fmt(mib(r["cache_bytes"]), ".1f"), _fmt(r.get("ratio_to_full", 1.0), ".4f"),
                      _fmt(r.get("rounded_retention", 1.0), ".4f"), str(r["expected_bytes"] == r["cache_bytes"]),
                      _fmt(mib(r["peak_rss"]), ".0f"), _fmt(mib(r["peak_extra"]), ".0f"))
        console.print(t)
    if "decode" in figs:
        f = figs["decode"]
        t = Table(title=f"Decode: {f['new_tokens']} tokens after {f['n_tokens']}, retention {f['retention']:g}")
        for c in ("method", "tokens/s", "speedup vs full", "cache MiB", "tokens agreeing with full"):
            t.add_column(c, justify="right")
        for name, r in f["rows"].items():
            t.add_row(name, _fmt(r["tokens_per_s"], ".1f"), _fmt(r["speedup"], ".3f"),
                      _fmt(r["cache_bytes"] / 2 ** 20, ".1f"), _fmt(r["agree_with_full"], ".0%"))
        console.print(t)
    if "peer" in figs:
        f = figs["peer"]
        title = (f"Peer at {f['n_tokens']} tokens, retention {f['retention']:g}, pooling ours "
                 f"{f.get('ours_pooling', 'max')} "
                 f"/ kvpress avg: plain prefill {_fmt(f['prefill_s'], '.2f')} s")
        if f["kvpress_skipped"]:
            title += f"\nkvpress skipped: {f['kvpress_skipped']}"
        else:
            title += f"; kvpress's plain prefill {_fmt(f['kvpress_plain_prefill_s'], '.2f')} s"
        t = Table(title=title)
        for c in ("method", "ours prefill s", "ours step s", "ours KL", "kvpress prefill s", "kvpress step s",
                  "kvpress KL", "step s, alternating: ours", "kvpress", "speedup"):
            t.add_column(c, justify="right")
        for name, r in f["rows"].items():
            t.add_row(name, _fmt(r["ours_prefill_s"], ".2f"), _fmt(r["ours_compress_s"], ".3f"),
                      _fmt(r["ours_kl"], ".4f"),
                      _fmt(r.get("kvpress_prefill_s"), ".2f"), _fmt(r.get("kvpress_compress_s"), ".3f"),
                      _fmt(r.get("kvpress_kl"), ".4f"), _fmt(r.get("ours_step_replay_s"), ".3f"),
                      _fmt(r.get("kvpress_step_replay_s"), ".3f"), _fmt(r.get("compression_speedup_vs_kvpress"), ".2f"))
        console.print(t)
    if "batch" in figs:
        print_batch_table(figs["batch"], console)


if __name__ == "__main__":
    sys.exit(main())
