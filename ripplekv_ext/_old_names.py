"""The package's old module names: a renamed module's old name fails with the new one named; a module moved into a
wing still imports under its old name, with a FutureWarning naming the new place, until the next release."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED_MODULES", "RENAMED_MODULES", "install_old_module_names"]

RENAMED_MODULES = {
    "ripplekv_ext.hook": "ripplekv_ext.transformers_front.compress_block (compress: also ripplekv_ext.compress)",
    "ripplekv_ext.rolling": "ripplekv_ext.transformers_front.bounded_prefill",
    "ripplekv_ext._jsonio": "ripplekv_ext.jsonio",
}
MOVED_MODULES = {
    "ripplekv_ext.allocation": ("ripplekv_ext.budgets.allocators",),
    "ripplekv_ext.tiers": ("ripplekv_ext.budgets.tiers",),
    "ripplekv_ext.profile_file": ("ripplekv_ext.budgets.profile_file",),
    "ripplekv_ext.cake": ("ripplekv_ext.budgets.cake", "ripplekv_ext.selection.cake"),
    "ripplekv_ext.selectors": ("ripplekv_ext.selection.selectors",),
    "ripplekv_ext.headwise": ("ripplekv_ext.selection.adakv",),
    "ripplekv_ext.compressor": ("ripplekv_ext.selection.compressor",),
    "ripplekv_ext.compress_block": ("ripplekv_ext.transformers_front.compress_block",),
    "ripplekv_ext.bounded_prefill": ("ripplekv_ext.transformers_front.bounded_prefill",),
    "ripplekv_ext.context": ("ripplekv_ext.transformers_front.context",),
    "ripplekv_ext.context_stamp": ("ripplekv_ext.transformers_front.context_stamp",),
    "ripplekv_ext.masks": ("ripplekv_ext.transformers_front.masks",),
    "ripplekv_ext.digests": ("ripplekv_ext.transformers_front.digests",),
    "ripplekv_ext.stats": ("ripplekv_ext.profiler.stats",),
}


class _OldModuleNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in RENAMED_MODULES:
            raise ModuleNotFoundError(f"No module named {name!r}: it was renamed {RENAMED_MODULES[name]}", name=name)
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        places = MOVED_MODULES[module.__name__]
        warnings.warn(f"{module.__name__} moved to {' and '.join(places)}; the old name goes in the next release",
                      FutureWarning, stacklevel=2)
        for place in places:
            moved = importlib.import_module(place)
            module.__dict__.update({key: value for key, value in vars(moved).items() if not key.startswith("__")})




def install_old_module_names() -> None:
    """One finder, consulted after every real one, so it never shadows a module that exists."""
    if not any(isinstance(finder, _OldModuleNames) for finder in sys.meta_path):
        sys.meta_path.append(_OldModuleNames())
