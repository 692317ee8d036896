"""Reference SnapKV window scores (docs/design.md §4), materializing the full probability tensor on purpose."""

import torch
import torch.nn.functional as F
from torch import Tensor

from ripplekv_ref._checks import (check_float, check_group, check_head_dim, check_int, check_lengths,
                                 check_rank, reduce_group, resolve_scale)


def snapkv_scores(q_window: Tensor, keys: Tensor, kernel_size: int = 7, pooling: str = "max",
                  group_reduce: str = "mean", scale=None, lengths=None) -> Tensor:
    """Attention mass each prefix key receives from the observation window, pooled along positions.

    Args:
        q_window: ``[B, H_q, W, D]`` post-RoPE queries of the last ``W`` prompt positions.
        keys: ``[B, H_kv, N, D]``, ``H_q = G * H_kv``, ``W < N``.
        kernel_size: odd pooling width (1 disables pooling); padding is ``kernel_size // 2``.
        pooling: ``"max"`` (pads with -inf) or ``"avg"`` (zero padding counted, like ``avg_pool1d``).
        group_reduce: ``"mean"`` or ``"max"`` over the ``G`` query heads sharing a KV head.
        scale: logit scale, ``1/sqrt(D)`` when None.
        lengths: optional int64 ``[B]``, a left-padded batch: row ``b``'s ``n_b`` real tokens are positions
            ``[N - n_b, N)``. Each row is then scored alone on ``keys[b:b+1, :, N - n_b:]``; pad positions (and every
            position of a row with ``n_b <= W``) are ``-inf``.

    Returns:
        float32 ``[B, H_kv, N - W]``.
    """
    if lengths is not None:
        snapkv_scores(q_window[:0], keys[:0], kernel_size, pooling, group_reduce, scale)  # checks every argument
        b, n, w = keys.shape[0], keys.shape[2], q_window.shape[2]
        scores = torch.full((b, keys.shape[1], n - w), float("-inf"), device=keys.device)
        for row, n_b in enumerate(check_lengths(lengths, b, n)):
            if n_b > w:
                scores[row:row + 1, :, n - n_b:] = snapkv_scores(q_window[row:row + 1], keys[row:row + 1, :, n - n_b:],
                                                                 kernel_size, pooling, group_reduce, scale)
        return scores
    check_rank("q_window", q_window, 4, "[B, H_q, W, D]")
    check_rank("keys", keys, 4, "[B, H_kv, N, D]")
    check_float("q_window", q_window)
    check_float("keys", keys)
    b, h_q, w, d = q_window.shape
    if keys.shape[0] != b or keys.shape[3] != d:
        raise ValueError(f"keys must be [B={b}, H_kv, N, D={d}] to match q_window, got {list(keys.shape)}")
    check_head_dim("keys", keys)
    h_kv, n = keys.shape[1], keys.shape[2]
    g = check_group("q_window", h_q, h_kv)
    if w < 1 or w >= n:
        raise ValueError(f"window W (q_window dim 2) must be in [1, N) = [1, {n}), got {w}")
    check_int("kernel_size", kernel_size, 1)
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd (so pooling keeps the length), got {kernel_size}")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    if group_reduce not in ("mean", "max"):
        raise ValueError(f"group_reduce must be 'mean' or 'max', got {group_reduce!r}")

    q = q_window.float()
    k = keys.float().repeat_interleave(g, dim=1)  # query head h reads KV head h // G
    logits = resolve_scale(scale, d) * (q @ k.transpose(-1, -2))  # [B, H_q, W, N]
    query_pos = torch.arange(n - w, n, device=keys.device).unsqueeze(-1)
    key_pos = torch.arange(n, device=keys.device)
    logits = logits.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    per_head = probs[..., : n - w].sum(dim=-2)  # [B, H_q, N - W]
    scores = reduce_group(per_head, h_kv, group_reduce)
    if kernel_size == 1:
        return scores.contiguous()
    flat = scores.reshape(b * h_kv, 1, n - w)
    pad = kernel_size // 2
    if pooling == "max":
        pooled = F.max_pool1d(F.pad(flat, (pad, pad), value=float("-inf")), kernel_size, stride=1)
    else:
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return pooled.reshape(b, h_kv, n - w)
