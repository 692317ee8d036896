"""The `ripplekv` argument parser: one subcommand per `cmd_*` function of the command modules."""

from __future__ import annotations

import argparse

from ripplekv_ext.cli.common import RESULTS_DIR
from ripplekv_ext.cli.evaluation import GENERATION_TASKS, TASKS, cmd_demo, cmd_eval
from ripplekv_ext.cli.profiling import cmd_allocate, cmd_diagnose, cmd_profile
from ripplekv_ext.cli.report import cmd_report
from ripplekv_ext.eval.report import DEMO_PARTS, DEMO_SIZES, PARTS
from ripplekv_ext.eval.models import DEFAULT_MODEL
from ripplekv_ext.methods import ALLOCATORS, DEFAULT_METHODS, SELECTORS
from ripplekv_ext.policies import DEFAULT_WINDOW

DESCRIPTION = """The `ripplekv` command line (also `python -m ripplekv_ext`).

    ripplekv profile   measure a model's per-layer sensitivity profile (JSON + PNG)
    ripplekv allocate  per-layer budgets for a prompt length and retention, for every allocator (table + PNG)
    ripplekv diagnose  isolated compression damage per layer vs the profile and vs layer index
    ripplekv eval      methods x retentions on fidelity, synthetic, LongBench and your own JSONL tasks
    ripplekv report    the results report: fidelity with CIs, passkey by depth, needle heat maps (Markdown + PNG)
    ripplekv demo      all of the above on the bundled SmolLM2-135M-Instruct and King James Bible

Everything defaults to the bundled model and text, so each command runs with no arguments but the required ones.
The end-to-end benchmarks (profiling cost, compression overhead, memory, decode speed) are in a source checkout:
`python bench/e2e_bench.py --help`.
"""

# ---- argument types ----------------------------------------------------------------------------------
# argparse reports an ArgumentTypeError as "argument --option: message" and exits 2, before any model loads.

def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def retention_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"retentions must be comma-separated numbers in (0, 1], got {text!r}")
    bad = [v for v in values if not 0.0 < v <= 1.0]  # NaN fails the comparison too
    if not values or bad:
        raise argparse.ArgumentTypeError(f"every retention must be in (0, 1], got {text!r}")
    return values


def one_retention(text: str) -> float:
    """Exactly one retention: a list would silently use its first value."""
    values = retention_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one retention in (0, 1], got {text!r}; run once per retention "
                                         "(`ripplekv eval --retentions` takes a list)")
    return values[0]


def name_list(text: str) -> list[str]:
    names = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def method_list(text: str) -> list[str]:
    from ripplekv_ext.methods import check_method

    names = name_list(text)
    for name in names:
        try:
            check_method(name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return names


def names_among(text: str, choices, what: str) -> list[str]:
    """Comma-separated names, each one of ``choices``; ``what`` names them in the error (e.g. "task")."""
    names = name_list(text)
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown)}: expected some of "
                                         f"{', '.join(choices)}")
    return names


def allocator_list(text: str) -> list[str]:
    names = names_among(text, ALLOCATORS, "allocator")
    if "cake" in names:
        # Its budgets come from a prompt's own attention; from a length alone it would print the even plan.
        raise argparse.ArgumentTypeError("cake's budgets come from each prompt's own attention, not from its length: "
                                         "allocate cannot print them (ripplekv eval --methods cake compresses with "
                                         "them); drop cake from --allocators")
    return names


def task_list(text: str) -> list[str]:
    return names_among(text, TASKS, "task")


def protocol_list(text: str) -> list[str]:
    from ripplekv_ext.eval.runner import PROTOCOLS

    names = name_list(text)
    unknown = [n for n in names if n not in PROTOCOLS]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"protocols must be distinct names among {', '.join(PROTOCOLS)}, got "
                                         f"{text!r}")
    return names


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def length_list(text: str) -> list[int]:
    """Comma-separated token counts, e.g. ``1024,1536,2048``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def percent_list(text: str) -> list[float]:
    """Comma-separated needle depths in percent of the context, e.g. ``0,25,50,75,100``."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percents in [0, 100], got {text!r}") from None
    if not values or not all(0.0 <= v <= 100.0 for v in values):  # NaN fails the comparison too
        raise argparse.ArgumentTypeError(f"expected comma-separated percents in [0, 100], got {text!r}")
    return values


def part_list(text: str) -> list[str]:

    return names_among(text, PARTS, "part")


def correlation(text: str) -> float:
    value = _number(text)
    if not -1.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [-1, 1], got {text!r}")
    return value


# ---- parser ------------------------------------------------------------------------------------------

class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument in one line, as every other `ripplekv` error is, pointing at --help instead of
    printing the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")



def _add_model(p):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"'{DEFAULT_MODEL}' (bundled SmolLM2-135M-Instruct), 'gemma3-270m' (optional: "
                        "`make gemma3`) or a local transformers model folder")


def _add_profile(p):
    p.add_argument("--profile", default=None, help="profile JSON (default: the cached profile of --model)")
    p.add_argument("--force", action="store_true", help="use a profile whose model fingerprint does not match")


def _add_eval_options(p, *, examples: int, prefix_len: int):
    p.add_argument("--methods", type=method_list, default=list(DEFAULT_METHODS),
                   help=f"comma-separated: {', '.join(DEFAULT_METHODS)} or ALLOCATOR+SELECTOR, ALLOCATOR one of "
                        f"{', '.join(ALLOCATORS)} and SELECTOR one of {', '.join(SELECTORS)}")
    p.add_argument("--retentions", type=retention_list, default=[0.1, 0.2, 0.3], help="comma-separated, in (0, 1]")
    p.add_argument("--tasks", type=task_list, default=["fidelity", *GENERATION_TASKS],
                   help=f"comma-separated, of: {', '.join(TASKS)}")
    p.add_argument("--examples", type=positive_int, default=examples, help="examples per task")
    p.add_argument("--prefix-len", type=positive_int, default=prefix_len, help="fidelity prompt length (tokens)")
    p.add_argument("--cont-len", type=positive_int, default=64, help="fidelity continuation length (tokens)")
    p.add_argument("--length", type=positive_int, default=None,
                   help="synthetic prompt length in tokens (default: per task, where the full model solves it)")
    p.add_argument("--text", default="kjv:evaluation",
                   help="fidelity text: kjv:evaluation, essays:evaluation, a .txt or a .jsonl file")
    p.add_argument("--longbench-dir", default=None, help="folder of LongBench *.jsonl files (task 'longbench')")
    p.add_argument("--user-jsonl", default=None, help="JSONL of {context, question, answers} (task 'user')")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=7500,
                   help="LongBench/user prompts are cut in the middle to this many tokens")
    p.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW, help="observation window W")
    p.add_argument("--protocols", type=protocol_list, default=["inside"],
                   help="where the question goes, comma-separated: inside (in the compressed prompt) and/or after "
                        "(compress once, ask many: the context is compressed first, the question follows)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out-dir", default=str(RESULTS_DIR), help="where JSON results and PNG plots go")


def _add_report_options(p):
    from ripplekv_ext.eval.report import REPORT_SIZES as R

    def listed(values):
        return ",".join(f"{v:g}" for v in values)

    p.add_argument("--parts", type=part_list, default=list(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--methods", type=method_list, default=list(R.methods),
                   help=f"methods of the passkey and needle parts (default {','.join(R.methods)})")
    p.add_argument("--after-methods", type=method_list, default=None,
                   help="those of --methods also asked after a context compressed before its question (default: "
                        f"those of {','.join(R.after_methods)} in --methods)")
    p.add_argument("--fidelity-methods", type=method_list, default=list(R.fidelity_methods),
                   help=f"methods of the fidelity part (default {','.join(R.fidelity_methods)})")
    p.add_argument("--retentions", type=retention_list, default=list(R.retentions),
                   help=f"fidelity retentions (default {listed(R.retentions)})")
    p.add_argument("--task-retentions", type=retention_list, default=list(R.task_retentions),
                   help=f"passkey and needle retentions (default {listed(R.task_retentions)})")
    p.add_argument("--fidelity-examples", type=positive_int, default=R.fidelity_examples)
    p.add_argument("--prefix-len", type=positive_int, default=R.prefix_len, help="fidelity prompt length (tokens)")
    p.add_argument("--cont-len", type=positive_int, default=R.cont_len, help="fidelity continuation length (tokens)")
    p.add_argument("--passkey-length", type=positive_int, default=R.passkey_length, help="tokens")
    p.add_argument("--passkey-examples", type=positive_int, default=R.passkey_examples)
    p.add_argument("--passkey-depths", type=positive_int, default=R.passkey_depths,
                   help="needle depths spread evenly from the start to the end of the context")
    p.add_argument("--needle-lengths", type=length_list, default=list(R.needle_lengths),
                   help=f"needle-in-a-haystack context lengths in tokens (default {listed(R.needle_lengths)})")
    p.add_argument("--needle-depths", type=percent_list, default=list(R.needle_depths),
                   help=f"needle depths in percent (default {listed(R.needle_depths)})")
    p.add_argument("--text", default=",".join(R.texts),
                   help="fidelity texts, comma-separated, one part each: kjv:evaluation, essays:evaluation, a .txt or "
                        "a .jsonl file")
    p.add_argument("--window", type=positive_int, default=R.window, help="observation window W")
    p.add_argument("--seed", type=non_negative_int, default=R.seed)
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out-dir", default=str(RESULTS_DIR / "report"),
                   help="where report.md, its PNG figures and the resumable JSON results go")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="ripplekv", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)

    p = sub.add_parser("profile", help="measure the per-layer sensitivity profile")
    _add_model(p)
    p.add_argument("--text", default=None, help="calibration text: kjv (default), a .txt or .jsonl file")
    # --fast changes the defaults of the options marked (fast: ...); an option given explicitly always wins.
    p.add_argument("--fast", action="store_true",
                   help="the cheap stable profile of docs/profiling.md: Fisher estimator, shorter examples, adds "
                        "examples until stable (sets the defaults marked 'fast:' below)")
    p.add_argument("--prefix-len", type=positive_int, default=None,
                   help="default 1024 (fast: 256), or twice a sliding-window model's window where that is longer")
    p.add_argument("--cont-len", type=positive_int, default=None, help="default 64 (fast: 64)")
    p.add_argument("--examples", type=positive_int, default=None, help="default 8 (fast: 8, the first stability check)")
    p.add_argument("--sigma", type=positive_float, default=0.1, help="noise scale, relative to each vector's norm")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--draws", type=positive_int, default=1,
                   help="noise draws per layer (with --estimator fisher: sampled tokens per position)")
    p.add_argument("--layers", type=non_negative_int, nargs="+", default=None,
                   help="layer indices to profile (default: the compressible layers)")
    p.add_argument("--target", choices=("values", "keys", "both"), default="values")
    p.add_argument("--estimator", choices=("perturbation", "fisher"), default=None,
                   help="perturbation (default: one noisy continuation per layer) or fisher (every layer from one "
                        "backward pass; fast: fisher)")
    p.add_argument("--antithetic", action="store_true", help="each draw also runs its negated noise")
    p.add_argument("--batch-rows", type=positive_int, default=1,
                   help="perturbed continuations per batched forward pass (same profile; more memory)")
    p.add_argument("--until-stable", action="store_true",
                   help="add examples until split-half Spearman >= threshold (fast: on)")
    p.add_argument("--stability-threshold", type=correlation, default=0.9)
    p.add_argument("--max-examples", type=positive_int, default=None, help="default 64 (fast: 20)")
    p.add_argument("--out", default=None, help="profile JSON (default: the model's cached profile)")
    p.add_argument("--no-resume", action="store_true", help="ignore a partial file of an interrupted run")
    p.add_argument("--no-reuse", action="store_true",
                   help="recompute every layer for every run (the naive way; same profile, slower)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("allocate", help="per-layer budgets for a prompt length and retention")
    _add_model(p)
    _add_profile(p)
    p.add_argument("--prompt-len", type=positive_int, required=True)
    p.add_argument("--retention", type=one_retention, required=True, help="one value in (0, 1]")
    p.add_argument("--allocators", type=allocator_list, default=["uniform", "pyramidkv", "ripplekv"])
    p.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW)
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.set_defaults(func=cmd_allocate)

    p = sub.add_parser("diagnose", help="isolated compression damage per layer vs the profile")
    _add_model(p)
    _add_profile(p)
    p.add_argument("--examples", type=positive_int, default=None, help="default: the profile's example count")
    p.add_argument("--prefix-len", type=positive_int, default=None, help="default: the profile's P")
    p.add_argument("--cont-len", type=positive_int, default=None, help="default: the profile's T")
    p.add_argument("--retentions", type=retention_list, default=[0.1, 0.2, 0.3])
    p.add_argument("--text", default="kjv:evaluation",
                   help="damage is measured on held-out text by default, not on the profile's calibration text")
    p.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW)
    p.add_argument("--out", default=None, help="report JSON (default: OUT_DIR/diagnostic.json)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("eval", help="methods x retentions on the chosen tasks")
    _add_model(p)
    _add_profile(p)
    _add_eval_options(p, examples=10, prefix_len=1024)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="the results report: Markdown tables and PNG figures with their CIs")
    _add_model(p)
    _add_profile(p)
    _add_report_options(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("demo", help="profile, allocate and run the results report on fewer examples")
    _add_model(p)
    _add_eval_options(p, examples=DEMO_SIZES.fidelity_examples, prefix_len=DEMO_SIZES.prefix_len)
    # The demo is `ripplekv report` on fewer examples (eval/report.py DEMO_SIZES): the same 2K-token prompts, where
    # the bundled model solves passkey and the needle test with the full cache and the methods' KL differ clearly.
    # --tasks picks among the report's parts; --length sets the passkey and needle lengths.
    p.set_defaults(tasks=list(DEMO_PARTS), methods=list(DEMO_SIZES.methods), retentions=list(DEMO_SIZES.retentions),
                   cont_len=DEMO_SIZES.cont_len, text=",".join(DEMO_SIZES.texts))
    p.add_argument("--reprofile", action="store_true", help="measure the profile again even if one is cached")
    p.set_defaults(func=cmd_demo)
    return parser
