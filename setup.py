"""Builds ripplekv_ext._C: C++ CPU kernels always, CUDA kernels when a matching toolchain is found.

Environment variables:
  FORCE_ONLY_CPU=1         never build CUDA sources.
  FORCE_CUDA=1             build CUDA sources even if torch's CUDA major version differs from nvcc's (without it
                           such a pairing stops the build before anything compiles, saying why).
  CUDA_HOME / CUDA_PATH    the CUDA toolkit root (default: asked of the nvcc on PATH, then /usr/local/cuda).
  TORCH_CUDA_ARCH_LIST     GPU architectures (default "8.0;9.0+PTX": sm_80 and sm_90 code, plus compute_90 PTX
                           that newer GPUs (sm_100, sm_120) compile at load time, as CMake's "80;90" does).
  MAX_JOBS                 parallel compile jobs (ninja).
  RIPPLEKV_DEBUG_INFO=1    keep the C++ debug info (-g) that Python's build flags ask for; without it the host code
                           is compiled with -g0, as torch's own wheels ship, in about two thirds of the time.
The decision never depends on a GPU being present, so CI machines without one compile the CUDA code.

What a build says about itself, so that pip cannot pair it with another torch silently:
  version       0.1.0+cpu.torch2.15 or 0.1.0+cu13.torch2.15: the local label names the kernels (CPU only, or CPU
                and CUDA 13) and the torch release (major.minor) the library was compiled against;
  dependencies  torch>=2.15,<2.16: that release only (the C++ ABI changes between torch releases);
  wheel tag     cp310-abi3: the module uses only Python's stable ABI (the ops register through torch's dispatcher,
                no pybind11), so one wheel serves every CPython from 3.10 that torch has
                (torch 2.15: 3.11 and later).
ripplekv_ext._library still refuses, at import, a library built against another torch.
"""

import os
import re
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from cuda_env import (find_cuda_toolkit, nvidia_wheel_dirs, toolkit_gap_headers,  # noqa: E402  (shared with
                      version_pairing)                                            # tools/cmake_build.py)
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
BASE_VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "ripplekv_ext" / "__init__.py").read_text()).group(1)
# The oldest torch the Python side supports (ripplekv_ext/_compat.py); a build pins its own torch release instead.
SOURCE_REQUIREMENTS = ["torch>=2.13", "numpy"]


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def build_config():
    import torch

    torch_cuda = torch.version.cuda  # "13.0", or None for a CPU-only torch
    root, nvcc_version = find_cuda_toolkit()
    config = {"torch": torch.__version__, "torch_cuda": torch_cuda, "cuda_home": root,
              "nvcc": nvcc_version, "with_cuda": False}
    if _env_flag("FORCE_ONLY_CPU"):
        config["reason"] = "FORCE_ONLY_CPU=1"
    elif root is None:
        if _env_flag("FORCE_CUDA"):
            sys.exit("ripplekv_ext: FORCE_CUDA=1 but no nvcc was found (set CUDA_HOME to the toolkit root)")
        config["reason"] = "no nvcc found"
    elif torch_cuda is None:
        if _env_flag("FORCE_CUDA"):
            sys.exit("ripplekv_ext: FORCE_CUDA=1 but this torch is a CPU-only build; install a CUDA build of torch")
        config["reason"] = "torch is a CPU-only build"
    else:
        works, pairing = version_pairing(torch_cuda, nvcc_version)
        if not works and not _env_flag("FORCE_CUDA"):
            # Said before anything compiles: a silent CPU-only build would look like success to a GPU user.
            sys.exit(f"ripplekv_ext: cannot build the CUDA kernels: {pairing} ({root}). Ways out: install a CUDA "
                     f"{torch_cuda.split('.')[0]}.x toolkit and point CUDA_HOME at it (or put its nvcc on PATH), "
                     f"install a torch built for CUDA {nvcc_version[0]}, or build the CPU kernels only with "
                     f"FORCE_ONLY_CPU=1.")
        config["with_cuda"] = True
        config["reason"] = pairing if works else f"FORCE_CUDA=1 although {pairing}"
        config["arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST
    return config


def torch_release(config):
    """torch's major.minor, e.g. (2, 15): the unit within which its C++ ABI holds."""
    major, minor = config["torch"].split("+")[0].split(".")[:2]
    return int(major), int(minor)


def build_version(config):
    major, minor = torch_release(config)
    kernels = f"cu{config['nvcc'][0]}" if config["with_cuda"] else "cpu"
    return f"{BASE_VERSION}+{kernels}.torch{major}.{minor}"


def build_requirements(config):
    major, minor = torch_release(config)
    return [f"torch>={major}.{minor},<{major}.{minor + 1}", "numpy"]


def print_build_config(config):
    lines = [
        "ripplekv_ext build configuration:",
        f"  version          {build_version(config)} (requires {build_requirements(config)[0]})",
        f"  torch            {config['torch']} (CUDA {config['torch_cuda'] or 'none'})",
        f"  nvcc             {'.'.join(map(str, config['nvcc'])) if config['nvcc'] else 'not found'}"
        + (f" at {config['cuda_home']}" if config["cuda_home"] else ""),
        f"  CPU kernels      yes",
        f"  CUDA kernels     {'yes' if config['with_cuda'] else 'no'} ({config['reason']})",
    ]
    if config["with_cuda"]:
        lines.append(f"  CUDA archs       {config['arch_list']}")
    print("\n".join(lines), flush=True)


def extension_modules(config):
    from torch.utils import cpp_extension  # imported after CUDA_HOME is set: it reads it at import

    cpp_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))
    # csrc/cuda holds only .cu files; the CPU sources and python_module.cpp build either way.
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").rglob("*.cu"))
    include_dirs = [str(ROOT / "include"), str(ROOT / "csrc")]
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
    if not _env_flag("RIPPLEKV_DEBUG_INFO"):
        cxx_flags.append("-g0")  # after Python's -g: debug info is a third of each C++ file's compile time
    if not config["with_cuda"]:
        return [cpp_extension.CppExtension(
            "ripplekv_ext._C", cpp_sources, include_dirs=include_dirs, py_limited_api=True,
            extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])]
    major, minor = config["nvcc"]
    include_dirs += toolkit_gap_headers(config["cuda_home"], nvidia_wheel_dirs(major)[0],
                                        ROOT / "build" / "cuda-toolkit-gaps")
    return [cpp_extension.CUDAExtension(
        "ripplekv_ext._C", cpp_sources + cuda_sources, include_dirs=include_dirs, py_limited_api=True,
        define_macros=[("RIPPLEKV_WITH_CUDA", "1"), ("RIPPLEKV_CUDA_VERSION", str(major * 1000 + minor * 10))],
        extra_compile_args={"cxx": cxx_flags,
                            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]},
        extra_link_args=["-fopenmp"])]


def main():
    if _env_flag("RIPPLEKV_SKIP_EXTENSION"):
        # `make build` installs the Python packages editable with this set, then compiles the
        # extension in place with `setup.py build_ext --inplace`, whose ninja build dir persists
        # between runs (pip's editable build would recompile everything in a fresh temp dir).
        setup(version=BASE_VERSION, install_requires=SOURCE_REQUIREMENTS)
        return
    config = build_config()
    if config["with_cuda"]:
        os.environ["CUDA_HOME"] = str(config["cuda_home"])
        os.environ["TORCH_CUDA_ARCH_LIST"] = config["arch_list"]
    print_build_config(config)
    from torch.utils.cpp_extension import BuildExtension

    setup(
        version=build_version(config),
        install_requires=build_requirements(config),
        ext_modules=extension_modules(config),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it for its functions
    main()
