"""``CompressedLayer``: a full-attention cache layer after compression, and the guard that keeps it in its block.

A compressed layer holds fewer keys than its sequence has tokens, so only an attention function that knows it
(the one a ``ripplekv_ext.compress`` block registers) can mask it. The blocks open in this process are recorded
here (``open_block`` / ``close_block``); a compressed layer takes new tokens only inside a forward, in the same
thread, of a model whose block is open (each block's ``runs(layer)`` says whether the layer belongs to the cache
of its current forward).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from ripplekv_ext.integrations.transformers.versions import query_length, tokens_to_remove
from ripplekv_ext.transformers_front.masks import end_aligned_causal, end_aligned_causal_mask

__all__ = ["CompressedLayer", "open_block", "close_block", "block_on", "runs_in_open_block"]

# model -> the block (CompressionSession) open on it. A block switches the model's (shared) config to its own
# attention function, so two open blocks on one model would undo each other in whatever order they exit.
_open_blocks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_blocks_lock = threading.Lock()


def open_block(model, block):
    """Record ``block`` as open on ``model``; returns the block already open on it instead (nothing recorded)."""
    with _blocks_lock:
        other = _open_blocks.get(model)
        if other is None:
            _open_blocks[model] = block
        return other


def close_block(model, block) -> None:
    with _blocks_lock:
        if _open_blocks.get(model) is block:
            del _open_blocks[model]


def block_on(model):
    """The block open on ``model`` (from any thread), or None."""
    with _blocks_lock:
        return _open_blocks.get(model)


def runs_in_open_block(layer) -> bool:
    """Whether ``layer`` belongs to the cache of a forward, in this thread, of a model whose block is open."""
    with _blocks_lock:
        blocks = list(_open_blocks.values())
    return any(block.runs(layer) for block in blocks)


class CompressedLayer(DynamicLayer):
    """A full-attention cache layer after compression: compact keys/values, true token count kept apart.

    ``get_seq_length`` is the number of tokens the layer has *seen* (prompt + generated), which transformers uses
    for positions and for slicing new inputs; ``physical_length`` is what the tensors hold.

    ``key_mask`` (bool ``[B, physical_length]`` or None: every slot real) marks the slots that hold a real token
    of their row; a left-padded batch's rows have padding slots in front of their kept tokens. A selector whose KV
    heads keep different counts (AdaKV) gives one per head instead, ``[B, H_kv, physical_length]``.

    Compression during decoding (``Policy.decode_every``) keeps, per layer, the post-RoPE queries of the newest
    ``W`` tokens (``recent_queries``), each row's prompt length and the tokens added since the last selection.
    """

    def __init__(self, keys: Tensor, values: Tensor, seen_tokens: int, key_mask: Optional[Tensor] = None):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.seen_tokens = int(seen_tokens)
        shapes = ((keys.shape[0], keys.shape[2]), tuple(keys.shape[:3]))
        if key_mask is not None and tuple(key_mask.shape) not in shapes:
            raise ValueError(f"key_mask must be [B, C] = {[keys.shape[0], keys.shape[2]]} or, per KV head, "
                             f"[B, H_kv, C] = {list(keys.shape[:3])}, got {list(key_mask.shape)}")
        self.key_mask = key_mask
        self.recent_queries: Optional[Tensor] = None  # [B, H_q, <= W, D] post-RoPE queries of the newest tokens
        self.prompt_lengths: Optional[Tensor] = None  # int64 [B] (CPU): each row's real prompt tokens
        self.prompt_tokens = self.seen_tokens  # tokens seen at the prefill (the padded prompt length)
        self.since_selection = 0  # tokens added since the last selection

    @property
    def physical_length(self) -> int:
        return self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        self._check_continued_in_block()
        self.seen_tokens += key_states.shape[-2]
        self.since_selection += key_states.shape[-2]
        if self.key_mask is not None:  # new tokens are real
            new = self.key_mask.new_ones(*self.key_mask.shape[:-1], key_states.shape[-2])
            self.key_mask = torch.cat([self.key_mask, new], dim=-1)
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def _check_continued_in_block(self) -> None:
        if not runs_in_open_block(self):
            # Outside a block the model's own attention runs with masks sized for the uncompressed sequence: with
            # per-layer budgets it fails on a shape, with equal ones it silently misaligns the keys. A block open
            # on another model does not help: its attention function is not this model's.
            raise RuntimeError("a ripplekv_ext-compressed cache can only be continued inside "
                               "`with ripplekv_ext.compress(model, policy):` open on the model that continues it "
                               "(or with ripplekv_ext.continue_context): outside it the model's masks do not fit "
                               "the kept tokens")

    def get_mask_sizes(self, query_length_or_position) -> tuple[int, int]:
        # Asked while the model builds its masks, before any layer takes the new tokens: refusing here leaves the
        # whole cache as it was (update checks too, for a forward that builds no mask).
        self._check_continued_in_block()
        # The mask transformers builds from this is never used for this layer (the block's attention builds its
        # own); sizing it by what is stored keeps it small.
        return self.physical_length + query_length(query_length_or_position), 0

    def crop(self, tokens: int) -> None:
        # Sliced here, not by DynamicLayer.crop: older releases measure the layer with get_seq_length.
        remove = min(tokens_to_remove(tokens, self.seen_tokens), self.seen_tokens)
        keep = max(self.physical_length - remove, 0)
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[..., :keep]
        self.seen_tokens -= remove

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.key_mask = None
        self.recent_queries = self.prompt_lengths = None
        self.prompt_tokens = self.since_selection = 0

    def remember_queries(self, query: Tensor, window: int) -> None:
        """Keep the newest ``window`` post-RoPE queries (the window of the next selection during decoding)."""
        recent = query if self.recent_queries is None else torch.cat([self.recent_queries, query], dim=2)
        # A copy, so the buffer never holds a whole prefill's queries alive.
        self.recent_queries = recent[:, :, -window:].clone()

    def prompt_read(self, read) -> None:
        """A prompt read in chunks has reached this layer's newest tokens: ``read`` real tokens per row so far (what
        later selections during decoding count as the prompt)."""
        self.prompt_tokens = self.seen_tokens
        self.prompt_lengths = torch.tensor([int(x) for x in read], dtype=torch.int64)

    def seen_per_row(self) -> list[int]:
        """Real tokens each row has seen (its prompt plus every token added since)."""
        generated = self.seen_tokens - self.prompt_tokens
        return [n + generated for n in self.prompt_lengths.tolist()]

    def held_per_row(self) -> list[int]:
        """Real tokens each row holds now."""
        if self.key_mask is None:
            return [self.physical_length] * self.keys.shape[0]
        if self.key_mask.dim() == 3:  # per KV head: what the row's longest head holds
            return self.key_mask.sum(dim=-1).amax(dim=-1).tolist()
        return self.key_mask.sum(dim=1).tolist()

    def keep(self, keys: Tensor, values: Tensor, key_mask: Optional[Tensor]) -> None:
        """Replace the held tokens by a selection of them (``key_mask`` as in the constructor)."""
        self.keys, self.values, self.key_mask = keys, values, key_mask
        self.since_selection = 0

    def _reorder_decode_state(self, rows: Tensor) -> None:
        if self.recent_queries is not None:
            self.recent_queries = self.recent_queries.index_select(0, rows.to(self.recent_queries.device))
            self.prompt_lengths = self.prompt_lengths.index_select(0, rows.cpu())

    # Batch reshuffles (beam search, contrastive search) move the key mask with its rows.
    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.repeat_interleave(repeats, dim=0)
        if self.prompt_lengths is not None:
            self._reorder_decode_state(torch.arange(len(self.prompt_lengths)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        if self.key_mask is not None:
            self.key_mask = self.key_mask[indices]
        if self.prompt_lengths is not None:
            self._reorder_decode_state(torch.arange(len(self.prompt_lengths))[torch.as_tensor(indices).cpu()])

    def reorder_cache(self, beam_idx: Tensor) -> None:
        super().reorder_cache(beam_idx)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, beam_idx.to(self.key_mask.device))
        if self.prompt_lengths is not None:
            self._reorder_decode_state(beam_idx)

    def attention_mask(self, q_len: int, dtype: torch.dtype, query_heads: int = 1) -> Optional[Tensor]:
        """Additive mask for ``q_len`` new queries over this layer's keys: end-aligned causality and the key mask
        (``[B, 1, q_len, C]``, or ``[B, query_heads, q_len, C]`` for a per-head key mask, each query head reading
        its KV head's); ``None`` when it would mask nothing (one query, no padding)."""
        kv_len, device = self.physical_length, self.keys.device
        if self.key_mask is None:
            return None if q_len == 1 else end_aligned_causal_mask(q_len, kv_len, dtype, device)
        if self.key_mask.dim() == 3:
            allowed = self.key_mask.repeat_interleave(query_heads // self.key_mask.shape[1], dim=1)[:, :, None, :]
        else:
            allowed = self.key_mask[:, None, None, :]
        if q_len > 1:
            allowed = allowed & end_aligned_causal(q_len, kv_len, device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
