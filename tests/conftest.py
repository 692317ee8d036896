"""Fixtures every test folder shares: the device and the float dtype each op test runs on (tests/devices.py)."""

import os

import pytest
import torch

# The op tests test the CUDA kernels: under the default `auto` a long CUDA call would run the torch reference the
# tests compare against. tests/ops/test_cuda_path.py tests `auto` itself.
os.environ.setdefault("RIPPLEKV_CUDA_PATH", "fused")

from devices import DEVICES, FLOAT_DTYPES  # noqa: E402  (after the path default above)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=FLOAT_DTYPES, ids=["fp32", "fp16", "bf16"])
def dtype(request):
    return request.param
