"""`ripplekv profile`, `ripplekv allocate`, `ripplekv diagnose`: a model's sensitivity profile and what follows from
it."""

from __future__ import annotations

import json

from ripplekv_ext.cli.common import (CliError, check_model_arg, check_output_file, check_output_folder,
                                     check_profile, check_profile_model, check_text_source, load_model_checked,
                                     make_console)
from ripplekv_ext.eval.models import default_profile_path, known_shape


# ---- profile -----------------------------------------------------------------------------------------

def check_layers(layers: list[int], num_layers: int, name: str) -> None:
    bad = sorted({l for l in layers if l >= num_layers})
    if bad or len(set(layers)) != len(layers):
        raise CliError(f"--layers {' '.join(map(str, layers))}: expected distinct layer indices in "
                       f"[0, {num_layers}) ({name} has {num_layers} layers)")


def cmd_profile(args) -> int:
    from ripplekv_ext.eval.corpus import calibration_examples
    from ripplekv_ext.eval.plots import plot_profile
    from ripplekv_ext.profiler import FAST_SETTINGS, PLAIN_SETTINGS, format_profile, profile_model, sliding_prefix_len

    check_model_arg(args.model)
    check_text_source("--text", args.text)
    # Options left out take the plain defaults, or --fast's; an option given explicitly always wins.
    preset = FAST_SETTINGS if args.fast else PLAIN_SETTINGS
    given = {"prefix_len": args.prefix_len, "cont_len": args.cont_len, "num_examples": args.examples,
             "max_examples": args.max_examples, "estimator": args.estimator}
    settings = {**preset, **{name: value for name, value in given.items() if value is not None}}
    settings["until_stable"] = args.until_stable or preset["until_stable"]
    if settings["until_stable"] and settings["max_examples"] < settings["num_examples"]:
        raise CliError(f"--max-examples {settings['max_examples']} is below --examples {settings['num_examples']}: "
                       "--until-stable adds examples up to --max-examples")
    if args.antithetic and settings["estimator"] == "fisher":
        raise CliError("--antithetic pairs perturbation draws: leave it out with --estimator fisher (or --fast)")
    # The profile, its partial file and its plot go next to --out: refuse a folder or an unwritable place now,
    # not after the whole profiling run.
    out = check_output_file("--out", args.out if args.out else default_profile_path(args.model),
                            None if args.out else "pass --out FILE or set RIPPLEKV_CACHE_DIR to a writable folder")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # --layers is checked against the layer count before the model loads where the config or GGUF_MODELS gives it.
    shape = known_shape(args.model)
    if args.layers is not None and shape is not None:
        check_layers(args.layers, shape["num_layers"], args.model)
    model, tokenizer, name = load_model_checked(args.model)
    if args.layers is not None and shape is None:
        from ripplekv_ext.model_info import text_config

        check_layers(args.layers, text_config(model).num_hidden_layers, name)
    sliding = sliding_prefix_len(model, settings["prefix_len"])
    if args.prefix_len is None and sliding != settings["prefix_len"]:
        settings["prefix_len"] = sliding
        print(f"{name} has sliding-window layers: profiling {settings['prefix_len']}-token prefixes, twice their "
              "window, so that they slide as in serving (--prefix-len overrides)", flush=True)
    examples, source = calibration_examples(tokenizer, args.text, settings["prefix_len"], settings["cont_len"],
                                            settings["num_examples"],
                                            settings["max_examples"] if settings["until_stable"] else None)
    profile = profile_model(model, examples=examples, source=source, reuse=not args.no_reuse, sigma=args.sigma,
                            seed=args.seed, draws=args.draws, layers=args.layers, target=args.target,
                            stability_threshold=args.stability_threshold, antithetic=args.antithetic,
                            batch_rows=args.batch_rows, out_path=out, resume=not args.no_resume, model_name=name,
                            **settings)
    print(format_profile(profile))
    png = plot_profile(profile, out.with_suffix(".png"))
    print(f"profile: {out}\nplot:    {png}")
    return 0


# ---- allocate ----------------------------------------------------------------------------------------

def budgets_table(model, prompt_len: int, retention: float, allocators: list[str], profile, window: int):
    """{allocator: budgets} over the compressible layers, plus those layers."""
    from ripplekv_ext.model_info import compressible_layers
    from ripplekv_ext.methods import make_allocator
    from ripplekv_ext.policies import Policy
    from ripplekv_ext.selection.selectors import SnapKVSelector

    layers = compressible_layers(model)
    table = {}
    for name in allocators:
        policy = Policy(make_allocator(name, profile), SnapKVSelector(), retention, window)
        # The layer indices let a profile of some layers (in any order) give each its own budget.
        table[name] = policy.layer_budgets(len(layers), prompt_len, layers)
    return table, layers


def shortest_compressible_prompt(retention: float, window: int) -> int:
    """The shortest prompt whose average budget round(retention * N) exceeds the window."""
    import math

    from ripplekv_ext.budgets.allocators import average_budget

    n = math.ceil((window + 1) / retention)
    while n > 1 and average_budget(retention, n - 1) > window:  # rounding up can admit a slightly shorter one
        n -= 1
    return n


def check_compressible(prompt_len: int, retention: float, window: int) -> None:
    """Budgets of a prompt whose average budget does not exceed the window are just "keep everything"."""
    from ripplekv_ext.budgets.allocators import average_budget

    if retention < 1.0 and average_budget(retention, prompt_len) <= window:
        shortest = shortest_compressible_prompt(retention, window)
        raise CliError(f"--prompt-len {prompt_len} is too short to compress: retention {retention:g} with window "
                       f"{window} needs prompts of at least {shortest} tokens (shorter ones stay uncompressed); "
                       "pass a longer --prompt-len, a higher --retention or a smaller --window")


def cmd_allocate(args) -> int:
    from rich.table import Table

    from ripplekv_ext.budgets.allocators import average_budget, pyramidkv_schedule
    from ripplekv_ext.eval.plots import plot_budgets

    check_model_arg(args.model)
    check_compressible(args.prompt_len, args.retention, args.window)
    profile = check_profile(args) if "ripplekv" in args.allocators else None
    out_dir = check_output_folder("--out-dir", args.out_dir)
    model, _, name = load_model_checked(args.model)
    if profile is not None:
        check_profile_model(profile, model, args)
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

    check_model_arg(args.model)
    check_text_source("--text", args.text)
    out = check_output_file("--out", args.out) if args.out else check_output_folder("--out-dir", args.out_dir) / \
        "diagnostic.json"
    profile = check_profile(args)
    model, tokenizer, _ = load_model_checked(args.model)
    check_profile_model(profile, model, args)
    # Unless told otherwise, damage is measured at the profile's own sizes, on held-out text.
    calibration = profile.calibration
    prefix_len = args.prefix_len or calibration["prefix_len"]
    cont_len = args.cont_len or calibration["cont_len"]
    examples = args.examples or calibration["num_examples"]
    ids = fidelity_examples(tokenizer, prefix_len, cont_len, examples, source=args.text)
    report = run_diagnostic(model, profile, ids, prefix_len, retentions=args.retentions, window=args.window,
                            out_path=out)
    print(format_report(report))
    print(f"json: {out}")
    return 0
