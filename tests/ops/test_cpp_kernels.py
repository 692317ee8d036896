"""Compiles and runs the torch-free C++ kernel tests in tests/cpp with the system compiler.

This keeps include/ripplekv/ honest about needing nothing but a C++17 compiler; `make cpp-test`
runs the same tests through CMake/ctest.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPP_TESTS = sorted((ROOT / "tests" / "cpp").glob("test_*.cpp"))


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on PATH")
@pytest.mark.parametrize("source", CPP_TESTS, ids=lambda p: p.stem)
def test_cpp_kernel(source, tmp_path):
    binary = tmp_path / source.stem
    subprocess.run(["c++", "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'include'}", str(source),
                    "-o", str(binary)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
