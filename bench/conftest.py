import os

import pytest
import torch

import ripplekv_ext

# The benchmarks time the CUDA kernels against the torch reference: under the default `auto` a long CUDA call would
# run the reference on both sides.
os.environ.setdefault("RIPPLEKV_CUDA_PATH", "fused")

# Shapes of real layers: (name, B, H_q, H_kv, D). Llama-3.1-8B and the bundled SmolLM2-135M.
MODEL_SHAPES = {
    "llama3.1-8b": dict(B=1, H_q=32, H_kv=8, D=128),
    "smollm2-135m": dict(B=1, H_q=9, H_kv=3, D=64),
}


def bench_devices():
    devices = ["cpu"]
    if ripplekv_ext.cuda_built() and torch.cuda.is_available():
        devices.append("cuda")
    return devices


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(params=bench_devices())
def device(request):
    return request.param
