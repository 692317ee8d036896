"""Attention masks after compression: end-aligned causality, and the per-row lengths of a left-padded batch.

A compressed layer's keys are its kept tokens, not the sequence's positions, so its mask cannot come from the model:
new queries sit at the end of whatever the layer holds (``end_aligned_causal``), and in a left-padded batch each
row's real tokens are read off the 2-D ``attention_mask`` (``row_lengths``), which must have zeros only on the left.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["check_batch", "end_aligned_causal", "end_aligned_causal_mask", "row_lengths"]


def end_aligned_causal(q_len: int, kv_len: int, device) -> Tensor:
    """bool ``[q_len, kv_len]``: query ``i`` sits at key position ``kv_len - q_len + i`` and sees keys up to it."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= query_pos


def end_aligned_causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device) -> Tensor:
    """Additive mask ``[1, 1, q_len, kv_len]``: query ``i`` sits at key position ``kv_len - q_len + i``."""
    allowed = end_aligned_causal(q_len, kv_len, device)
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def row_lengths(attention_mask) -> Optional[Tensor]:
    """Real tokens per row (int64 ``[B]``) of a left-padded 2-D ``attention_mask``; ``None`` when nothing is padded.

    Raises ``ValueError`` naming the rows for what cannot be compressed row by row: right padding (zeros after the
    ones; decoder-only generation wants ``tokenizer.padding_side = "left"``), holes (zeros between ones), rows with
    no real token, and masks that are not 2-D ``[batch, tokens]``.
    """
    if attention_mask is None or not isinstance(attention_mask, Tensor):
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a 2-D [batch, tokens] mask (or None) under ripplekv_ext.compress, "
                         f"got a {attention_mask.dim()}-D mask: custom masks cannot follow per-layer compressed "
                         f"caches")
    real = attention_mask.bool()
    if bool(real.all()):
        return None
    n = real.shape[1]
    lengths = real.sum(dim=1)
    left_padded = torch.arange(n, device=real.device)[None, :] >= (n - lengths)[:, None]
    bad = (real != left_padded).any(dim=1)
    if bool(bad.any()):
        right_padded = torch.arange(n, device=real.device)[None, :] < lengths[:, None]
        right = (bad & (real == right_padded).all(dim=1)).nonzero().flatten().tolist()
        holes = (bad & (real != right_padded).any(dim=1)).nonzero().flatten().tolist()
        found = "; ".join(part for part in (f"right-padded rows {right}" if right else "",
                                            f"rows with holes (zeros between ones) {holes}" if holes else "") if part)
        raise ValueError(f"attention_mask must be left-padded under ripplekv_ext.compress (each row: zeros, then "
                         f"ones), got {found}. Pad on the left (tokenizer.padding_side = 'left'), as decoder-only "
                         "generation expects.")
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask rows {empty} have no real token (all zeros): nothing to attend to or "
                         "compress; drop those rows from the batch")
    return lengths


def check_batch(args, kwargs) -> None:
    inputs = kwargs.get("input_ids", args[0] if args else None)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if isinstance(inputs, Tensor) and inputs.dim() >= 2 and inputs.shape[0] == 0:
        raise ValueError("a batch of zero rows was given to a model under ripplekv_ext.compress: nothing to "
                         "compress or generate; skip the call")
