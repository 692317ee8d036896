"""What every `ripplekv` command shares: the error it reports in one line, the console, the results folder."""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS_DIR = Path("ripplekv-results")


class CliError(Exception):
    """A problem with what the user asked for: reported as one line, no traceback."""


def load_profile_for(model, path, force: bool = False):
    from ripplekv_ext.profile_file import load_profile

    if not Path(path).is_file():
        raise CliError(f"no profile at {path}: run `ripplekv profile` first (or pass --profile)")
    return load_profile(path, model=model, force=force)


def make_console():
    from rich.console import Console

    # Piped output (logs, CI) would otherwise be cut to 80 columns and truncate method names.
    return Console(width=None if sys.stdout.isatty() else 120)
