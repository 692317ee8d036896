import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ripplekv_ext
import ripplekv_ref
from conftest import requires_cuda


def make_inputs(B, H, N, D, C, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g).to(dtype=dtype, device=device)
    values = torch.randn(B, H, N, D, generator=g).to(dtype=dtype, device=device)
    indices = torch.randint(0, N, (B, H, C), generator=g).to(device)
    return keys, values, indices


def assert_matches_reference(keys, values, indices):
    k_c, v_c = ripplekv_ext.gather_kv(keys, values, indices)
    k_ref, v_ref = ripplekv_ref.gather_kv(keys, values, indices)
    assert k_c.shape == k_ref.shape and k_c.dtype == keys.dtype and k_c.device == keys.device
    # A gather copies bits: any difference at all is a bug.
    assert torch.equal(k_c, k_ref)
    assert torch.equal(v_c, v_ref)


@pytest.mark.parametrize("shape", [(1, 1, 1, 8, 1), (2, 3, 37, 64, 11), (1, 8, 300, 128, 64), (2, 2, 16, 6, 16)])
def test_matches_reference(shape, dtype, device):
    B, H, N, D, C = shape
    assert_matches_reference(*make_inputs(B, H, N, D, C, dtype, device))


def test_known_values(device):
    # Independent of the reference: rows picked by hand.
    keys = torch.arange(2 * 5 * 3, dtype=torch.float32, device=device).reshape(1, 2, 5, 3)
    indices = torch.tensor([[[4, 0], [1, 1]]], device=device)
    k_c, v_c = ripplekv_ext.gather_kv(keys, keys * 2, indices)
    expected = torch.tensor([[[[12, 13, 14], [0, 1, 2]], [[18, 19, 20], [18, 19, 20]]]],
                            dtype=torch.float32, device=device)
    assert torch.equal(k_c, expected)
    assert torch.equal(v_c, expected * 2)


def test_empty_selection(device):
    keys, values, _ = make_inputs(1, 2, 10, 8, 0, torch.float32, device)
    indices = torch.empty(1, 2, 0, dtype=torch.long, device=device)
    k_c, v_c = ripplekv_ext.gather_kv(keys, values, indices)
    assert k_c.shape == (1, 2, 0, 8) and v_c.shape == (1, 2, 0, 8)


@pytest.mark.parametrize("layout", ["bnhd_transposed", "strided_heads", "strided_dim", "strided_indices"])
def test_non_contiguous(layout, dtype, device):
    B, H, N, D, C = 2, 4, 50, 32, 13
    keys, values, indices = make_inputs(B, H, N, D, C, dtype, device)
    if layout == "bnhd_transposed":  # [B, N, H, D] storage seen through a transpose, as many engines keep it
        keys = keys.transpose(1, 2).contiguous().transpose(1, 2)
        values = values.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "strided_heads":
        keys = torch.cat([keys, keys], dim=1)[:, ::2]
        values = torch.cat([values, values], dim=1)[:, ::2]
    elif layout == "strided_dim":  # the inner dimension itself is strided: no vectorized copy possible
        keys = torch.cat([keys, keys], dim=3)[..., ::2]
        values = torch.cat([values, values], dim=3)[..., ::2]
    else:
        indices = torch.cat([indices, indices], dim=2)[..., ::2]
    assert not (keys.is_contiguous() and indices.is_contiguous())
    assert_matches_reference(keys, values, indices)


def test_into_preallocated_buffers(dtype, device):
    keys, values, indices = make_inputs(1, 3, 40, 16, 9, dtype, device)
    # An engine's cache with room to spare: write into a slice of it, leave the rest untouched.
    k_cache = torch.full((1, 3, 20, 16), 7.0, dtype=dtype, device=device)
    v_cache = torch.full((1, 3, 20, 16), 7.0, dtype=dtype, device=device)
    out = ripplekv_ext.gather_kv(keys, values, indices, out=(k_cache[:, :, :9], v_cache[:, :, :9]))
    k_ref, v_ref = ripplekv_ref.gather_kv(keys, values, indices)
    assert torch.equal(k_cache[:, :, :9], k_ref) and torch.equal(v_cache[:, :, :9], v_ref)
    assert torch.equal(out[0], k_ref)
    assert bool((k_cache[:, :, 9:] == 7).all()) and bool((v_cache[:, :, 9:] == 7).all())


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 4), N=st.integers(1, 64), D=st.sampled_from([1, 3, 8, 64, 128]),
       C=st.integers(0, 70), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_property_matches_reference(B, H, N, D, C, dtype, seed):
    assert_matches_reference(*make_inputs(B, H, N, D, C, dtype, "cpu", seed))


def test_opcheck(device):
    keys, values, indices = make_inputs(2, 2, 24, 16, 5, torch.float16, device)
    torch.library.opcheck(torch.ops.ripplekv.gather_kv.default, (keys, values, indices))
    k_out = torch.empty(2, 2, 5, 16, dtype=torch.float16, device=device)
    v_out = torch.empty_like(k_out)
    torch.library.opcheck(torch.ops.ripplekv.gather_kv_into.default, (keys, values, indices, k_out, v_out))


def test_torch_compile_fullgraph(device):
    keys, values, indices = make_inputs(1, 2, 32, 8, 6, torch.float32, device)

    def compress(k, v, idx):
        k_c, v_c = ripplekv_ext.gather_kv(k * 2, v, idx)
        return k_c + 1, v_c

    compiled = torch.compile(compress, fullgraph=True)
    k_c, v_c = compiled(keys, values, indices)
    k_ref, v_ref = ripplekv_ref.gather_kv(keys * 2, values, indices)
    assert torch.equal(k_c, k_ref + 1) and torch.equal(v_c, v_ref)


def _bad_calls(device):
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, device)
    return {
        "keys rank": ((k[0], v, i), r"keys must be a 4-D tensor \[B, H_kv, N, D\], got 3-D"),
        "values rank": ((k, v[0], i), r"values must be a 4-D tensor .*, got 3-D"),
        "indices rank": ((k, v, i[0]), r"indices must be a 3-D tensor \[B, H_kv, C\], got 2-D"),
        "keys dtype": ((k.double(), v.double(), i), r"keys must be float32, float16 or bfloat16, got Double"),
        "values dtype": ((k, v.half(), i), r"values must have the dtype of keys \(Float\), got Half"),
        "indices dtype": ((k, v, i.int()), r"indices must be Long, got Int"),
        "shape mismatch": ((k, v[:, :, :5], i), r"values must have the shape of keys \[1, 2, 10, 4\], got \[1, 2, 5, 4\]"),
        "batch mismatch": ((k, v, torch.cat([i, i])), r"indices dim 0 \(B\) must be 1, got 2"),
        "head mismatch": ((k, v, i[:, :1]), r"indices dim 1 \(H_kv\) must be 2, got 1"),
    }


@pytest.mark.parametrize("case", list(_bad_calls("cpu")))
def test_bad_input_errors(case, device):
    args, message = _bad_calls(device)[case]
    with pytest.raises(RuntimeError, match=message):
        ripplekv_ext.gather_kv(*args)


@requires_cuda
def test_bad_device_mix():
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"every tensor must be on one device, got keys on cuda:0, values on cuda:0, indices on cpu"):
        ripplekv_ext.gather_kv(k, v, i.cpu())


@pytest.mark.parametrize("bad_index", [-2, 10, 1 << 40])
def test_index_out_of_range(bad_index, device):
    # On CUDA too: checked before the launch (no device trap that would poison the CUDA context).
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, device)
    i[0, 1, 2] = bad_index
    with pytest.raises(RuntimeError, match=re.escape(f"indices must lie in [0, N) = [0, 10) or be -1 (a pad slot, written "
                                                     f"with zeros), got {bad_index} at [0, 1, 2]")):
        ripplekv_ext.gather_kv(k, v, i)
    # The process (and on CUDA the context) is still usable.
    i[0, 1, 2] = 9
    assert_matches_reference(k, v, i)


def test_bad_output_buffers():
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, "cpu")
    good = torch.empty(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match=r"keys_out must have shape \[1, 2, 3, 4\] \[B, H_kv, C, D\], got \[1, 2, 4, 4\]"):
        ripplekv_ext.gather_kv(k, v, i, out=(torch.empty(1, 2, 4, 4), good))
    with pytest.raises(RuntimeError, match=r"values_out must have the dtype of keys \(Float\), got Half"):
        ripplekv_ext.gather_kv(k, v, i, out=(good, good.half()))
    with pytest.raises(RuntimeError, match=r"keys_out must not share memory with values_out"):
        ripplekv_ext.gather_kv(k, v, i, out=(good, good))


def test_minus_one_writes_zeros(dtype, device):
    # -1 marks a pad slot (the padded output of select_topk_rows / snapkv_compress_rows): zeros, in both forms.
    k, v, i = make_inputs(2, 3, 10, 8, 5, dtype, device)
    i[0, 1, :2] = -1
    i[1, :, 0] = -1
    expected = ripplekv_ref.gather_kv(k, v, i)
    assert bool((expected[0][0, 1, :2] == 0).all())
    for got in (ripplekv_ext.gather_kv(k, v, i),
                ripplekv_ext.gather_kv(k, v, i, out=(torch.full_like(expected[0], 7), torch.full_like(expected[1], 7)))):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_only_pad_slots_of_an_empty_cache(device):
    k = torch.empty(1, 2, 0, 4, device=device)
    i = torch.full((1, 2, 3), -1, dtype=torch.int64, device=device)
    k_c, v_c = ripplekv_ext.gather_kv(k, k.clone(), i)
    assert k_c.shape == (1, 2, 3, 4) and bool((k_c == 0).all()) and bool((v_c == 0).all())


def test_bad_index_with_pad_slots_writes_nothing(device):
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, device)
    i[0, 0, 0] = -1
    i[0, 1, 2] = -3
    keys_out, values_out = torch.full((1, 2, 3, 4), 5.0, device=device), torch.full((1, 2, 3, 4), 5.0, device=device)
    with pytest.raises(RuntimeError, match=re.escape("got -3 at [0, 1, 2] (nothing was written)")):
        ripplekv_ext.gather_kv(k, v, i, out=(keys_out, values_out))
    assert bool((keys_out == 5).all()) and bool((values_out == 5).all())
