"""The project's JSON files: one atomic writer and one JSONL reader, used by every module that saves or reads.

Long runs (profiling, evaluation, benchmarks) rewrite their results after every step, and may be
interrupted at any moment: writing to a temporary file and renaming it means readers never see half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["write_json_atomic", "read_jsonl"]


def write_json_atomic(path, data) -> None:
    """Write JSON to a temporary file next to ``path``, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; results and profiles are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_jsonl(path, required: tuple[str, ...] = ()) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for each non-blank line of a JSONL file.

    Every record must be a JSON object holding the ``required`` fields; a bad line raises ValueError naming
    ``path:line``.
    """
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            missing = [key for key in required if key not in record]
            if missing:
                raise ValueError(f"{where}: missing field(s) {missing} (expected {', '.join(required)}; "
                                 f"got {sorted(record)})")
            yield line_number, record
