"""The `ripplekv` command line (also `python -m ripplekv_ext`): see ``parser.DESCRIPTION`` or `ripplekv --help`.

``parser`` builds the arguments; ``profiling`` (profile, allocate, diagnose) and ``evaluation`` (eval, demo) hold
the commands; ``common`` what they share. Models and profile paths come from ``ripplekv_ext.eval.models``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]

BENCH_MOVED = ("ripplekv bench: the end-to-end benchmarks are not installed with the package; run "
               "`python bench/e2e_bench.py --help` from a source checkout of ripplekv_ext")


def main(argv=None) -> int:
    from ripplekv_ext.cli.common import CliError
    from ripplekv_ext.cli.parser import build_parser
    from ripplekv_ext.profile_file import ProfileError

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ProfileError, FileNotFoundError, ValueError) as err:
        if os.environ.get("RIPPLEKV_DEBUG"):
            raise
        print(f"ripplekv {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nripplekv {args.command}: interrupted; finished results are saved and a rerun resumes",
              file=sys.stderr)
        return 130
