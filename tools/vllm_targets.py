"""Where the vLLM internals the plugin relies on (``ripplekv_ext.engines.vllm.patches.TARGETS``) stand in a vLLM
source tree, read statically (nothing is imported, so any release's wheel can be read on any machine):

    pip download --no-deps vllm==0.34.0 -d /tmp/v && unzip -q /tmp/v/*.whl 'vllm/*' -d /tmp/v
    python tools/vllm_targets.py /tmp/v

prints one line per target: ``same``, other parameters, or where the name is gone. A method is looked up through
the base classes its module defines or imports, as Python would.
"""

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def targets(patches: Path = ROOT / "ripplekv_ext" / "engines" / "vllm" / "patches.py") -> list[tuple[str, tuple]]:
    """(path, parameters) of each ``Target(...)`` in the plugin's table, read from its source."""
    return [(node.args[0].value, tuple(e.value for e in node.args[1].elts))
            for node in ast.walk(ast.parse(patches.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Target" and len(node.args) >= 2]


def _module_file(tree_root: Path, module: str):
    base = tree_root.joinpath(*module.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def _parameters(function: ast.FunctionDef) -> tuple:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    # A classmethod read through its class is bound: Python's signature leaves cls out.
    return tuple(names[1:] if any(getattr(d, "id", None) == "classmethod" for d in function.decorator_list)
                 else names)


def find(tree_root: Path, module: str, parts: list[str]):
    """The parameters of ``module:parts`` in the tree, or a sentence saying what is gone."""
    path = _module_file(tree_root, module)
    if path is None:
        return f"module {module} is gone"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == parts[0]:
            if len(parts) == 1:
                return "a class" if isinstance(node, ast.ClassDef) else _parameters(node)
            if isinstance(node, ast.ClassDef):
                return _member(tree_root, module, node, parts[1:])
    for node in tree.body:  # imported into the module: follow it
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == parts[0]:
                    return find(tree_root, node.module, [alias.name] + parts[1:])
    return f"{module}:{'.'.join(parts)} is gone"


def _member(tree_root: Path, module: str, cls: ast.ClassDef, parts: list[str]):
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == parts[0]:
            return _parameters(node)
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        found = find(tree_root, module, [name] + parts) if name else None
        if isinstance(found, tuple):
            return found
    return f"{cls.name}.{parts[0]} is gone"


def report(tree_root: Path) -> dict[str, str]:
    """Each target's path -> ``same``, ``parameters (...)`` or what is gone."""
    out = {}
    for path, parameters in targets():
        module, _, qualified = path.partition(":")
        found = find(tree_root, module, qualified.split("."))
        out[path] = "same" if found == parameters else (f"parameters {found}" if isinstance(found, tuple) else found)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path, help="a folder holding vllm/ (site-packages, or an unpacked wheel)")
    args = parser.parse_args(argv)
    if not (args.tree / "vllm").is_dir():
        parser.error(f"{args.tree} holds no vllm/ folder")
    for path, status in report(args.tree).items():
        print(f"{path}: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
