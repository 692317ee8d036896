"""Configures, builds and tests the CMake build (the C++ users' path) with this environment's torch.

    python tools/cmake_build.py [--cuda] [--build-dir cmake-build]

It passes CMake what find_package(Torch) needs on machines where nvcc is a wrapper and the CUDA
libraries come from torch's nvidia-* wheels, then runs ctest.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from cuda_env import find_cuda_toolkit, nvidia_wheel_dirs, toolkit_gap_headers  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="also compile the CUDA kernels")
    parser.add_argument("--build-dir", default=str(ROOT / "cmake-build"))
    args = parser.parse_args()

    env = dict(os.environ)
    cmake_args = [f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release",
                  f"-DRIPPLEKV_WITH_CUDA={'ON' if args.cuda else 'OFF'}"]
    lib_dirs = []
    if torch.version.cuda is not None:
        # A CUDA build of libtorch asks for the toolkit even when our CUDA sources are off.
        root, version = find_cuda_toolkit()
        if root is None:
            sys.exit("cmake_build: torch is a CUDA build but no nvcc was found; set CUDA_HOME")
        major = version[0]
        wheel_include_dirs, lib_dirs = nvidia_wheel_dirs(major)
        include_dirs = toolkit_gap_headers(root, wheel_include_dirs, Path(args.build_dir) / "cuda-toolkit-gaps")
        candidates = [Path(d) / f"libnvrtc.so.{major}" for d in lib_dirs]
        nvrtc = next((path for path in candidates if path.exists()), None)
        cmake_args += [f"-DCUDA_TOOLKIT_ROOT_DIR={root}", f"-DCUDAToolkit_ROOT={root}",
                       f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}"]
        if nvrtc is not None:
            cmake_args.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc}")
        # Without an arch list, torch's CMake config compiles a probe to detect local GPUs, which
        # fails on machines without one (and with CMake versions that lack CUDA 20 dialect flags).
        env.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        flags = " ".join(f"-isystem {d}" for d in include_dirs)
        env["CXXFLAGS"] = f"{env.get('CXXFLAGS', '')} {flags}".strip()
        env["CUDAFLAGS"] = f"{env.get('CUDAFLAGS', '')} {flags}".strip()
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs + [env.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)

    def run(cmd):
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)

    run(["cmake", "-S", str(ROOT), "-B", args.build_dir, *cmake_args])
    run(["cmake", "--build", args.build_dir, "-j", os.environ.get("MAX_JOBS", "2")])
    run(["ctest", "--test-dir", args.build_dir, "--output-on-failure"])


if __name__ == "__main__":
    main()
