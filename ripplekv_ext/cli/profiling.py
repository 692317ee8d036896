"""`ripplekv profile`, `ripplekv allocate`, `ripplekv diagnose`: a model's sensitivity profile and what follows from it."""

from __future__ import annotations

import json
from pathlib import Path

from ripplekv_ext.cli.common import CliError, load_profile_for, make_console
from ripplekv_ext.eval.models import default_profile_path, load_model

# ---- profile -----------------------------------------------------------------------------------------

def cmd_profile(args) -> int:
    from ripplekv_ext.eval.plots import plot_profile
    from ripplekv_ext.profiler import format_profile, profile_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(args.model)
    out = Path(args.out) if args.out else default_profile_path(args.model)
    profile = profile_model(model, tokenizer, args.text, reuse=not args.no_reuse, prefix_len=args.prefix_len,
                            cont_len=args.cont_len,
                            num_examples=args.examples, sigma=args.sigma, seed=args.seed, draws=args.draws,
                            layers=args.layers, target=args.target, until_stable=args.until_stable,
                            stability_threshold=args.stability_threshold, max_examples=args.max_examples,
                            out_path=out, resume=not args.no_resume, model_name=name)
    print(format_profile(profile))
    png = plot_profile(profile, out.with_suffix(".png"))
    print(f"profile: {out}\nplot:    {png}")
    return 0


# ---- allocate ----------------------------------------------------------------------------------------

def budgets_table(model, prompt_len: int, retention: float, allocators: list[str], profile, window: int):
    """{allocator: budgets} over the compressible layers, plus those layers."""
    from ripplekv_ext.model_info import compressible_layers
    from ripplekv_ext.methods import make_allocator
    from ripplekv_ext.policies import Policy, SnapKVSelector

    layers = compressible_layers(model)
    table = {}
    for name in allocators:
        policy = Policy(make_allocator(name, profile), SnapKVSelector(), retention, window)
        table[name] = policy.layer_budgets(len(layers), prompt_len)
    return table, layers


def cmd_allocate(args) -> int:
    from rich.table import Table

    from ripplekv_ext.allocation import average_budget, pyramidkv_schedule
    from ripplekv_ext.eval.plots import plot_budgets

    if args.prompt_len < 1:
        raise CliError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    model, _, name = load_model(args.model)
    profile = None
    if "ripplekv" in args.allocators:
        profile = load_profile_for(model, args.profile or default_profile_path(args.model), args.force)
    table, layers = budgets_table(model, args.prompt_len, args.retention, args.allocators, profile, args.window)
    avg = average_budget(args.retention, args.prompt_len)

    view = Table(title=f"{name}: budgets per layer for {args.prompt_len} tokens at retention {args.retention:g} "
                       f"(average {avg}, window {args.window})")
    view.add_column("layer", justify="right")
    for allocator in table:
        view.add_column(allocator, justify="right")
    for i, layer in enumerate(layers):
        view.add_row(str(layer), *[str(table[a][i]) for a in table])
    view.add_row("total", *[str(sum(table[a])) for a in table], style="bold")
    console = make_console()
    console.print(view)
    if "pyramidkv" in table and avg < args.prompt_len:
        raw = pyramidkv_schedule(len(layers), args.prompt_len, avg, args.window)
        console.print(f"PyramidKV's published (floored) schedule totals {sum(raw)} tokens; every allocator here is "
                      f"held to {len(layers) * avg}.")
    out_dir = Path(args.out_dir)
    png = plot_budgets(table, layers, args.prompt_len, out_dir / "budgets.png")
    (out_dir / "budgets.json").write_text(json.dumps({"model": name, "prompt_len": args.prompt_len,
                                                      "retention": args.retention, "layers": layers,
                                                      "budgets": table}, indent=1))
    console.print(f"plot: {png}\njson: {out_dir / 'budgets.json'}")
    return 0


# ---- diagnose ----------------------------------------------------------------------------------------

def cmd_diagnose(args) -> int:
    from ripplekv_ext.eval.diagnostics import format_report, run_diagnostic
    from ripplekv_ext.eval.fidelity import fidelity_examples

    model, tokenizer, _ = load_model(args.model)
    profile = load_profile_for(model, args.profile or default_profile_path(args.model), args.force)
    # Unless told otherwise, damage is measured at the profile's own sizes, on held-out text.
    calibration = profile.calibration
    prefix_len = args.prefix_len or calibration["prefix_len"]
    cont_len = args.cont_len or calibration["cont_len"]
    examples = args.examples or calibration["num_examples"]
    ids = fidelity_examples(tokenizer, prefix_len, cont_len, examples, source=args.text)
    out = Path(args.out) if args.out else Path(args.out_dir) / "diagnostic.json"
    report = run_diagnostic(model, profile, ids, prefix_len, retentions=args.retentions, window=args.window,
                            out_path=out)
    print(format_report(report))
    print(f"json: {out}")
    return 0
