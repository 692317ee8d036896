"""gather_kv_packed: every layer's kept K/V rows gathered into one packed buffer in one call."""

import pytest
import torch

import ripplekv_ext
import ripplekv_ref
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
    with pytest.raises(RuntimeError, match=r"keys\[1\] must have the shape of keys\[0\] \[1, 2, 20, 8\], got \[1, 2, 19, 8\]"):
        ripplekv_ext.gather_kv_packed([keys[0], keys[1][:, :, :19]], values, flat, offsets)
    with pytest.raises(RuntimeError, match=r"values\[0\] must have the dtype of keys\[0\] \(Float\), got Half"):
        ripplekv_ext.gather_kv_packed(keys, [values[0].half(), values[1]], flat, offsets)
    with pytest.raises(RuntimeError, match=r"offsets dim 0 \(L \+ 1\) must be 3, got 2"):
        ripplekv_ext.gather_kv_packed(keys, values, flat, offsets[:2])
    # Offsets are checked on every backend (on CUDA too, before the launch).
    with pytest.raises(RuntimeError, match=r"offsets\[L\] must equal indices_flat dim 2 \(14\), got 13"):
        ripplekv_ext.gather_kv_packed(keys, values, flat, torch.tensor([0, 6, 13], device=device))
