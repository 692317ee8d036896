"""gather_kv_packed: every layer's kept K/V rows gathered into one packed buffer in one call, against the reference;
opcheck over the samples, and the bad-input table."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
from op_samples import FLOAT_DTYPES, bnhd, idx, rand
from op_tables import Case, op_tests, other_device
from test_select_topk_packed import make


def test_layer_list_and_non_contiguous(device):
    scores, keys, values = make(3, 1, 2, 30, 8, 4, torch.float16, device)
    flat, offsets = ripplekv_ext.select_topk_packed(scores, [12, 5, 30], 4)
    # An engine's per-layer caches, each stored [B, N, H, D] and seen through a transpose.
    k_list = [k.transpose(1, 2).contiguous().transpose(1, 2) for k in keys]
    v_list = [v.transpose(1, 2).contiguous().transpose(1, 2) for v in values]
    k_flat, v_flat = ripplekv_ext.gather_kv_packed(k_list, v_list, flat, offsets)
    k_ref, v_ref = ripplekv_ref.gather_kv_packed(keys, values, flat, offsets)
    assert torch.equal(k_flat, k_ref) and torch.equal(v_flat, v_ref)


def test_bad_input(device):
    scores, keys, values = make(2, 1, 2, 20, 8, 4, torch.float32, device)
    flat, offsets = ripplekv_ext.select_topk_packed(scores, [6, 8], 4)
    with pytest.raises(RuntimeError, match=r"values must hold as many layers as keys \(2\), got 1"):
        ripplekv_ext.gather_kv_packed(keys, values[:1], flat, offsets)
    with pytest.raises(RuntimeError, match=r"keys\[1\] must have the shape of keys\[0\] \[1, 2, 20, 8\], got \[1, "
                                           r"2, 19, 8\]"):
        ripplekv_ext.gather_kv_packed([keys[0], keys[1][:, :, :19]], values, flat, offsets)
    with pytest.raises(RuntimeError, match=r"values\[0\] must have the dtype of keys\[0\] \(Float\), got Half"):
        ripplekv_ext.gather_kv_packed(keys, [values[0].half(), values[1]], flat, offsets)
    with pytest.raises(RuntimeError, match=r"offsets dim 0 \(L \+ 1\) must be 3, got 2"):
        ripplekv_ext.gather_kv_packed(keys, values, flat, offsets[:2])
    # Offsets are checked on every backend (on CUDA too, before the launch).
    with pytest.raises(RuntimeError, match=r"offsets\[L\] must equal indices_flat dim 2 \(14\), got 13"):
        ripplekv_ext.gather_kv_packed(keys, values, flat, torch.tensor([0, 6, 13], device=device))


# ---- samples: every float dtype, a transposed cache, an empty batch; opcheck over each -------------------------------

def gather_kv_packed_samples(device):
    out = []
    for dtype in FLOAT_DTYPES:
        keys = [rand(2, 2, 20, 8, device=device, dtype=dtype, seed=s) for s in range(3)]
        values = [rand(2, 2, 20, 8, device=device, dtype=dtype, seed=s + 3) for s in range(3)]
        out.append((f"{dtype}", (keys, values, idx(2, 2, 9, n=20, device=device),
                                 torch.tensor([0, 2, 6, 9], device=device))))
    keys = [bnhd(rand(2, 2, 20, 8, device=device, seed=s)) for s in range(2)]
    out.append(("bnhd", (keys, keys[::-1], idx(2, 2, 5, n=20, device=device),
                         torch.tensor([0, 3, 5], device=device))))
    out.append(("empty batch", ([k[:0] for k in keys], [k[:0] for k in keys], idx(0, 2, 5, n=20, device=device),
                                torch.tensor([0, 3, 5], device=device))))
    return out


SAMPLES = {"gather_kv_packed": gather_kv_packed_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

def _packed_gather(device, offsets=None, bad_index=False, b=1):
    keys = [rand(b, 2, 12, 4, device=device, seed=s) for s in range(2)]
    values = [rand(b, 2, 12, 4, device=device, seed=s + 5) for s in range(2)]
    flat = idx(b, 2, 7, n=12, device=device)
    if bad_index:
        flat[..., -1] = -1
    off = torch.tensor([0, 3, 7] if offsets is None else offsets, device=device)
    return ripplekv_ext.gather_kv_packed(keys, values, flat, off)


BAD_INPUTS = [
    Case("gather_kv_packed B=0", lambda d: _packed_gather(d, b=0), shapes=[(0, 2, 7, 4)] * 2),
    # Every tensor on one device (meta included): no uninitialised memory, no silent no-op.
    Case("gather_kv_packed offsets on another device", lambda d: ripplekv_ext.gather_kv_packed(
        [rand(1, 2, 12, 4, device=d)], [rand(1, 2, 12, 4, device=d)], idx(1, 2, 3, n=12, device=d),
        torch.tensor([0, 3], device=other_device(d))),
         error=(RuntimeError, "every tensor must be on one device")),
    Case("gather_kv_packed out-of-range index", lambda d: _packed_gather(d, bad_index=True),
         error=(RuntimeError, "indices_flat must lie in [0, N) = [0, 12), got -1")),
    Case("gather_kv_packed offsets[0] != 0", lambda d: _packed_gather(d, offsets=[1, 3, 7]),
         error=(RuntimeError, "offsets[0] must be 0, got 1")),
    Case("gather_kv_packed decreasing offsets", lambda d: _packed_gather(d, offsets=[0, 8, 7]),
         error=(RuntimeError, "offsets must be non-decreasing")),
    Case("gather_kv_packed offsets[L] != total", lambda d: _packed_gather(d, offsets=[0, 3, 6]),
         error=(RuntimeError, "offsets[L] must equal indices_flat dim 2 (7), got 6")),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)
