"""Loads the compiled library and refuses one that does not match the running torch.

A missing or broken ``_C`` would otherwise surface much later as "operator ripplekv::... does not
exist"; here it becomes an ImportError that says what is wrong and how to rebuild.
"""

import torch

REBUILD_HINT = (
    "Rebuild it from the project root with `make build` (or "
    "`pip install --no-build-isolation -e .` inside your environment)."
)


def _shadowed_install() -> str:
    """Where an installed ripplekv_ext with a compiled library is, when this one is a source checkout's package
    imported before it (Python puts the working folder first on ``sys.path`` for ``python -m`` and ``-c``)."""
    import importlib.metadata
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if not (here.parent / "setup.py").is_file():
        return ""
    for dist in importlib.metadata.distributions(name="ripplekv_ext"):  # the checkout's own metadata may come first
        installed = Path(dist.locate_file("ripplekv_ext")).resolve()
        if installed != here and any(installed.glob("_C*.so")):
            return str(installed)
    return ""


def _load():
    try:
        from ripplekv_ext import _C
    except ImportError as err:
        installed = _shadowed_install()
        if installed:
            raise ImportError(
                f"ripplekv_ext: this is the source checkout's ripplekv_ext ({__file__.rsplit('/', 1)[0]}), which has "
                f"no compiled library, imported before the installed one ({installed}) because the working folder "
                "comes first on sys.path (python -m, python -c): start from another folder"
            ) from err
        raise ImportError(
            f"ripplekv_ext: the compiled library ripplekv_ext._C could not be loaded ({err}). "
            f"It is missing, or was built against another torch than {torch.__version__}. {REBUILD_HINT}"
        ) from err
    info = _C.build_info()
    built_torch = ".".join(map(str, info["torch_version"]))
    if built_torch.split(".")[:2] != torch.__version__.split("+")[0].split(".")[:2]:
        raise ImportError(
            f"ripplekv_ext: the compiled library was built against torch {built_torch} but torch "
            f"{torch.__version__} is running. {REBUILD_HINT}"
        )
    cuda_version = info["cuda_version"]
    if cuda_version:
        built_cuda = f"{cuda_version // 1000}.{cuda_version % 1000 // 10}"
        if torch.version.cuda is None:
            raise ImportError(
                f"ripplekv_ext: the compiled library was built with CUDA {built_cuda} but this torch is a "
                f"CPU-only build. Install a CUDA {built_cuda.split('.')[0]} build of torch, or rebuild with "
                f"FORCE_ONLY_CPU=1. {REBUILD_HINT}"
            )
        if built_cuda.split(".")[0] != torch.version.cuda.split(".")[0]:
            raise ImportError(
                f"ripplekv_ext: the compiled library was built with CUDA {built_cuda} but torch uses CUDA "
                f"{torch.version.cuda}. {REBUILD_HINT}"
            )
    if not hasattr(torch.ops.ripplekv, "gather_kv"):
        raise ImportError(f"ripplekv_ext: the compiled library registered no ops. {REBUILD_HINT}")
    return info


BUILD_INFO = _load()


def cuda_built() -> bool:
    """True when the CUDA kernels were compiled into this build (whether or not a GPU is present)."""
    return BUILD_INFO["cuda_version"] != 0


def cuda_version():
    """The CUDA version the kernels were compiled with, as "13.0", or None for a CPU-only build."""
    v = BUILD_INFO["cuda_version"]
    return f"{v // 1000}.{v % 1000 // 10}" if v else None


def registered_ops():
    """Names of the ops this library registered under torch.ops.ripplekv."""
    names = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("ripplekv::")}
    return sorted(names)


def build_report() -> str:
    """A human-readable summary of what was built and what can run here."""
    gpu = torch.cuda.is_available()
    lines = [
        f"ripplekv_ext: torch {torch.__version__} (built against {'.'.join(map(str, BUILD_INFO['torch_version']))})",
        "  CPU kernels:  yes",
        f"  CUDA kernels: {'yes, CUDA ' + cuda_version() if cuda_built() else 'no (CPU-only build)'}",
        f"  GPU present:  {torch.cuda.get_device_name() if gpu else 'no'}",
        f"  ops:          {', '.join(registered_ops())}",
    ]
    return "\n".join(lines)
