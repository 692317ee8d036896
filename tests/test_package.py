"""The package's shape: `import ripplekv_ext` is the core library only, and exports what its docstrings use."""

import subprocess
import sys

HEAVY = ("transformers", "matplotlib", "rich", "scipy", "ripplekv_ref", "ripplekv_ext.eval", "ripplekv_ext.cli",
         "ripplekv_ext.engines", "ripplekv_ext.integrations.transformers", "ripplekv_ext.profiler")


def test_import_loads_no_evaluation_plotting_table_or_reference_module(tmp_path):
    # A fresh interpreter: this test process has imported all of them already. It starts in an empty folder, so it
    # imports the ripplekv_ext this test run tests (installed or editable), not a source tree that `-c` would put
    # first on sys.path from the current folder.
    code = ("import sys, ripplekv_ext; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == ""


def test_core_exports():
    import ripplekv_ext
    from ripplekv_ext.budgets.allocators import PyramidKVAllocator, RippleKVAllocator, UniformAllocator

    assert ripplekv_ext.UniformAllocator is UniformAllocator
    assert ripplekv_ext.PyramidKVAllocator is PyramidKVAllocator
    assert ripplekv_ext.RippleKVAllocator is RippleKVAllocator
    for name in ripplekv_ext.__all__:
        assert hasattr(ripplekv_ext, name), name


def test_named_methods_are_the_policy_constructors():
    from ripplekv_ext import Policy
    from ripplekv_ext.methods import DEFAULT_METHODS, make_policy

    assert DEFAULT_METHODS == ("full", "streamingllm", "h2o", "snapkv", "pyramidkv", "ripplekv", "cake")
    profile = [1.0, 2.0, 3.0]
    assert make_policy("full", 0.2) == Policy.full()
    for name in DEFAULT_METHODS[1:]:
        expected = getattr(Policy, name)(*([profile] if name == "ripplekv" else []), 0.2)
        got = make_policy(name, 0.2, profile)
        assert got.name == expected.name and type(got.selector) is type(expected.selector)
    assert make_policy("ripplekv+h2o", 0.3, profile).name == "ripplekv+h2o@0.3"


def test_renamed_modules_name_their_new_place():
    import importlib

    import pytest

    for old, new in (("hook", "transformers_front.compress_block"), ("rolling", "transformers_front.bounded_prefill"),
                     ("_jsonio", "jsonio")):
        with pytest.raises(ModuleNotFoundError, match=f"'ripplekv_ext.{old}': it was renamed ripplekv_ext.{new}"):
            importlib.import_module(f"ripplekv_ext.{old}")
        importlib.import_module(f"ripplekv_ext.{new}")
    # A module that never existed keeps Python's own message.
    with pytest.raises(ModuleNotFoundError, match="^No module named 'ripplekv_ext.nothing_here'$"):
        importlib.import_module("ripplekv_ext.nothing_here")


def test_moved_modules_still_import_from_their_old_names_with_a_warning():
    import importlib
    import sys

    import pytest

    import ripplekv_ext
    from ripplekv_ext import MOVED_MODULES

    for old, places in MOVED_MODULES.items():
        sys.modules.pop(old, None)
        with pytest.warns(FutureWarning, match=f"^{old} moved to {' and '.join(places)}; the old name goes"):
            alias = importlib.import_module(old)
        for place in places:
            moved = importlib.import_module(place)
            public = getattr(moved, "__all__", [name for name in vars(moved) if not name.startswith("_")])
            assert public and all(getattr(alias, name) is getattr(moved, name) for name in public)
    # The two halves of CAKE under its old name, as the release before the wings had them.
    from ripplekv_ext.cake import CakeAllocator, CakeSelector, cake_budgets, eviction_scores  # noqa: F401
    assert (CakeAllocator, CakeSelector) == (ripplekv_ext.CakeAllocator, ripplekv_ext.CakeSelector)


def test_a_method_that_is_not_a_name_is_refused_by_type():
    import pytest

    from ripplekv_ext.methods import make_policy

    with pytest.raises(TypeError, match="method must be a method name like 'snapkv' .* got NoneType: None"):
        make_policy(None, 0.2)
