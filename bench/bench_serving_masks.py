"""The serving engine's per-forward mask: built request by request against one vectorized construction
(``integrations.transformers.paged_cache.block_diagonal_causal_mask``), in the same run.

    .venv/bin/python -m pytest bench/bench_serving_masks.py --benchmark-group-by=param:batch

Every forward of ``serve`` builds one mask per tier; built request by request it launches a few kernels per request
and tier, which on the H200 left RippleKV in 5 tiers at 0.53x Full's throughput while SnapKV (1 tier) ran at 1.68x
(``bench/results/e2e_serving_gpu.json``). ``extra_info["aten_ops"]`` counts the tensor operations (on a GPU, about
the kernel launches) of one construction, which does not depend on the machine.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ripplekv_ext.integrations.transformers.paged_cache import block_diagonal_causal_mask
from ripplekv_ext.transformers_front.masks import end_aligned_causal_mask

# (queries, keys) per request: 31 requests decoding one token each over ~400 compressed tokens (what the GPU run
# held), and a prefill chunk mixing two new prompts with decoding requests.
BATCHES = {
    "decode-31": ([1] * 31, [380 + 7 * r for r in range(31)]),
    "mixed-prefill": ([256, 200] + [1] * 20, [256, 420] + [400 + 3 * r for r in range(20)]),
}


def per_request_mask(cu_q, cu_k, dtype, device):
    """One end-aligned causal block per request, written into a full mask."""
    mask = torch.full((1, 1, cu_q[-1], cu_k[-1]), torch.finfo(dtype).min, dtype=dtype, device=device)
    for j in range(len(cu_q) - 1):
        q_len, k_len = cu_q[j + 1] - cu_q[j], cu_k[j + 1] - cu_k[j]
        mask[..., cu_q[j]:cu_q[j + 1], cu_k[j]:cu_k[j + 1]] = end_aligned_causal_mask(q_len, k_len, dtype, device)
    return mask


IMPLS = {"per request": per_request_mask, "vectorized": block_diagonal_causal_mask}


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _cumulative(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("batch", list(BATCHES))
def bench_serving_mask(benchmark, batch, impl, device):
    q_lengths, k_lengths = BATCHES[batch]
    cu_q, cu_k = _cumulative(q_lengths), _cumulative(k_lengths)
    build = IMPLS[impl]
    with _CountOps() as counter:
        mask = build(cu_q, cu_k, torch.float32, device)
    if build is not per_request_mask:  # the vectorized construction must build the per-request one's mask
        assert torch.equal(mask, per_request_mask(cu_q, cu_k, torch.float32, device))
    benchmark.extra_info["aten_ops"] = counter.count
    benchmark.extra_info["requests"] = len(q_lengths)
    benchmark(build, cu_q, cu_k, torch.float32, device)
