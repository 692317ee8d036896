"""The `ripplekv` command line (also `python -m ripplekv_ext`): see ``parser.DESCRIPTION`` or `ripplekv --help`.

``parser`` builds the arguments; ``profiling`` (profile, allocate, diagnose) and ``evaluation`` (eval, demo) hold
the commands; ``common`` what they share. Models and profile paths come from ``ripplekv_ext.eval.models``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]



def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 3 else lines[0]


def main(argv=None) -> int:
    from ripplekv_ext.cli.common import CliError
    from ripplekv_ext.cli.parser import build_parser
    from ripplekv_ext.budgets.profile_file import ProfileError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # a bad argument (2, reported in one line) or --help (0)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return args.func(args)
    except (CliError, ProfileError, OSError, ValueError) as err:
        # OSError: a file that vanished or a disk that filled up mid-run; the checks before the model loads
        # catch what can be known in advance. RIPPLEKV_DEBUG=1 shows the traceback.
        if os.environ.get("RIPPLEKV_DEBUG"):
            raise
        print(f"ripplekv {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nripplekv {args.command}: interrupted; finished results are saved and a rerun resumes",
              file=sys.stderr)
        return 130
