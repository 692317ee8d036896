"""How committed results name files: never by a machine's absolute path."""

from __future__ import annotations

from pathlib import Path

__all__ = ["portable_path"]

CHECKOUT = Path(__file__).resolve().parents[1]


def portable_path(path) -> str:
    """``path`` as a committed result records it: relative to the checkout, from the package for a file inside an
    installed ripplekv_ext, under ``~`` for one in the home folder, else its name (no machine's absolute path)."""
    path = Path(path).expanduser().resolve()
    parts = path.parts
    if path.is_relative_to(CHECKOUT):
        return str(path.relative_to(CHECKOUT))
    if "site-packages" in parts:
        return str(Path(*parts[parts.index("site-packages") + 1:]))
    if path.is_relative_to(Path.home()):
        return str(Path("~") / path.relative_to(Path.home()))
    return path.name
