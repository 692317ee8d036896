"""h2o_scores: cumulative causal attention each key receives from every prompt query (H2O)."""

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int, check_one_device, check_row_device, row_tensor
from ripplekv_ext.ops.cuda_path import torch_composite


def h2o_scores(queries: Tensor, keys: Tensor, chunk_size: int = 1024, scale: Optional[float] = None,
               group_reduce: str = "mean", lengths: Optional[Union[Tensor, Sequence[int]]] = None) -> Tensor:
    """``a_{g,j} = reduce over the group of sum_{i >= j} p_{h,i,j}``, for every position ``j``.

    Args:
        queries: ``[B, H_q, N, D]`` post-RoPE queries of every prompt position.
        keys: ``[B, H_kv, N, D]``, same dtype and device.
        chunk_size: queries processed together; memory is ``O(B * H_q * N)``, never ``O(N^2)``.
        scale: logit scale, ``1/sqrt(D)`` when None.
        group_reduce: ``"mean"`` (H2O) or ``"max"``.
        lengths: optional int64 ``[B]`` (or ints) for a left-padded batch: row ``b``'s ``n_b`` real tokens are
            positions ``[N - n_b, N)``. Row ``b`` is then scored alone on its real queries and keys (pad keys get no
            attention, pad queries contribute nothing): its real scores equal the row alone's, pad positions are
            ``-inf``. Read on the host (on CUDA one synchronisation); one scoring call per row.

    Returns:
        float32 ``[B, H_kv, N]``; slice ``[..., :N - W]`` and pass it to ``select_topk``. NaN or inf in the inputs
        gives NaN scores (as in the reference), which ``select_topk`` refuses.
    """
    chunk_size = check_int("h2o_scores", "chunk_size", chunk_size)
    if lengths is not None:
        lengths = row_tensor("h2o_scores", "lengths", lengths)
    composite = torch_composite("h2o_scores", keys, 4)
    if composite is not None:
        return composite(queries, keys, chunk_size, scale, group_reduce, lengths)
    return torch.ops.ripplekv.h2o_scores(queries, keys, chunk_size, scale, group_reduce, lengths)


@torch.library.register_fake("ripplekv::h2o_scores")
def _(queries, keys, chunk_size=1024, scale=None, group_reduce="mean", lengths=None):
    check_row_device("h2o_scores", keys, lengths=lengths)
    check_one_device("h2o_scores", queries=queries, keys=keys)
    torch._check(keys.dim() == 4, lambda: f"h2o_scores: keys must be 4-D, got {keys.dim()}-D")
    return keys.new_empty((keys.shape[0], keys.shape[1], keys.shape[2]), dtype=torch.float32)
