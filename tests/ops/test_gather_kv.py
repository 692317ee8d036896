"""gather_kv (and gather_kv_into, its form writing into given buffers): the reference, hand-picked rows, opcheck over
the samples, and the bad-input table."""

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ripplekv_ext
import ripplekv_ref
from devices import COMPILE_BACKEND, DEVICES, requires_cuda
from op_samples import FLOAT_DTYPES, bnhd, idx, rand
from op_tables import Case, op_tests, other_device


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

    compiled = torch.compile(compress, fullgraph=True, backend=COMPILE_BACKEND)
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
        "shape mismatch": ((k, v[:, :, :5], i),
                           r"values must have the shape of keys \[1, 2, 10, 4\], got \[1, 2, 5, 4\]"),
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
    with pytest.raises(RuntimeError, match=r"every tensor must be on one device, got keys on cuda:0, values on "
                                           r"cuda:0, indices on cpu"):
        ripplekv_ext.gather_kv(k, v, i.cpu())


@pytest.mark.parametrize("bad_index", [-2, 10, 1 << 40])
def test_index_out_of_range(bad_index, device):
    # On CUDA too: checked before the launch (no device trap that would poison the CUDA context).
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, device)
    i[0, 1, 2] = bad_index
    with pytest.raises(RuntimeError, match=re.escape(f"indices must lie in [0, N) = [0, 10) or be -1 (a pad slot, "
                                                     f"written "
                                                     f"with zeros), got {bad_index} at [0, 1, 2]")):
        ripplekv_ext.gather_kv(k, v, i)
    # The process (and on CUDA the context) is still usable.
    i[0, 1, 2] = 9
    assert_matches_reference(k, v, i)


def test_bad_output_buffers():
    k, v, i = make_inputs(1, 2, 10, 4, 3, torch.float32, "cpu")
    good = torch.empty(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match=r"keys_out must have shape \[1, 2, 3, 4\] \[B, H_kv, C, D\], got \[1, 2, "
                                           r"4, 4\]"):
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
                ripplekv_ext.gather_kv(k, v, i, out=(torch.full_like(expected[0], 7),
                                                     torch.full_like(expected[1], 7)))):
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


# ---- samples: every float dtype, non-contiguous inputs, empty batches, pad slots; opcheck over each ------------------

def gather_kv_samples(device):
    out = []
    for dtype in FLOAT_DTYPES:
        k, v = rand(2, 3, 20, 8, device=device, dtype=dtype), rand(2, 3, 20, 8, device=device, dtype=dtype, seed=1)
        out.append((f"{dtype}", (k, v, idx(2, 3, 7, n=20, device=device))))
    k, v = rand(2, 3, 20, 8, device=device), rand(2, 3, 20, 8, device=device, seed=1)
    out.append(("bnhd", (bnhd(k), bnhd(v), idx(2, 3, 7, n=20, device=device))))
    out.append(("strided indices", (k, v, idx(2, 3, 14, n=20, device=device)[:, :, ::2])))
    out.append(("empty batch", (k[:0], v[:0], idx(0, 3, 7, n=20, device=device))))
    out.append(("no index", (k, v, idx(2, 3, 0, n=20, device=device))))
    out.append(("pad slots (-1)", (k, v, idx(2, 3, 7, n=20, device=device).index_fill(
        2, torch.tensor([0, 1], device=device), -1))))
    return out


def gather_kv_into_samples(device):
    out = []
    for name, (k, v, i) in gather_kv_samples(device):
        shape = (k.shape[0], k.shape[1], i.shape[2], k.shape[3])
        out.append((name, (k, v, i, torch.empty(shape, dtype=k.dtype, device=device),
                           torch.empty(shape, dtype=k.dtype, device=device))))
    k, v = rand(1, 2, 20, 8, device=device), rand(1, 2, 20, 8, device=device, seed=1)
    cache = torch.empty(1, 2, 12, 8, device=device)
    out.append(("slice of a larger cache", (k, v, idx(1, 2, 5, n=20, device=device), cache[:, :, :5],
                                            torch.empty(1, 2, 5, 8, device=device))))
    return out


SAMPLES = {"gather_kv": gather_kv_samples, "gather_kv_into": gather_kv_into_samples}



# ---- the bad-input table (op_tables.py), on CPU and CUDA ----------------------------------------------------------

def _gather_into(device, keys_out=None, values_out=None, bad_index=False, n=10, c=3):
    k, v = rand(2, 2, n, 4, device=device), rand(2, 2, n, 4, device=device, seed=1)
    i = idx(2, 2, c, n=n, device=device)
    if bad_index:
        i[1, 1, c - 1] = n  # the last row: every other row would be written first by a row-by-row check
    ko = torch.zeros(2, 2, c, 4, device=device) if keys_out is None else keys_out(k, v)
    vo = torch.zeros(2, 2, c, 4, device=device) if values_out is None else values_out(k, v, ko)
    ripplekv_ext.gather_kv(k, v, i, out=(ko, vo))
    return ko, vo


BAD_INPUTS = [
    # Empty inputs give empty outputs of the right shape.
    Case("gather_kv B=0", lambda d: ripplekv_ext.gather_kv(
        rand(0, 2, 10, 4, device=d), rand(0, 2, 10, 4, device=d), idx(0, 2, 3, n=10, device=d)),
         shapes=[(0, 2, 3, 4)] * 2),
    Case("gather_kv H=0", lambda d: ripplekv_ext.gather_kv(
        rand(1, 0, 10, 4, device=d), rand(1, 0, 10, 4, device=d), idx(1, 0, 3, n=10, device=d)),
         shapes=[(1, 0, 3, 4)] * 2),
    Case("gather_kv N=0, C=0", lambda d: ripplekv_ext.gather_kv(
        rand(1, 2, 0, 4, device=d), rand(1, 2, 0, 4, device=d), idx(1, 2, 0, n=1, device=d)),
         shapes=[(1, 2, 0, 4)] * 2),
    Case("gather_kv D=0", lambda d: ripplekv_ext.gather_kv(
        rand(1, 2, 10, 0, device=d), rand(1, 2, 10, 0, device=d), idx(1, 2, 3, n=10, device=d)),
         shapes=[(1, 2, 3, 0)] * 2),
    # Every tensor on one device (meta included): no uninitialised memory, no silent no-op.
    Case("gather_kv indices on another device", lambda d: ripplekv_ext.gather_kv(
        rand(1, 2, 10, 4, device=d), rand(1, 2, 10, 4, device=d), idx(1, 2, 3, n=10, device=other_device(d))),
         error=(RuntimeError, "every tensor must be on one device")),
    Case("gather_kv out on another device", lambda d: _gather_into(
        d, keys_out=lambda k, v: torch.empty(2, 2, 3, 4, device=other_device(d)),
        values_out=lambda k, v, ko: torch.empty(2, 2, 3, 4, device=other_device(d))),
         error=(RuntimeError, "every tensor must be on one device")),
    # gather_kv_into validates everything before writing anything.
    Case("gather_kv out aliases keys (in-place compaction)", lambda d: _gather_into(
        d, keys_out=lambda k, v: k[:, :, :3]), error=(RuntimeError, "keys_out must not share memory with keys")),
    Case("gather_kv values_out overlaps keys_out", lambda d: _gather_into(
        d, keys_out=lambda k, v: torch.zeros(2, 2, 4, 4, device=d)[:, :, :3],
        values_out=lambda k, v, ko: torch.as_strided(ko, ko.shape, ko.stride(), ko.storage_offset() + 4)),
         error=(RuntimeError, "keys_out must not share memory with values_out")),
    Case("gather_kv stride-0 output", lambda d: _gather_into(
        d, keys_out=lambda k, v: torch.zeros(1, 1, 1, 4, device=d).expand(2, 2, 3, 4)),
         error=(RuntimeError, "keys_out must not have elements that share memory")),
    Case("gather_kv out-of-range index in the last row", lambda d: _gather_into(d, bad_index=True),
         error=(RuntimeError, "indices must lie in [0, N) = [0, 10) or be -1 (a pad slot, written with zeros), got 10 "
                              "at [1, 1, 2] (nothing was written)")),
    Case("gather_kv negative index", lambda d: ripplekv_ext.gather_kv(
        rand(1, 2, 10, 4, device=d), rand(1, 2, 10, 4, device=d), torch.tensor([[[0, -2], [2, 3]]], device=d)),
         error=(RuntimeError, "indices must lie in [0, N) = [0, 10) or be -1 (a pad slot, written with zeros), got -2 "
                              "at [0, 0, 1]")),
    Case("gather_kv index -1 (a pad slot)", lambda d: ripplekv_ext.gather_kv(
        rand(1, 2, 10, 4, device=d), rand(1, 2, 10, 4, device=d), torch.tensor([[[-1, 5], [2, 3]]], device=d)),
         shapes=[(1, 2, 2, 4)] * 2,
         check=lambda d, r: bool((r[0][0, 0, 0] == 0).all()) and bool((r[1][0, 0, 0] == 0).all())),
]


# opcheck on every sample, every row of the table on CPU and CUDA, the reference refusing what the op refuses.
test_opcheck_samples, test_bad_input_table, test_reference_agrees_on_errors = op_tests(__name__, SAMPLES, BAD_INPUTS)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_leaves_outputs_untouched_on_error(device):
    # The engine's preallocated cache must be as it was after a rejected call.
    k, v = rand(2, 2, 10, 4, device=device), rand(2, 2, 10, 4, device=device, seed=1)
    i = idx(2, 2, 3, n=10, device=device)
    i[1, 1, 2] = 10
    ko, vo = torch.full((2, 2, 3, 4), 7.0, device=device), torch.full((2, 2, 3, 4), 7.0, device=device)
    with pytest.raises(RuntimeError, match="must lie in"):
        ripplekv_ext.gather_kv(k, v, i, out=(ko, vo))
    assert bool((ko == 7).all()) and bool((vo == 7).all())


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_accepts_disjoint_views_of_one_buffer(device):
    # K and V interleaved in one engine buffer [B, H, C, 2, D]: the outputs share a storage but no element.
    k, v = rand(1, 2, 10, 4, device=device), rand(1, 2, 10, 4, device=device, seed=1)
    i = idx(1, 2, 3, n=10, device=device)
    buf = torch.zeros(1, 2, 3, 2, 4, device=device)
    ripplekv_ext.gather_kv(k, v, i, out=(buf[:, :, :, 0], buf[:, :, :, 1]))
    k_ref, v_ref = ripplekv_ref.gather_kv(k, v, i)
    assert torch.equal(buf[:, :, :, 0], k_ref) and torch.equal(buf[:, :, :, 1], v_ref)
    # A slice of a larger preallocated cache (not contiguous) is a fine output too.
    cache = torch.zeros(1, 2, 8, 4, device=device)
    ripplekv_ext.gather_kv(k, v, i, out=(cache[:, :, :3], torch.zeros(1, 2, 3, 4, device=device)))
    assert torch.equal(cache[:, :, :3], k_ref)
