"""Modules the package renamed: importing an old name fails with the new one named, not a bare ModuleNotFoundError.

The finder is consulted last (after every real one), so it never shadows a module that exists."""

from __future__ import annotations

import importlib.abc
import sys

# old module -> where its contents went
RENAMED = {
    "ripplekv_ext.hook": "ripplekv_ext.compress_block (compress: also ripplekv_ext.compress)",
    "ripplekv_ext.rolling": "ripplekv_ext.bounded_prefill",
    "ripplekv_ext._jsonio": "ripplekv_ext.jsonio",
}


class RenamedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in RENAMED:
            raise ModuleNotFoundError(f"No module named {name!r}: it was renamed {RENAMED[name]}", name=name)
        return None


def install_renamed_module_finder() -> None:
    if not any(isinstance(finder, RenamedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(RenamedModuleFinder())
