"""The source tree's shape: one integration touches transformers, imported by plain imports; no import cycles, no
private reach-ins, small modules.

These read the sources (ast and text), so they run from a source checkout only.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ripplekv_ext"
DOOR = PACKAGE / "integrations" / "transformers"
if not (PACKAGE / "__init__.py").is_file() or not (ROOT / "bench").is_dir():
    pytest.skip("needs the source checkout", allow_module_level=True)

PACKAGE_FILES = sorted(PACKAGE.rglob("*.py"))
BENCH_FILES = sorted((ROOT / "bench").glob("*.py"))
# The lab: each decision experiment's script, results and note under experiments/<topic>/.
EXPERIMENTS = ROOT / "experiments"
EXPERIMENT_FILES = sorted(EXPERIMENTS.rglob("*.py"))
TEST_FILES = sorted((ROOT / "tests").rglob("*.py"))


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# What only the transformers integration may touch: transformers' private attention and cache plumbing.
DOOR_ONLY = ("_attn_implementation_internal", "cache.layers[", ".forward =", "PagedAttentionCache", "_global_mapping")


@pytest.mark.parametrize("needle", DOOR_ONLY)
def test_transformers_internals_are_touched_only_by_the_integration(needle):
    found = [f"{_relative(path)}:{number}" for path in PACKAGE_FILES + BENCH_FILES + EXPERIMENT_FILES
             if DOOR not in path.parents
             for number, line in enumerate(path.read_text().splitlines(), 1) if needle in line]
    assert found == []


def test_the_checks_above_can_fail():
    # The integration itself holds each of them: the needles are spelled as the code spells them.
    door_text = "\n".join(path.read_text() for path in DOOR.rglob("*.py"))
    assert [needle for needle in DOOR_ONLY if needle not in door_text] == []


# The compiled library is a module too (no .py file).
MODULES = {_module_name(path) for path in PACKAGE_FILES} | {"ripplekv_ext._C"}


def _imports(path: Path) -> set[str]:
    """The ripplekv_ext modules ``path`` imports, at its top or inside functions. ``from package import module``
    imports that module (the package's ``__init__`` runs first either way: Python's initialisation, not a use of
    the package's namespace)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ripplekv_ext"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in MODULES else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("ripplekv_ext"))
    return names


def _import_graph() -> dict[str, set[str]]:
    return {_module_name(path): {dep for dep in _imports(path) if dep in MODULES and dep != _module_name(path)}
            for path in PACKAGE_FILES}


def test_no_import_cycle_between_modules():
    graph, state, cycles = _import_graph(), {}, []

    def visit(module, trail):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(trail[trail.index(dep):] + [dep]))
            elif dep not in state and dep in graph:
                visit(dep, trail + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_transformers_integration_is_imported_when_used_by_plain_imports():
    """Functions that need transformers import its integration when they are called (so ``import ripplekv_ext``
    loads no transformers), with import statements every reader and the checks above follow: none at a module's top
    outside the integration, and no module of the package imported by name at run time."""
    seam = "ripplekv_ext.integrations.transformers"
    at_top, by_name = [], []
    for path in PACKAGE_FILES:
        if DOOR in path.parents:
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and ((node.module or "").startswith(seam) or (
                    node.module == "ripplekv_ext.integrations" and any(a.name == "transformers" for a in node.names))):
                at_top.append(f"{_relative(path)}:{node.lineno}")
        for node in ast.walk(tree):
            called = getattr(node.func, "attr", getattr(node.func, "id", None)) if isinstance(node, ast.Call) else None
            if called in ("import_module", "__import__") and any(
                    isinstance(a, ast.Constant) and str(a.value).startswith("ripplekv_ext") for a in node.args):
                by_name.append(f"{_relative(path)}:{node.lineno}")
    assert at_top == [] and by_name == []


def test_core_imports_neither_eval_cli_nor_engines():
    outside = ("ripplekv_ext.eval", "ripplekv_ext.cli", "ripplekv_ext.engines")
    # `python -m ripplekv_ext` runs the command line: __main__ is the CLI's entry, not the core.
    core = [path for path in PACKAGE_FILES if not _module_name(path).startswith(outside + ("ripplekv_ext.__main__",))]
    found = {_relative(path): sorted(dep for dep in _imports(path) if dep.startswith(outside)) for path in core}
    assert {path: deps for path, deps in found.items() if deps} == {}


# Where a framework's private attributes may be read and set: its integration (an engine plugin is one too).
FRAMEWORK_DOORS = (PACKAGE / "integrations", PACKAGE / "engines" / "vllm")


def _outside_the_door(paths) -> list[Path]:
    return [path for path in paths if not any(door in path.parents for door in FRAMEWORK_DOORS)]


def _private_names_defined_here() -> set[str]:
    """Private attributes and methods the package's own classes define (``self._x = ...``, ``def _x``)."""
    names = set()
    for path in _outside_the_door(PACKAGE_FILES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
                  and not node.attr.startswith("__")):
                names.add(node.attr)
    return names


# What a policy is built of: a dict whose values construct one (not read from methods.py's tables) is a table of
# methods.
POLICY_PARTS = re.compile(r"\bPolicy\b|Allocator\b|Selector\b")


def _method_tables(path: Path) -> list[str]:
    """Dict literals of ``path`` mapping two or more method names to policies, allocators or selectors."""
    from ripplekv_ext.methods import ALLOCATORS, DEFAULT_METHODS, SELECTORS

    names = set(DEFAULT_METHODS) | set(ALLOCATORS) | set(SELECTORS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Dict):
            continue
        rows = [(key.value, value) for key, value in zip(node.keys, node.values)
                if isinstance(key, ast.Constant) and key.value in names]
        if len(rows) >= 2 and any(POLICY_PARTS.search(ast.unparse(value)) for _, value in rows):
            found.append(f"{_relative(path)}:{node.lineno} {sorted(name for name, _ in rows)}")
    return found


def test_one_method_table():
    """A method name becomes a policy in ``methods.py`` only (``make_policy``): the package and the benchmarks read
    it. (Tests walk their own sample policies; the lab builds the variants it compares.)"""
    tables = [table for path in PACKAGE_FILES + BENCH_FILES if path != PACKAGE / "methods.py"
              for table in _method_tables(path)]
    assert tables == []
    assert _method_tables(PACKAGE / "methods.py")  # the check finds the one table


def test_no_private_reach_ins_in_the_package_or_benchmarks():
    private = _private_names_defined_here()
    found = []
    for path in _outside_the_door(PACKAGE_FILES) + BENCH_FILES + EXPERIMENT_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ripplekv_ext"):
                found += [f"{_relative(path)}:{node.lineno} from {node.module} import {alias.name}"
                          for alias in node.names if alias.name.startswith("_") and alias.name != "_C"]
            elif (isinstance(node, ast.Attribute) and node.attr in private
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{_relative(path)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_private_names_stay_in_their_module_and_private_modules_in_their_package():
    """Nothing imports another module's ``_name`` (bench, experiments and tests share public helpers), and a private
    module (``ops/_args.py``, ``_library.py``) is imported only from inside its own package. ``_C``, the compiled
    library, is the one exception: test_library.py checks it directly."""
    ours = {path.stem for path in BENCH_FILES + EXPERIMENT_FILES + TEST_FILES}  # modules imported by their file name
    found = []
    for path in PACKAGE_FILES + BENCH_FILES + EXPERIMENT_FILES + TEST_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                if top not in ("ripplekv_ext", "ripplekv_ref") and top not in ours:
                    continue  # another project's privates are its integration's business (test_layout's doors)
                modules, names = [node.module], [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names
                           if alias.name.split(".")[0] in ("ripplekv_ext", "ripplekv_ref")]
                names = []
            else:
                continue
            found += [f"{_relative(path)}:{node.lineno} imports {name}" for name in names
                      if name.startswith("_") and not name.startswith("__") and name != "_C"]
            for module in modules:
                parts = module.split(".")
                for depth, part in enumerate(parts):
                    if part.startswith("_") and not part.startswith("__"):
                        home = ROOT.joinpath(*parts[:depth])
                        if home not in path.parents:
                            found.append(f"{_relative(path)}:{node.lineno} imports {module}")
    assert found == []


def test_the_product_benchmarks_and_tests_never_import_the_lab():
    """The lab (experiments/) may use the package and bench's public helpers; nothing outside it imports a lab
    module (a finding that decides a default is stated in the package as a constant, with a link to the lab)."""
    lab = {path.stem for path in EXPERIMENT_FILES} - {"conftest"}
    outside = {path.stem for path in PACKAGE_FILES + BENCH_FILES + TEST_FILES}
    assert lab & outside == set()  # a lab module named like another would hide from the check below
    found = []
    for path in PACKAGE_FILES + BENCH_FILES + TEST_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                       else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{_relative(path)}:{node.lineno} imports {module}" for module in modules
                      if module.split(".")[0] in lab | {"experiments"}]
    assert found == []


# tests/ holds one folder per subsystem; at its top only the checks of the repository as a whole and the helpers
# that tests of several folders share.
TEST_FOLDERS = {"ops", "budgets", "selection", "profiler", "transformers_front", "integrations", "engines", "eval",
                "soak", "cpp"}
TOP_LEVEL_TESTS = {"conftest.py", "devices.py", "api_tables.py", "policy_samples.py", "test_layout.py", "test_docs.py",
                   "test_package.py", "test_build_config.py"}


def test_tests_live_in_their_subsystem_folder():
    top = {path.name for path in (ROOT / "tests").iterdir() if path.name != "__pycache__"}
    assert top - TEST_FOLDERS - TOP_LEVEL_TESTS == set()


# The package's top level is its public face; everything else lives in a wing (a folder by what a reader looks for:
# budgets/, selection/, transformers_front/, profiler/, ops/, integrations/, engines/, eval/, cli/).
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "_library.py", "_old_names.py", "policies.py", "methods.py",
                     "checks.py", "jsonio.py", "equality.py", "model_info.py"}


def test_the_package_top_holds_its_public_face_only():
    top = {path.name for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL_MODULES


def test_no_package_module_over_400_lines():
    sizes = {_relative(path): len(path.read_text().splitlines()) for path in PACKAGE_FILES}
    assert {path: size for path, size in sizes.items() if size > 400} == {}


def test_no_module_level_getattr():
    found = [_relative(path) for path in PACKAGE_FILES
             if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
                    for node in ast.parse(path.read_text()).body)]
    assert found == []


def test_no_issue_numbers_in_code_tests_or_benchmarks():
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [f"{_relative(path)}:{number}" for path in PACKAGE_FILES + BENCH_FILES + EXPERIMENT_FILES + TEST_FILES
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def _absolute_paths(data) -> list[str]:
    if isinstance(data, dict):
        return [p for value in data.values() for p in _absolute_paths(value)]
    if isinstance(data, list):
        return [p for value in data for p in _absolute_paths(value)]
    return [data] if isinstance(data, str) and re.match(r"^/(work|root|home|tmp|Users|opt|usr|mnt|data)/", data) else []


def test_committed_results_record_no_machine_paths():
    # Results name files relative to the checkout (bench/e2e_paths.portable_path), not as on the machine they ran on.
    import json

    results = sorted((ROOT / "bench" / "results").rglob("*.json")) + sorted(EXPERIMENTS.rglob("results/**/*.json"))
    found = {_relative(path): paths for path in results if (paths := _absolute_paths(json.loads(path.read_text())))}
    assert found == {}
    assert _absolute_paths({"a": ["/root/.cache/x"], "b": "bench/results/y.json"}) == ["/root/.cache/x"]


def test_each_experiment_has_its_note():
    # A topic's README.md says what it decided and the command that reproduces it.
    topics = [path for path in sorted(EXPERIMENTS.iterdir()) if path.is_dir() and path.name != "__pycache__"]
    assert topics and [_relative(topic) for topic in topics if not (topic / "README.md").is_file()] == []
