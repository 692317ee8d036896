"""`ripplekv report`: the results report (Markdown tables and PNG figures) of ``ripplekv_ext.eval.report``."""

from __future__ import annotations

import shlex
import time

from ripplekv_ext.cli.common import (CliError, check_model_arg, check_output_folder, check_profile,
                                     check_profile_model, check_text_source, load_model_checked, make_console)
from ripplekv_ext.eval.models import default_profile_path, shipped_profile_path


def known_profile(model_arg: str, model, log=print, reprofile: bool = False):
    """The profile measured earlier on this very model (checked by fingerprint), or None: the user's cached one
    first, then the one that ships with the package (the bundled SmolLM2's)."""
    from ripplekv_ext.budgets.profile_file import ProfileError, load_profile

    if reprofile:
        return None
    shipped = shipped_profile_path(model_arg)
    for candidate in [default_profile_path(model_arg)] + ([shipped] if shipped is not None else []):
        if not candidate.is_file():
            continue
        try:
            profile = load_profile(candidate, model=model)
            log(f"reusing the profile {candidate}")
            return profile
        except ProfileError as err:
            log(f"profile {candidate} unusable ({err})")
    return None


def report_sizes(args):
    from ripplekv_ext.eval.report import REPORT_SIZES, sizes_with

    if args.after_methods is None:  # the default's methods among those run
        after = tuple(m for m in REPORT_SIZES.after_methods if m in args.methods)
    else:
        after = tuple(args.after_methods)
        if any(m not in args.methods for m in after):
            raise CliError(f"--after-methods {','.join(m for m in after if m not in args.methods)}: not among "
                           f"--methods {','.join(args.methods)}; a method is asked after compression as well as "
                           "inside, so add it to --methods")
    try:
        return sizes_with(REPORT_SIZES, methods=tuple(args.methods), after_methods=after,
                          fidelity_methods=tuple(args.fidelity_methods),
                          retentions=tuple(args.retentions), task_retentions=tuple(args.task_retentions),
                          fidelity_examples=args.fidelity_examples, prefix_len=args.prefix_len,
                          cont_len=args.cont_len, passkey_length=args.passkey_length,
                          passkey_examples=args.passkey_examples, passkey_depths=args.passkey_depths,
                          needle_lengths=tuple(args.needle_lengths), needle_depths=tuple(args.needle_depths),
                          window=args.window, seed=args.seed, texts=tuple(args.text.split(",")))
    except ValueError as err:
        raise CliError(str(err)) from None


def check_report_sizes(sizes, parts) -> None:
    """Every prompt must be long enough to compress at the lowest retention (more than the window kept)."""
    import math

    checks = []
    if "fidelity" in parts:
        checks.append(("--prefix-len", sizes.prefix_len, min(sizes.retentions)))
    if "passkey" in parts or "passkey_text" in parts:
        checks.append(("--passkey-length", sizes.passkey_length, min(sizes.task_retentions)))
    if "needle" in parts:
        checks.append(("--needle-lengths", min(sizes.needle_lengths), min(sizes.task_retentions)))
    for option, length, retention in checks:
        shortest = math.ceil((sizes.window + 1) / retention)
        if length < shortest:
            raise CliError(f"{option} {length} is too short: retention {retention:g} with window {sizes.window} "
                           f"needs prompts of at least {shortest} tokens")


def command_line(args, sizes) -> str:
    """The command that reproduces this report, every size spelled out (quoted in report.md)."""
    def join(values):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)

    words = ["ripplekv", "report", "--model", args.model, "--parts", join(args.parts),
             "--methods", join(sizes.methods), *(["--after-methods", join(sizes.after_methods)]
                                                 if sizes.after_methods else []),
             "--fidelity-methods", join(sizes.fidelity_methods),
             "--retentions", join(sizes.retentions), "--task-retentions", join(sizes.task_retentions),
             "--fidelity-examples", str(sizes.fidelity_examples), "--prefix-len", str(sizes.prefix_len),
             "--cont-len", str(sizes.cont_len), "--passkey-length", str(sizes.passkey_length),
             "--passkey-examples", str(sizes.passkey_examples), "--passkey-depths", str(sizes.passkey_depths),
             "--needle-lengths", join(sizes.needle_lengths), "--needle-depths", join(sizes.needle_depths),
             "--window", str(sizes.window), "--seed", str(sizes.seed), "--text", ",".join(sizes.texts)]
    if args.profile:
        words += ["--profile", str(args.profile)]
    return " ".join(shlex.quote(w) for w in words)


def cmd_report(args) -> int:
    from ripplekv_ext.eval.report import run_report
    from ripplekv_ext.methods import needs_profile

    check_model_arg(args.model)
    for text in args.text.split(","):
        check_text_source("--text", text)
    sizes = report_sizes(args)
    check_report_sizes(sizes, args.parts)
    out_dir = check_output_folder("--out-dir", args.out_dir)
    # Only the methods of the chosen parts: a profile that none of them uses is not read, let alone checked.
    used = (sizes.fidelity_methods if "fidelity" in args.parts else ()) + \
        (sizes.methods if any(part != "fidelity" for part in args.parts) else ())
    wants_profile = any(needs_profile(m) for m in used)
    profile = check_profile(args) if wants_profile and args.profile else None
    if wants_profile and not args.profile and not (default_profile_path(args.model).is_file()
                                                   or shipped_profile_path(args.model) is not None):
        raise CliError(f"no profile for {args.model}: run `ripplekv profile --model {args.model}` first, or pass "
                       "--profile FILE")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    console = make_console()
    if args.profile and not wants_profile:
        console.print(f"--profile {args.profile} is not used: no method of the parts {','.join(args.parts)} "
                      "allocates with ripplekv")
    model, tokenizer, name = load_model_checked(args.model)
    if profile is not None:
        check_profile_model(profile, model, args)
    elif wants_profile:
        profile = known_profile(args.model, model, log=console.print)
        if profile is None:
            raise CliError(f"no usable profile for {args.model}: run `ripplekv profile --model {args.model}`")
    path = run_report(model, tokenizer, name, profile, out_dir, sizes, parts=args.parts,
                      command=command_line(args, sizes), log=console.print)
    console.print(f"report finished in {(time.perf_counter() - start) / 60:.1f} min: {path}")
    return 0
