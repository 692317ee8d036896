"""The CPU attention kernel's KV cache layout: reading a row's slots back, writing kept tokens, and the start-up
check that the layout is the one read here."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from vllm import _custom_ops as ops

__all__ = ["SUPPORTED_ISAS", "check_cache_layout", "read_prompt", "write_slots"]

# CPU kernel variants whose key-cache layout this module reads (checked against vLLM's write op at start-up).
SUPPORTED_ISAS = ("vec",)


def _key_value_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views of one layer's cache ``[blocks, H_kv, block_size, 2 D]`` as keys ``[blocks, H_kv, D, block_size]``
    (the "vec" kernel stores each block's keys transposed) and values ``[blocks, H_kv, block_size, D]``."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    halves = kv_cache.view(num_blocks, heads, 2, block_size * (two_d // 2))
    return (halves[:, :, 0].view(num_blocks, heads, two_d // 2, block_size),
            halves[:, :, 1].view(num_blocks, heads, block_size, two_d // 2))


def read_prompt(kv_cache: Tensor, block_ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``[1, H_kv, n, D]`` of logical slots ``[0, n)`` of a row (copies)."""
    key_view, value_view = _key_value_views(kv_cache)
    heads, dim = key_view.shape[1], key_view.shape[2]
    keys = key_view.index_select(0, block_ids).permute(1, 0, 3, 2).reshape(heads, -1, dim)[:, :n]
    values = value_view.index_select(0, block_ids).permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :n]
    return keys.unsqueeze(0).contiguous(), values.unsqueeze(0).contiguous()


def _cache_halves(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    num_blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, heads, block_size * 2, -1).chunk(2, dim=2)


@functools.lru_cache(maxsize=None)
def check_cache_layout(dtype: torch.dtype, block_size: int, heads: int, head_dim: int, isa: str) -> None:
    """Raise unless ``read_prompt`` reads back what vLLM's cache-write op wrote (checked once per shape)."""
    if isa not in SUPPORTED_ISAS:
        raise RuntimeError(f"ripplekv: vLLM's CPU attention runs its {isa!r} kernel here (dtype {dtype}, block size "
                           f"{block_size}, head size {head_dim}), whose key-cache layout the plugin does not read; "
                           f"supported: {list(SUPPORTED_ISAS)}")
    generator = torch.Generator().manual_seed(0)
    tokens = 2 * block_size + 3
    cache = torch.zeros(4, heads, block_size, 2 * head_dim, dtype=dtype)
    keys = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    blocks = torch.tensor([2, 0, 3], dtype=torch.int64)
    slots = blocks[torch.arange(tokens) // block_size] * block_size + torch.arange(tokens) % block_size
    key_cache, value_cache = _cache_halves(cache)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    read_keys, read_values = read_prompt(cache, blocks, tokens)
    if not (torch.equal(read_keys[0].transpose(0, 1), keys) and torch.equal(read_values[0].transpose(0, 1), values)):
        raise RuntimeError(f"ripplekv: vLLM's {isa!r} CPU kernel stores the KV cache in a layout the plugin does not "
                           "read (this vLLM build differs from the one the plugin was written for)")


def write_slots(kv_cache: Tensor, block_ids: Tensor, first: int, keys: Tensor, values: Tensor, layer,
                kv_cache_dtype: str) -> None:
    """Write ``keys``/``values`` ``[1, H_kv, C, D]`` to a row's logical slots ``[first, first + C)`` with vLLM's own
    cache-write op (``block_ids``: the row's blocks from its first)."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(first, first + keys.shape[2])
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    key_cache, value_cache = _cache_halves(kv_cache)
    ops.cpu_attn_reshape_and_cache(keys[0].transpose(0, 1).contiguous(), values[0].transpose(0, 1).contiguous(),
                                   key_cache, value_cache, slots, layer.isa, k_scale=layer._k_scale_float,
                                   v_scale=layer._v_scale_float, kv_cache_dtype=kv_cache_dtype)
