"""Per-row compression of a left-padded batch: the batched op against a Python loop of per-row calls and
against the reference, in the same run.

    .venv/bin/python -m pytest bench/bench_rows.py --benchmark-group-by=param:op

The batch: 8 SmolLM2-135M layer inputs (H_q = 9, H_kv = 3, D = 64, fp16 on CUDA, fp32 on CPU) left-padded to the
longest of lengths spread over [N/2, N], each row at 20% of its own length.
"""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from conftest import MODEL_SHAPES, synchronize

W = 32
B = 8


def make_batch(n, device):
    s = MODEL_SHAPES["smollm2-135m"]
    dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, s["H_q"], W, s["D"], generator=g).to(device, dtype)
    k = torch.randn(B, s["H_kv"], n, s["D"], generator=g).to(device, dtype)
    v = torch.randn(B, s["H_kv"], n, s["D"], generator=g).to(device, dtype)
    lengths = torch.linspace(n // 2, n, B).round().long()
    budgets = (lengths.double() * 0.2).round().long().clamp(min=W)
    return q, k, v, budgets, lengths


def compress_loop(q, k, v, budgets, lengths):
    """What a caller without the per-row op does: one snapkv_compress per row on its real tokens."""
    n = k.shape[2]
    return [ripplekv_ext.snapkv_compress(q[b:b + 1], k[b:b + 1, :, n - n_b:], v[b:b + 1, :, n - n_b:], c)
            for b, (n_b, c) in enumerate(zip(lengths.tolist(), budgets.tolist()))]


IMPLS = {
    "rows op": lambda q, k, v, c, n: ripplekv_ext.snapkv_compress_rows(q, k, v, c, n),
    "python loop of snapkv_compress": compress_loop,
    "reference": lambda q, k, v, c, n: ripplekv_ref.snapkv_compress_rows(q, k, v, c, n),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("op", ["snapkv_compress_rows-N2048"])
def bench_snapkv_compress_rows(benchmark, impl, op, device):
    q, k, v, budgets, lengths = make_batch(2048, device)
    fn = IMPLS[impl]
    if impl == "rows op":  # the timed result is the right one
        _, _, idx = fn(q, k, v, budgets, lengths)
        for b, (row_k, row_v, row_idx) in enumerate(compress_loop(q, k, v, budgets, lengths)):
            c_b = row_idx.shape[-1]
            assert torch.equal(idx[b:b + 1, :, idx.shape[-1] - c_b:], row_idx + (2048 - int(lengths[b])))

    def run():
        out = fn(q, k, v, budgets, lengths)
        synchronize(device)
        return out

    benchmark(run)


SELECT_IMPLS = {
    "rows op": lambda s, c, n: ripplekv_ext.select_topk_rows(s, c, W, n),
    "python loop of select_topk": lambda s, c, n: [
        ripplekv_ext.select_topk(s[b:b + 1, :, s.shape[-1] + W - n_b:], c_b, W)
        for b, (n_b, c_b) in enumerate(zip(n.tolist(), c.tolist()))],
    "reference": lambda s, c, n: ripplekv_ref.select_topk_rows(s, c, W, n),
}


@pytest.mark.parametrize("impl", list(SELECT_IMPLS))
@pytest.mark.parametrize("op", ["select_topk_rows-N2048"])
def bench_select_topk_rows(benchmark, impl, op, device):
    q, k, _, budgets, lengths = make_batch(2048, device)
    scores = ripplekv_ext.snapkv_scores(q, k, lengths=lengths)
    fn = SELECT_IMPLS[impl]
    if impl == "rows op":
        assert torch.equal(fn(scores, budgets, lengths).cpu(),
                           ripplekv_ref.select_topk_rows(scores.cpu(), budgets, W, lengths))

    def run():
        out = fn(scores, budgets, lengths)
        synchronize(device)
        return out

    benchmark(run)
