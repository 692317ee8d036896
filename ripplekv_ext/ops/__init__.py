"""Typed wrappers and fake (meta) kernels for every torch.ops.ripplekv op; one op per file."""

from ripplekv_ext.ops.gather_kv import gather_kv

__all__ = ["gather_kv"]
