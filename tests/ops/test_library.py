"""What the package reports about its own build, and how it fails when the build is unusable."""

import subprocess
import sys
import textwrap

import torch

import ripplekv_ext
from ripplekv_ext import _C


def _needed_libraries(so_path):
    out = subprocess.run(["readelf", "-d", so_path], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].split("]")[0] for line in out.splitlines() if "(NEEDED)" in line]


def test_cuda_built_matches_the_binary():
    # Independent of the build report: a library with CUDA kernels links torch's CUDA runtime.
    needed = _needed_libraries(_C.__file__)
    assert ripplekv_ext.cuda_built() == any(lib.startswith("libc10_cuda") for lib in needed)
    if ripplekv_ext.cuda_built():
        assert ripplekv_ext.cuda_version().split(".")[0] == torch.version.cuda.split(".")[0]


def test_build_report_lists_ops():
    report = ripplekv_ext.build_report()
    assert "gather_kv" in report and "gather_kv_into" in report
    assert ("CUDA kernels: yes" in report) == ripplekv_ext.cuda_built()


def _import_with_broken_C(error_text, folder):
    # A finder that makes ripplekv_ext._C fail to load, as a missing or ABI-broken .so would.
    code = textwrap.dedent(f"""
        import sys
        class Broken:
            def find_spec(self, name, path=None, target=None):
                if name == "ripplekv_ext._C":
                    raise ImportError({error_text!r})
        sys.meta_path.insert(0, Broken())
        import ripplekv_ext
    """)
    # From an empty folder, so the package under test is imported, not a source tree in the current folder.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=folder)


def test_missing_library_says_how_to_rebuild(tmp_path):
    result = _import_with_broken_C("undefined symbol: _ZN3c104cuda9SomeThingEv", tmp_path)
    assert result.returncode != 0
    assert "ripplekv_ext._C could not be loaded (undefined symbol" in result.stderr
    assert "make build" in result.stderr
    assert "does not exist" not in result.stderr


def test_cuda_build_carries_ptx_for_newer_gpus():
    # Without PTX no kernel image exists for GPUs newer than the newest listed architecture (sm_100, sm_120):
    # the default arch list ends in +PTX, as CMake's does.
    import shutil

    import pytest

    if not ripplekv_ext.cuda_built():
        pytest.skip("CPU-only build: no CUDA kernels to carry PTX")
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not on PATH")
    listing = subprocess.run([tool, "--list-ptx", _C.__file__], capture_output=True, text=True).stdout
    assert "ptx" in listing.lower(), "the CUDA build embeds no PTX"
