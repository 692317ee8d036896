"""The partial file: an unfinished profiling run's per-example results, saved after every example so an
interrupted run with the same settings resumes from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.budgets.profile_file import ProfileError

PARTIAL_SUFFIX = ".partial.json"
# How to start over, in both spellings: the CLI's flag and profile_model's argument.
_START_OVER = "delete it or pass --no-resume (resume=False) to start over"


def partial_path(out_path) -> Path:
    """Where the run that writes the profile `out_path` keeps its progress."""
    return Path(str(out_path) + PARTIAL_SUFFIX)


def save_partial(path: Path, run_key: dict, per_example: list, reused: list, seconds: float) -> None:
    """Write the progress so far (atomically: an interruption leaves the previous file or this one)."""
    write_json_atomic(path, {"run_key": run_key, "per_example": per_example, "reused": reused, "seconds": seconds})


def load_partial(path: Path, run_key: dict):
    """(per-example KLs, reuse flags, seconds) saved by an interrupted run with the same settings.

    Everything in the file is checked before it is trusted: a file edited or damaged by hand would otherwise
    resume, and fail only when the finished profile is saved (or worse, be averaged into it).
    """
    def refuse(problem: str):
        raise ProfileError(f"partial profile {path} {problem}; {_START_OVER}")

    try:
        # NaN / Infinity are not JSON (Python would accept them): a KL is a finite number.
        data = json.loads(path.read_text(encoding="utf-8"),
                          parse_constant=lambda c: refuse(f"holds {c}, not a finite number"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        refuse(f"is unreadable ({e})")
    if not isinstance(data, dict):
        refuse("is not a JSON object")
    if data.get("run_key") != json.loads(json.dumps(run_key)):
        refuse("was made with other settings or another model")
    per_example, reused, seconds = data.get("per_example"), data.get("reused"), data.get("seconds", 0.0)
    n_layers = len(run_key["layers"])
    if not isinstance(per_example, list) or not all(
            isinstance(row, list) and len(row) == n_layers and
            all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in row)
            for row in per_example):
        refuse(f"per_example must be rows of {n_layers} finite KLs >= 0")
    if not isinstance(reused, list) or len(reused) != len(per_example) or \
            not all(isinstance(r, bool) for r in reused):
        refuse("reused must hold one true/false per example")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        refuse("seconds must be a finite number >= 0")
    return per_example, reused, float(seconds)
