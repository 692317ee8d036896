"""Reference H2O heavy-hitter scores: cumulative causal attention over every prompt query, in query chunks."""

import torch
from torch import Tensor

from ripplekv_ref._checks import (check_float, check_group, check_head_dim, check_int, check_lengths,
                                 check_rank, reduce_group, resolve_scale)


def h2o_scores(queries: Tensor, keys: Tensor, chunk_size: int = 1024, scale=None,
               group_reduce: str = "mean", lengths=None) -> Tensor:
    """``a_{g,j} = reduce over the group of sum_{i >= j} p_{h,i,j}`` for every position ``j``.

    Args:
        queries: ``[B, H_q, N, D]`` post-RoPE queries of all prompt positions.
        keys: ``[B, H_kv, N, D]``.
        chunk_size: queries processed at once; memory is ``O(B * H_q * chunk_size * N)`` for the chunk plus
            ``O(B * H_q * N)`` for the running sum, never ``O(N^2)`` per head.
        scale: logit scale, ``1/sqrt(D)`` when None.
        group_reduce: ``"mean"`` (the H2O definition) or ``"max"``.
        lengths: optional int64 ``[B]``, a left-padded batch: row ``b``'s ``n_b`` real tokens are positions
            ``[N - n_b, N)``. Each row is then scored alone on its real queries and keys (pad keys get no attention,
            pad queries add nothing); pad positions are ``-inf``.

    Returns:
        float32 ``[B, H_kv, N]``. Callers slice ``[..., :N - W]`` and pass it to ``select_topk``.
    """
    if lengths is not None:
        h2o_scores(queries[:0], keys[:0], chunk_size, scale, group_reduce)  # checks every argument
        b, n = keys.shape[0], keys.shape[2]
        scores = torch.full((b, keys.shape[1], n), float("-inf"), device=keys.device)
        for row, n_b in enumerate(check_lengths(lengths, b, n)):
            if n_b > 0:
                scores[row:row + 1, :, n - n_b:] = h2o_scores(queries[row:row + 1, :, n - n_b:],
                                                              keys[row:row + 1, :, n - n_b:], chunk_size, scale,
                                                              group_reduce)
        return scores
    check_rank("queries", queries, 4, "[B, H_q, N, D]")
    check_rank("keys", keys, 4, "[B, H_kv, N, D]")
    check_float("queries", queries)
    check_float("keys", keys)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    b, h_q, n, d = queries.shape
    if keys.shape[0] != b or keys.shape[2] != n or keys.shape[3] != d:
        raise ValueError(f"keys must be [B={b}, H_kv, N={n}, D={d}] to match queries, got {list(keys.shape)}")
    check_head_dim("keys", keys)
    h_kv = keys.shape[1]
    g = check_group("queries", h_q, h_kv)
    if group_reduce not in ("mean", "max"):
        raise ValueError(f"group_reduce must be 'mean' or 'max', got {group_reduce!r}")

    k = keys.float().repeat_interleave(g, dim=1)
    s = resolve_scale(scale, d)
    key_pos = torch.arange(n, device=keys.device)
    total = torch.zeros(b, h_q, n, dtype=torch.float32, device=keys.device)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        logits = s * (queries[:, :, start:stop].float() @ k.transpose(-1, -2))  # [B, H_q, chunk, N]
        query_pos = torch.arange(start, stop, device=keys.device).unsqueeze(-1)
        logits = logits.masked_fill(key_pos > query_pos, float("-inf"))
        total += torch.softmax(logits, dim=-1).sum(dim=-2)
    return reduce_group(total, h_kv, group_reduce)
