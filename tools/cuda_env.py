"""Finds the CUDA toolkit and the CUDA libraries of torch's nvidia-* wheels (setup.py, tools/cmake_build.py)."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path


def find_cuda_toolkit():
    """Returns (toolkit_root, (major, minor)) of the nvcc to use, or (None, None)."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for nvcc in candidates:
        if not nvcc.exists():
            continue
        try:
            version_text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                                          check=True).stdout
            # nvcc may be a wrapper script (it is on our CI machines), so its path says nothing about
            # the toolkit; a dry run prints the toolkit root nvcc really uses as TOP=...
            dry_run = subprocess.run([str(nvcc), "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                     capture_output=True, text=True).stderr
        except (OSError, subprocess.CalledProcessError):
            continue
        version = re.search(r"release (\d+)\.(\d+)", version_text)
        top = re.search(r"^#\$ TOP=(.+)$", dry_run, re.MULTILINE)
        if version is None:
            continue
        root = Path(top.group(1).strip()).resolve() if top else nvcc.resolve().parent.parent
        return root, (int(version.group(1)), int(version.group(2)))
    return None, None


def nvidia_wheel_dirs(cuda_major):
    """(include_dirs, lib_dirs) of the CUDA libraries shipped by torch's nvidia-* wheels.

    torch's headers include cublas, cusparse, ... which a minimal toolkit may lack; the wheels that
    torch itself loads at run time carry them.
    """
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return [], []
    found = {"include": [], "lib": []}
    for base in spec.submodule_search_locations:
        for kind in found:
            # CUDA 13 wheels put everything under nvidia/cu13; CUDA 12 wheels use one folder per library.
            found[kind] += sorted(glob.glob(os.path.join(base, f"cu{cuda_major}", kind)))
            found[kind] += sorted(glob.glob(os.path.join(base, "*", kind)))
    unique = lambda dirs: list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))
    return unique(found["include"]), unique(found["lib"])
