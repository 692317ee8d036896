"""What every `ripplekv` command shares: the error it reports in one line, the console, the results folder, and
the checks that run before a model loads (so a typo costs a second, not a model load and a profiling run)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

RESULTS_DIR = Path("ripplekv-results")


class CliError(Exception):
    """A problem with what the user asked for: reported as one line, no traceback."""


# ---- checks before a model loads ---------------------------------------------------------------------

def check_output_folder(option: str, folder, way_out: str | None = None) -> Path:
    """Create ``folder`` if needed and prove it can be written (a probe file), or raise naming ``option``.

    Run before any work, so a run never finishes only to fail at saving its results.
    """
    folder = Path(folder).expanduser()
    way_out = way_out or f"pass another {option}"
    for parent in [folder, *folder.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise CliError(f"{option} {folder}: {parent} is a file, not a folder; {way_out}")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ripplekv-write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise CliError(f"{option} {folder} cannot be written ({err.strerror or err}); {way_out}") from None
    return folder


def check_output_file(option: str, path, way_out: str | None = None) -> Path:
    """``path`` must name a file (not a folder) in a writable folder, or raise naming ``option``."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise CliError(f"{option} {path} is a folder; give a file path (such as {path / 'NAME.json'})")
    check_output_folder(option, path.parent, way_out)
    return path


def check_text_source(option: str, source) -> None:
    """A text source (``kjv`` or ``essays``, with a split ``:calibration`` / ``:evaluation``, or a file) must exist."""
    if source is None or source in ("kjv", "kjv:calibration", "kjv:evaluation", "essays", "essays:calibration",
                                    "essays:evaluation"):
        return
    for corpus in ("kjv", "essays"):
        if source.startswith(corpus + ":"):
            raise CliError(f"{option} {source!r}: the bundled text's splits are {corpus}:calibration and "
                           f"{corpus}:evaluation")
    path = Path(source).expanduser()
    if not path.is_file():
        raise CliError(f"{option} {source!r} is not a file: pass kjv, kjv:evaluation, essays:evaluation or a "
                       ".txt / .jsonl file")
    try:
        with path.open(encoding="utf-8") as f:
            f.read(1 << 20)  # the start: a binary file shows here, before any model loads
    except UnicodeDecodeError as err:
        raise CliError(f"{option} {source}: not a UTF-8 text file (byte {err.start} is {err.object[err.start]:#04x}); "
                       "pass a .txt or .jsonl file of text") from None


def check_model_arg(model_arg: str) -> None:
    """``--model`` must be the bundled model or a folder whose config.json is a JSON object naming a model type."""
    from ripplekv_ext.eval.models import GGUF_MODELS, model_arg_usage

    if model_arg in GGUF_MODELS:
        return
    usage = model_arg_usage()
    config = Path(model_arg).expanduser() / "config.json"
    if not config.is_file():
        raise CliError(f"{usage}, got {model_arg!r}")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CliError(f"--model {model_arg}: {config} is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise CliError(f"--model {model_arg}: {config} names no model_type; it is not a transformers model config")


def load_model_checked(model_arg: str):
    """``eval.models.load_model`` with transformers' loading errors (unknown architecture, missing weights or
    tokenizer) reported as one line naming ``--model``."""
    from ripplekv_ext.eval.models import load_model

    check_model_arg(model_arg)
    try:
        return load_model(model_arg)
    except (OSError, ValueError, KeyError) as err:
        first_line = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise CliError(f"--model {model_arg} cannot be loaded: {first_line}") from None


def profile_path(args) -> Path:
    """The profile a command reads: --profile, else the model's cached one."""
    from ripplekv_ext.eval.models import default_profile_path

    return Path(args.profile).expanduser() if args.profile else default_profile_path(args.model)


def _other_model_way_out(model_arg: str) -> str:
    return (f"pass a profile of {model_arg} (`ripplekv profile --model {model_arg}` measures one), or --force to "
            "use this one anyway")


def check_profile(args):
    """The profile the command will use: it must exist, be a valid profile file, and (unless --force) be of the
    layer count and attention shape of --model, known from its config or ``GGUF_MODELS`` without loading weights.
    The weight fingerprint needs the weights: ``check_profile_model`` after the load."""
    from ripplekv_ext.eval.models import known_shape
    from ripplekv_ext.budgets.profile_file import ProfileError, load_profile

    path = profile_path(args)
    if path.is_dir():
        raise CliError(f"--profile {path} is a folder: pass the profile's JSON file (`ripplekv profile --model "
                       f"{args.model} --out {path / 'profile.json'}` writes one there)")
    measure = f"ripplekv profile --model {args.model}{f' --out {path}' if args.profile else ''}"
    if not path.is_file():
        raise CliError(f"no profile at {path}: run `{measure}` first, or pass --profile FILE")
    try:
        profile = load_profile(path)
    except ProfileError as err:
        raise CliError(f"{err}; run `{measure}` to measure it again, or pass another --profile FILE") from None
    shape = known_shape(args.model)
    if shape is not None:
        try:
            profile.check_shape(shape, force=args.force, way_out=_other_model_way_out(args.model))
        except ProfileError as err:
            raise CliError(f"{path}: {err}") from None
    return profile


# ---- after the model loads ---------------------------------------------------------------------------

def check_profile_model(profile, model, args):
    """``profile`` (from ``check_profile``) checked against the loaded model's weights, unless --force."""
    from ripplekv_ext.budgets.profile_file import ProfileError

    try:
        profile.check_model(model, force=args.force, way_out=_other_model_way_out(args.model))
    except ProfileError as err:
        raise CliError(f"{profile_path(args)}: {err}") from None
    return profile


def make_console():
    from rich.console import Console

    # Piped output (logs, CI) would otherwise be cut to 80 columns and truncate method names.
    return Console(width=None if sys.stdout.isatty() else 120)
