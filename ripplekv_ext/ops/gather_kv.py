"""gather_kv: copy the selected positions of K and V into compact buffers."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_one_device
from ripplekv_ext.ops.cuda_path import torch_composite


def gather_kv(keys: Tensor, values: Tensor, indices: Tensor,
              out: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """``K_c[b, g, t] = K[b, g, indices[b, g, t]]``, and the same for ``V``, in one launch.

    Args:
        keys, values: ``[B, H_kv, N, D]``, float32/float16/bfloat16, any strides.
        indices: int64 ``[B, H_kv, C]`` with entries in ``[0, N)``, or ``-1``: a pad slot (as in the padded output of
            ``select_topk_rows`` / ``snapkv_compress_rows``), written with zeros. Any other index raises.
        out: optional ``(keys_out, values_out)``, each ``[B, H_kv, C, D]`` with the dtype and device of
            ``keys``, written in place (for an engine's preallocated cache).

    Returns:
        ``(keys_c, values_c)``, each ``[B, H_kv, C, D]``.

    Every check (shapes, one device, index range, outputs that share memory with each other, with the inputs or
    within themselves) runs before anything is written, so a bad call leaves ``out`` as it was. On CUDA the index
    check costs one device synchronisation (so this op is not captured in CUDA graphs). ``out`` always runs the
    kernel (the torch composite has no in-place form).
    """
    if out is None:
        composite = torch_composite("gather_kv", keys, 4)
        if composite is not None:
            return composite(keys, values, indices)
        return torch.ops.ripplekv.gather_kv(keys, values, indices)
    keys_out, values_out = out
    torch.ops.ripplekv.gather_kv_into(keys, values, indices, keys_out, values_out)
    return keys_out, values_out


@torch.library.register_fake("ripplekv::gather_kv")
def _(keys, values, indices):
    check_one_device("gather_kv", keys=keys, values=values, indices=indices)
    torch._check(keys.dim() == 4, lambda: f"gather_kv: keys must be 4-D, got {keys.dim()}-D")
    torch._check(indices.dim() == 3, lambda: f"gather_kv: indices must be 3-D, got {indices.dim()}-D")
    shape = (keys.shape[0], keys.shape[1], indices.shape[2], keys.shape[3])
    return keys.new_empty(shape), values.new_empty(shape)


@torch.library.register_fake("ripplekv::gather_kv_into")
def _(keys, values, indices, keys_out, values_out):
    check_one_device("gather_kv_into", keys=keys, values=values, indices=indices, keys_out=keys_out,
                     values_out=values_out)
    return None
