"""Where the op tests run: the devices (the CUDA half skipped, not absent, without a GPU), the float dtypes and the
torch.compile backend every test file imports; tests/conftest.py makes fixtures of them."""

import shutil

import pytest
import torch

import ripplekv_ext


def _cuda_skip_reason():
    if not ripplekv_ext.cuda_built():
        return "CUDA kernels not built into this ripplekv_ext"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


CUDA_SKIP_REASON = _cuda_skip_reason()
requires_cuda = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")

# Every op test runs on both backends; the CUDA half is reported as skipped, never silently absent.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# What the torch.compile tests check of an op is that it traces whole (fullgraph=True) through its fake kernel, which
# both backends do. Inductor then writes C++ for the CPU and needs a compiler; an installed wheel's tests run with none
# on the PATH (tools/test_dist.sh), where aot_eager runs the traced graph instead.
COMPILE_BACKEND = "inductor" if shutil.which("c++") or shutil.which("g++") else "aot_eager"
