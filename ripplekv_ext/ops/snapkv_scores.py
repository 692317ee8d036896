"""snapkv_scores: attention mass each prefix key receives from the observation window (docs/design.md §4)."""

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int, check_one_device, check_row_device, row_tensor
from ripplekv_ext.ops.cuda_path import torch_composite


def snapkv_scores(q_window: Tensor, keys: Tensor, kernel_size: int = 7, pooling: str = "max",
                  group_reduce: str = "mean", scale: Optional[float] = None,
                  lengths: Optional[Union[Tensor, Sequence[int]]] = None) -> Tensor:
    """SnapKV window scores without materializing the ``[B, H_q, W, N]`` probabilities.

    Args:
        q_window: ``[B, H_q, W, D]`` post-RoPE queries of the last ``W`` prompt positions.
        keys: ``[B, H_kv, N, D]``, same dtype (fp32/fp16/bf16) and device; ``H_q = G * H_kv``, ``1 <= W < N``.
        kernel_size: odd pooling width, 1 disables pooling.
        pooling: ``"max"`` (pads with -inf) or ``"avg"`` (zero padding counted).
        group_reduce: ``"mean"`` or ``"max"`` over the ``G`` query heads of each KV head.
        scale: logit scale, ``1/sqrt(D)`` when None.
        lengths: optional int64 ``[B]`` (or ints) for a left-padded batch: row ``b``'s ``n_b`` real tokens are
            positions ``[N - n_b, N)``. Row ``b``'s scores at its real prefix positions then equal those of the row
            alone (``keys[b:b+1, :, N - n_b:]``: softmax over its real keys only, pooling padded at the row's own
            boundary); pad positions, and every position of a row with ``n_b <= W``, are ``-inf``. Read on the host
            (on CUDA one synchronisation: not capturable in a CUDA graph); one scoring call per row.

    Returns:
        float32 ``[B, H_kv, N - W]``. Computed in fp32 whatever the input dtype. NaN or inf in the inputs gives NaN
        scores (as in the reference); the selection ops then raise. An empty batch gives an empty result.
    """
    kernel_size = check_int("snapkv_scores", "kernel_size", kernel_size)
    if lengths is not None:
        lengths = row_tensor("snapkv_scores", "lengths", lengths)
    composite = torch_composite("snapkv_scores", keys, 4)
    if composite is not None:
        return composite(q_window, keys, kernel_size, pooling, group_reduce, scale, lengths)
    return torch.ops.ripplekv.snapkv_scores(q_window, keys, kernel_size, pooling, group_reduce, scale, lengths)


@torch.library.register_fake("ripplekv::snapkv_scores")
def _(q_window, keys, kernel_size=7, pooling="max", group_reduce="mean", scale=None, lengths=None):
    check_row_device("snapkv_scores", keys, lengths=lengths)
    check_one_device("snapkv_scores", q_window=q_window, keys=keys)
    torch._check(q_window.dim() == 4, lambda: f"snapkv_scores: q_window must be 4-D, got {q_window.dim()}-D")
    torch._check(keys.dim() == 4, lambda: f"snapkv_scores: keys must be 4-D, got {keys.dim()}-D")
    return keys.new_empty((keys.shape[0], keys.shape[1], keys.shape[2] - q_window.shape[2]), dtype=torch.float32)
