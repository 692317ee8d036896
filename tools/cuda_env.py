"""Finds the CUDA toolkit and the CUDA libraries of torch's nvidia-* wheels (setup.py, tools/cmake_build.py).

torch's headers include cuBLAS, cuSPARSE, ... headers that a minimal toolkit lacks, and torch's nvidia-* wheels carry
them. Those wheels also carry their own CUDA runtime and CCCL headers, of torch's CUDA version: put on the include
path as they are, they shadow the toolkit's, and CCCL stops with "CUDA compiler and CUDA toolkit headers are
incompatible" as soon as the two minor versions differ (nvcc 13.0 with torch's 13.2 wheels). So the build includes
only what the toolkit lacks: ``toolkit_gap_headers`` links those entries into one folder of the build tree.
"""

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


def version_pairing(torch_cuda, nvcc_version):
    """(works, sentence) for compiling torch's CUDA ``torch_cuda`` ("13.2") headers with nvcc ``(major, minor)``.

    Within one major version nvcc compiles torch's headers and the kernels run on torch's runtime (CUDA's minor
    version compatibility), as long as each header comes from one release: ``toolkit_gap_headers`` sees to that.
    Across major versions there is no such promise (torch's own extension builder refuses them too).
    """
    torch_major, torch_minor = (int(x) for x in torch_cuda.split(".")[:2])
    nvcc = f"{nvcc_version[0]}.{nvcc_version[1]}"
    if torch_major != nvcc_version[0]:
        return False, (f"nvcc is CUDA {nvcc} but torch was built with CUDA {torch_cuda}: kernels compiled by one "
                       f"major version do not load into the other's runtime")
    if (torch_major, torch_minor) == tuple(nvcc_version):
        return True, f"nvcc and torch both CUDA {nvcc}"
    return True, (f"nvcc CUDA {nvcc}, torch CUDA {torch_cuda}: same major version; the toolkit's runtime and "
                  f"CCCL headers are used, torch's wheels add only the headers the toolkit lacks")


def toolkit_gap_headers(toolkit_root, include_dirs, dest):
    """A folder of links to the entries of ``include_dirs`` that the toolkit's own include folders lack.

    Entries are compared by top-level name (``cublas_v2.h``, ``cusparse.h``, ``cccl/``, ``crt/``), so a header
    or header tree the toolkit has always comes from the toolkit, whatever the wheels' version. Returns ``[dest]``
    when something was linked, else ``[]``. ``dest`` is rebuilt on every call.
    """
    toolkit_root = Path(toolkit_root)
    toolkit_dirs = [toolkit_root / "include", *sorted(toolkit_root.glob("targets/*/include"))]
    have = {entry.name for d in toolkit_dirs if d.is_dir() for entry in d.iterdir()}
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    linked = 0
    for include_dir in include_dirs:
        for entry in sorted(Path(include_dir).iterdir()):
            target = dest / entry.name
            if entry.name in have or target.exists() or target.is_symlink():
                continue
            dest.mkdir(parents=True, exist_ok=True)
            target.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
            linked += 1
    return [str(dest)] if linked else []


def nvidia_wheel_dirs(cuda_major):
    """(include_dirs, lib_dirs) of the CUDA libraries shipped by torch's nvidia-* wheels.

    Never put these include folders on a compiler's path as they are: pass them through ``toolkit_gap_headers``.
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
    def unique(dirs):
        return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))

    return unique(found["include"]), unique(found["lib"])
