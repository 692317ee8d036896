"""The build's CUDA toolkit pairing (tools/cuda_env.py): which nvcc / torch CUDA versions build, and headers taken
from torch's nvidia wheels only where the toolkit lacks them; the source distribution carries every source the
build compiles."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import ripplekv_ext

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from cuda_env import find_cuda_toolkit, nvidia_wheel_dirs, toolkit_gap_headers, version_pairing  # noqa: E402


@pytest.mark.parametrize("torch_cuda, nvcc, works", [
    ("13.0", (13, 0), True), ("13.2", (13, 0), True), ("13.0", (13, 2), True),
    ("12.8", (13, 0), False), ("13.0", (12, 9), False),
])
def test_version_pairing(torch_cuda, nvcc, works):
    ok, sentence = version_pairing(torch_cuda, nvcc)
    assert ok == works
    assert torch_cuda in sentence and f"{nvcc[0]}.{nvcc[1]}" in sentence
    # The report says "both" only for an exact pairing, never for one that merely shares a major version.
    assert ("both CUDA" in sentence) == (torch_cuda == f"{nvcc[0]}.{nvcc[1]}")


def _setup_module():
    spec = importlib.util.spec_from_file_location("ripplekv_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the functions; main() runs only as __main__
    return module


@pytest.mark.parametrize("config, version, torch_pin", [
    ({"torch": "2.15.0+cu132", "with_cuda": True, "nvcc": (13, 0)}, "+cu13.torch2.15", "torch>=2.15,<2.16"),
    ({"torch": "2.15.0+cu132", "with_cuda": False, "nvcc": (13, 0)}, "+cpu.torch2.15", "torch>=2.15,<2.16"),
    ({"torch": "2.13.0+cpu", "with_cuda": False, "nvcc": None}, "+cpu.torch2.13", "torch>=2.13,<2.14"),
    ({"torch": "2.9.1", "with_cuda": True, "nvcc": (12, 8)}, "+cu12.torch2.9", "torch>=2.9,<2.10"),
])
def test_a_build_names_and_pins_its_torch(config, version, torch_pin):
    from packaging.requirements import Requirement
    from packaging.version import Version

    setup_py = _setup_module()
    built = Version(setup_py.build_version(config))
    assert str(built) == setup_py.BASE_VERSION + version == ripplekv_ext.__version__ + version
    assert built.public == ripplekv_ext.__version__
    (pin,) = [Requirement(r) for r in setup_py.build_requirements(config) if r.startswith("torch")]
    assert pin == Requirement(torch_pin)
    # Only that torch release satisfies it: the next minor and the previous one do not.
    major, minor = map(int, config["torch"].split(".")[:2])
    assert pin.specifier.contains(f"{major}.{minor}.7") and not pin.specifier.contains(f"{major}.{minor + 1}.0")
    assert not pin.specifier.contains(f"{major}.{minor - 1}.9")


def _tree(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"// {root.name}/{name}\n")


def test_gap_headers_take_only_what_the_toolkit_lacks(tmp_path):
    toolkit, wheel = tmp_path / "toolkit", tmp_path / "wheel" / "include"
    _tree(toolkit / "include", ["cuda_runtime.h", "cccl/cuda/std/version"])
    _tree(toolkit / "targets" / "x86_64-linux" / "include", ["crt/host_defines.h"])
    _tree(wheel, ["cuda_runtime.h", "cccl/cuda/std/version", "crt/host_defines.h", "cublas_v2.h", "cusparse.h",
                  "cusolver/common.h"])
    dest = tmp_path / "build" / "gaps"
    assert toolkit_gap_headers(toolkit, [wheel], dest) == [str(dest)]
    assert sorted(p.name for p in dest.iterdir()) == ["cublas_v2.h", "cusolver", "cusparse.h"]
    assert (dest / "cusolver" / "common.h").read_text() == "// include/cusolver/common.h\n"
    # Rebuilt from scratch each time: a header the toolkit gained since is no longer linked.
    _tree(toolkit / "include", ["cusparse.h"])
    toolkit_gap_headers(toolkit, [wheel], dest)
    assert sorted(p.name for p in dest.iterdir()) == ["cublas_v2.h", "cusolver"]
    # Nothing missing: no folder to add.
    assert toolkit_gap_headers(toolkit, [toolkit / "include"], tmp_path / "none") == []


def _wheel_and_toolkit():
    root, version = find_cuda_toolkit()
    if root is None or torch.version.cuda is None:
        pytest.skip("needs nvcc and a CUDA build of torch")
    include_dirs = nvidia_wheel_dirs(version[0])[0]
    if not include_dirs:
        pytest.skip("torch's CUDA headers come from the toolkit here (no nvidia wheels)")
    return root, version, include_dirs


def test_nvcc_compiles_cccl_and_cublas_with_the_gap_headers(tmp_path):
    # What the extension's .cu files need: the toolkit's CCCL (whose version check rejects another release's
    # runtime headers) and cuBLAS, which only the wheels carry on a minimal toolkit.
    root, version, include_dirs = _wheel_and_toolkit()
    source = tmp_path / "probe.cu"
    source.write_text("#include <cuda/std/cstdint>\n#include <cuda_runtime.h>\n#include <cublas_v2.h>\n"
                      "__global__ void k(cuda::std::int32_t* x) { *x = CUBLAS_VER_MAJOR; }\n")
    flags = [f"-I{d}" for d in toolkit_gap_headers(root, include_dirs, tmp_path / "gaps")]
    done = subprocess.run([str(Path(root) / "bin" / "nvcc"), "-std=c++17", "-c", str(source), "-o",
                           str(tmp_path / "probe.o"), *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_source_distribution_carries_every_kernel_source(tmp_path):
    # A pip install from the sdist compiles csrc/ and include/ on the user's machine: a header left out of
    # MANIFEST.in (csrc/cuda/cuda_types.cuh once was) breaks only the CUDA build there, never here.
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to list the tracked sources")
    tracked = subprocess.run(["git", "ls-files", "csrc", "include", "tools", "ripplekv_ext", "python", "setup.py",
                              "pyproject.toml", "MANIFEST.in", "README.md"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
    files = tracked.stdout.split()
    tree = tmp_path / "tree"
    for name in files:  # a copy, so the sdist's egg-info is not written into the checkout
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree, check=True,
                   capture_output=True, env={**os.environ, "RIPPLEKV_SKIP_EXTENSION": "1"})
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as sdist:
        carried = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    sources = [name for name in files if name.startswith(("csrc/", "include/"))]
    assert sources and [name for name in sources if name not in carried] == []


def test_every_package_folder_is_in_the_wheel():
    # setuptools installs only the packages pyproject.toml lists: a folder left out is missing from every wheel.
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "ripplekv_ext").rglob("__init__.py")}
    folders |= {".".join(init.parent.relative_to(ROOT / "python").parts)
                for init in (ROOT / "python" / "ripplekv_ref").rglob("__init__.py")}
    assert folders - listed == set()
