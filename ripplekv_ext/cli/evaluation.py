"""`ripplekv eval` and `ripplekv demo`: methods x retentions on the chosen tasks, and the whole tour on SmolLM2."""

from __future__ import annotations

import math
import time
from pathlib import Path

from ripplekv_ext.cli.common import (CliError, check_model_arg, check_output_file, check_output_folder,
                                     check_profile, check_profile_model, check_text_source, load_model_checked,
                                     make_console)
from ripplekv_ext.cli.profiling import budgets_table
from ripplekv_ext.eval.models import default_profile_path

# ---- eval --------------------------------------------------------------------------------------------

GENERATION_TASKS = ("passkey", "multikey", "kv_retrieval", "variable_tracking")
TASKS = ("fidelity",) + GENERATION_TASKS + ("needle", "longbench", "user")
FILLER_MARGIN = 64  # tokens; more than any synthetic task's filler unit
# Tasks whose prompts split into a context and a question, so that protocol "after" (compress once, ask many)
# can compress the context before the question is asked.
AFTER_TASKS = GENERATION_TASKS + ("needle", "longbench", "user")


def shortest_prompt(args) -> int:
    """The lowest retention must leave more than the window: shorter prompts cannot be compressed to it."""
    return math.ceil((args.window + 1) / min(args.retentions))


def check_eval_args(args) -> None:
    """Everything about an eval request that can be wrong, checked before minutes go into loading a model."""
    from ripplekv_ext.methods import check_method

    for method in args.methods:
        try:
            check_method(method)
        except ValueError as err:
            raise CliError(str(err))
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        raise CliError(f"unknown task(s) {', '.join(unknown)}: expected some of {', '.join(TASKS)}")
    check_model_arg(args.model)
    if "fidelity" in args.tasks:
        # The demo (the report's parts) takes one text per fidelity domain; eval takes one.
        for text in args.text.split(",") if args.func is cmd_demo else [args.text]:
            check_text_source("--text", text)
    if "longbench" in args.tasks and not (args.longbench_dir and Path(args.longbench_dir).expanduser().is_dir()):
        raise CliError(f"--longbench-dir must be a folder of LongBench *.jsonl files, got {args.longbench_dir!r}")
    if "user" in args.tasks and not (args.user_jsonl and Path(args.user_jsonl).expanduser().is_file()):
        raise CliError(f"--user-jsonl must be a JSONL file of {{context, question, answers}}, got {args.user_jsonl!r}")
    check_output_folder("--out-dir", args.out_dir)
    if "after" in getattr(args, "protocols", ["inside"]):
        unsplit = [t for t in args.tasks if t not in AFTER_TASKS and t != "fidelity"]
        if unsplit or not any(t in AFTER_TASKS for t in args.tasks):
            raise CliError(f"--protocols after compresses a context before its question: it runs with the tasks "
                           f"{', '.join(AFTER_TASKS)}, not {', '.join(unsplit) or 'fidelity alone'} (fidelity has no "
                           "question and runs once); pass --protocols inside for the others")
    shortest = shortest_prompt(args)
    for option, value in (("--prefix-len", args.prefix_len if "fidelity" in args.tasks else None),
                          ("--length", args.length)):
        if value is not None and value < shortest:
            raise CliError(f"{option} {value} is too short: retention {min(args.retentions):g} with window "
                           f"{args.window} needs prompts of at least {shortest} tokens")


def build_tasks(args, tokenizer):
    """(fidelity ids or None, generation examples, settings that define them)."""
    from ripplekv_ext.eval import fidelity_examples, load_longbench, load_user_jsonl, make_synthetic
    from ripplekv_ext.eval.synthetic import DEFAULT_LENGTHS

    settings = {"tasks": args.tasks, "examples": args.examples}
    shortest = shortest_prompt(args)
    fidelity_ids = None
    if "fidelity" in args.tasks:
        fidelity_ids = fidelity_examples(tokenizer, args.prefix_len, args.cont_len, args.examples, source=args.text)
        settings.update(prefix_len=args.prefix_len, cont_len=args.cont_len, text=args.text)
    examples = []
    for task in GENERATION_TASKS:
        if task in args.tasks:
            preferred = getattr(args, "task_lengths", {}).get(task, DEFAULT_LENGTHS[task])
            # Prompts come out up to one filler unit shorter than asked: leave room above the minimum.
            length = args.length or max(preferred, shortest + FILLER_MARGIN)
            made = make_synthetic(task, tokenizer, length=length, num_examples=args.examples, seed=args.seed)
            too_short = min(len(e.input_ids) for e in made)
            if too_short < shortest:
                raise CliError(f"{task} prompts of {too_short} tokens are too short for retention "
                               f"{min(args.retentions):g} with window {args.window}; pass --length above {length}")
            examples += made
            settings[f"{task}_length"] = length
    if "needle" in args.tasks:
        from ripplekv_ext.eval.needle import DEFAULT_DEPTHS, DEFAULT_LENGTHS, make_needle

        lengths = [args.length] if args.length else list(DEFAULT_LENGTHS)
        examples += make_needle(tokenizer, lengths, DEFAULT_DEPTHS)
        settings["needle_lengths"] = lengths
    if "longbench" in args.tasks:
        if not args.longbench_dir or not Path(args.longbench_dir).is_dir():
            raise CliError(f"--longbench-dir must be a folder of LongBench *.jsonl files, got {args.longbench_dir!r}")
        examples += load_longbench(args.longbench_dir, tokenizer, args.max_prompt_tokens, limit=args.examples)
        settings["longbench_dir"] = str(Path(args.longbench_dir).resolve())
    if "user" in args.tasks:
        if not args.user_jsonl or not Path(args.user_jsonl).is_file():
            raise CliError(f"--user-jsonl must be a JSONL file of {{context, question, answers}}, got "
                           f"{args.user_jsonl!r}")
        examples += load_user_jsonl(args.user_jsonl, tokenizer, args.max_prompt_tokens, limit=args.examples)
        settings["user_jsonl"] = str(Path(args.user_jsonl).resolve())
    return fidelity_ids, examples, settings


def results_table(results: dict):
    from rich.table import Table

    cells = list(results["cells"].values())
    tasks = sorted({t for c in cells for t in c.get("tasks", {})})
    has_fidelity = any("fidelity" in c for c in cells)
    # Protocol "after" (the question after compression) sits next to "inside" (the question in the prompt).
    protocols = [("", lambda c: c)] + ([(" after", lambda c: c.get("after", {}))]
                                       if any("after" in c for c in cells) else [])
    if not tasks and len(protocols) > 1:
        tasks = sorted({t for c in cells for t in c.get("after", {}).get("tasks", {})})
        protocols = protocols[1:]
    title = "methods x retention (fidelity: lower KL is better; tasks: exact match x100"
    if len(protocols) > 1 or protocols[0][0]:
        title += "; after: the question asked after the context was compressed"
    table = Table(title=title + ")")
    table.add_column("method")
    table.add_column("retention", justify="right")
    if has_fidelity:
        table.add_column("KL", justify="right")
        table.add_column("NLL", justify="right")
    for suffix, _ in protocols:
        for task in tasks:
            table.add_column(task + suffix, justify="right")
        if tasks:
            table.add_column("task mean" + suffix, justify="right")
    table.add_column("s", justify="right")
    order = {m: i for i, m in enumerate(results["settings"]["methods"])}
    for c in sorted(cells, key=lambda c: (c["retention"] or 0, order.get(c["method"], 99))):
        row = [c["method"], "-" if c["retention"] is None else f"{c['retention']:.0%}"]
        if has_fidelity:
            f = c.get("fidelity", {})
            row += [f"{f['kl']:.4f}" if f else "", f"{f['nll_compressed']:.3f}" if f else ""]
        for _, view in protocols:
            scores = view(c)
            row += [f"{scores['tasks'][t]:.0f}" if t in scores.get("tasks", {}) else "" for t in tasks]
            if tasks:
                row.append(f"{scores['task_mean']:.1f}" if "task_mean" in scores else "")
        row.append(f"{c['seconds']:.0f}")
        table.add_row(*row)
    return table


def run_eval(args, model, tokenizer, name, profile) -> dict:
    from ripplekv_ext.eval.grid import run_grid
    from ripplekv_ext.eval.plots import plot_eval

    fidelity_ids, examples, settings = build_tasks(args, tokenizer)
    settings["model"] = name
    if profile is not None:
        settings["profile_sensitivity"] = profile.sensitivity
    out_dir = Path(args.out_dir)
    out = out_dir / "eval.json"
    results = run_grid(model, tokenizer, args.methods, args.retentions, profile=profile, fidelity_ids=fidelity_ids,
                       prefix_len=args.prefix_len, task_examples=examples, window=args.window, settings=settings,
                       out_path=out, protocols=getattr(args, "protocols", ["inside"]))
    console = make_console()
    console.print(results_table(results))
    png = plot_eval(results, out_dir / "eval.png")
    console.print(f"results: {out}\nplot:    {png}")
    return results


def cmd_eval(args) -> int:
    from ripplekv_ext.methods import needs_profile

    check_eval_args(args)
    profile = check_profile(args) if any(needs_profile(m) for m in args.methods) else None
    model, tokenizer, name = load_model_checked(args.model)
    if profile is not None:
        check_profile_model(profile, model, args)
    run_eval(args, model, tokenizer, name, profile)
    return 0


# ---- demo --------------------------------------------------------------------------------------------

# Sized to finish in about 10 minutes on a 2-core CPU (see docs/results.md): a short profile when none is cached, then
# the results report (``ripplekv report``) at its prompt lengths on fewer examples: ``eval.report.DEMO_SIZES``.
DEMO_PROFILE = dict(prefix_len=512, cont_len=32, num_examples=4)


def demo_sizes(args):
    """The demo's report sizes: ``DEMO_SIZES`` with the demo's options applied. ``--examples`` sets the fidelity
    example count (fidelity is cheap: one prefill per prompt); passkey keeps one example per depth. Fidelity runs
    at every ``--retentions`` value, passkey and the needle at the largest (20% by default: one retention keeps
    the generation tasks within the demo's time)."""
    from ripplekv_ext.eval.report import PARTS, DEMO_SIZES, sizes_with

    other = [t for t in args.tasks if t not in PARTS]
    if other:
        raise CliError(f"the demo runs the report's parts ({', '.join(PARTS)}), not {', '.join(other)}; "
                       "use `ripplekv eval --tasks ...` for the other tasks")
    return sizes_with(DEMO_SIZES, methods=tuple(args.methods), fidelity_methods=tuple(args.methods),
                      retentions=tuple(args.retentions), task_retentions=(max(args.retentions),),
                      fidelity_examples=args.examples, prefix_len=args.prefix_len, cont_len=args.cont_len,
                      passkey_length=args.length, needle_lengths=(args.length,) if args.length else None,
                      window=args.window, seed=args.seed, texts=tuple(args.text.split(",")))


def cmd_demo(args) -> int:
    from ripplekv_ext.cli.report import check_report_sizes, known_profile
    from ripplekv_ext.eval.corpus import calibration_examples
    from ripplekv_ext.eval.plots import plot_profile
    from ripplekv_ext.eval.report import REPORT_SIZES, run_report
    from ripplekv_ext.profiler import format_profile, profile_model, sliding_prefix_len

    check_eval_args(args)
    sizes = demo_sizes(args)
    check_report_sizes(sizes, args.tasks)
    # A profile measured here is cached: its folder must take it (RIPPLEKV_CACHE_DIR moves it).
    check_output_file("the profile cache", default_profile_path(args.model),
                      "set RIPPLEKV_CACHE_DIR to a writable folder")
    start = time.perf_counter()
    console = make_console()
    console.rule("1/3 model")
    model, tokenizer, name = load_model_checked(args.model)
    console.print(f"{name}: {model.config.num_hidden_layers} layers, loaded in {time.perf_counter() - start:.0f} s")

    console.rule("2/3 sensitivity profile")
    # A profile measured earlier on this very model saves the demo the profiling run (--reprofile measures anew).
    profile = known_profile(args.model, model, log=console.print, reprofile=args.reprofile)
    if profile is None:
        settings = dict(DEMO_PROFILE, prefix_len=sliding_prefix_len(model, DEMO_PROFILE["prefix_len"]))
        examples, source = calibration_examples(tokenizer, None, settings["prefix_len"], settings["cont_len"],
                                                settings["num_examples"])
        profile = profile_model(model, examples=examples, source=source, seed=args.seed,
                                out_path=default_profile_path(args.model), model_name=name, **settings)
    print(format_profile(profile))
    plot_profile(profile, Path(args.out_dir) / "profile.png")

    console.rule("3/3 methods x retentions: the results report on fewer examples")
    table, layers = budgets_table(model, sizes.prefix_len, 0.2, ["uniform", "pyramidkv", "ripplekv"], profile,
                                  sizes.window)
    console.print(f"budgets at 20% of {sizes.prefix_len} tokens, layers {layers[0]}..{layers[-1]}:")
    for allocator, values in table.items():
        console.print(f"  {allocator:>9}: {values}")
    path = run_report(model, tokenizer, name, profile, Path(args.out_dir), sizes, parts=args.tasks,
                      command="ripplekv demo", log=console.print)
    console.print(path.read_text(encoding="utf-8"), markup=False, highlight=False)
    console.print(f"demo finished in {time.perf_counter() - start:.0f} s; the full report: `ripplekv report` "
                  f"({REPORT_SIZES.fidelity_examples} fidelity examples per text, {REPORT_SIZES.passkey_examples} "
                  f"passkey examples, a {len(REPORT_SIZES.needle_lengths)} x {len(REPORT_SIZES.needle_depths)} needle "
                  f"grid, {len(REPORT_SIZES.fidelity_methods) - 1} methods besides full)")
    return 0
