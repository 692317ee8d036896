"""Scheduler side: the manager of a tier's KV cache group, which frees a compressed request's first blocks.

vLLM picks each group's manager by spec type: ``RippleKVManager``, a ``FullAttentionManager`` whose
``remove_skipped_blocks`` (which vLLM calls before every allocation) lets go, once a request's prompt is computed,
of the whole blocks the worker's compaction emptied (``EnginePlan.dropped_blocks``) and, with prefix caching, of
the shared blocks whose kept tokens went to the request's own (``block_layout``), replacing them with the null
block as vLLM's sliding-window manager does. Block tables keep their length and only grow by appending, as vLLM's
workers expect; the private blocks' columns are counted in the length-based allocation.

With ``compress_prefix`` (``P``), a prompt longer than ``P`` is compacted in place at ``P`` and nothing of it is
hashed as a full prefill's: its compacted prefix blocks and every full block after them are hashed under keys of their
own (``compacted_prefix_keys``: derived from vLLM's chained hashes, so equal keys mean equal tokens before), and a hit
is the compacted prefix whole (the null block for its freed blocks, as a sliding window's hit) and what follows it,
or nothing.
"""

from __future__ import annotations

import hashlib

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ripplekv_ext.engines.vllm.kv_cache import RippleKVSpec, plan_of_spec

__all__ = ["RippleKVManager", "RequestView", "compacted_prefix_keys", "register_spec"]


class RippleKVManager(FullAttentionManager):
    """A tier's blocks of each request, laid out as ``block_layout`` says: once a request's prompt is computed up to
    a compaction boundary ``b`` (``EnginePlan.boundaries``; the workers compacted the tier's kept tokens in that
    step) it lets go of the blocks before its first kept one (after a protected prefix), and, after the tier's first
    compaction, of the shared blocks its private ones replaced (prefix caching keeps them). In the step that reaches
    that compaction it allocates the private blocks, in the columns the layout names; blocks are hashed up to
    ``EnginePlan.shared_tokens`` only."""

    def __init__(self, kv_cache_spec: RippleKVSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.plan = plan_of_spec(kv_cache_spec)
        self.tier = kv_cache_spec.tier
        if kv_cache_spec.held_tokens is not None:
            # vLLM's admission check of a whole prompt, capped as for its block-recycling specs (sliding windows).
            self.max_admission_blocks_per_request = cdiv(kv_cache_spec.held_tokens, kv_cache_spec.block_size)
        self._prompt_tokens: dict[str, int] = {}  # request -> its prompt length (vLLM passes it before allocating)
        self._compressed: dict[str, int] = {}  # request -> the prompt length its blocks were freed for
        self._compacting: dict[str, object] = {}  # request -> itself, while compacted at its prefix (compress_prefix)

    def layout(self, request_id: str):
        n = self._prompt_tokens.get(request_id)
        return None if n is None else self.plan.tier_layout(self.tier, n, self.enable_caching)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return
        self._prompt_tokens[request_id] = num_prompt_tokens
        done = self._compressed.get(request_id)
        if done is not None and done != num_prompt_tokens:
            # A resumable (streaming-input) request extended its prompt: its cache was compressed for the old one.
            raise RuntimeError(f"ripplekv: request {request_id}'s prompt grew from {done} to {num_prompt_tokens} "
                               "tokens after its cache was compressed; streaming-input (resumable) requests are not "
                               "supported by the plugin")
        boundary = self.plan.last_boundary(num_prompt_tokens, processed_computed_tokens)
        if boundary is None:
            return
        layout = self.layout(request_id)
        first_kept = self.plan.kept_from_block(self.tier, num_prompt_tokens, boundary)
        compacted = layout.rewrite_at is not None and boundary >= layout.rewrite_at
        blocks = self.req_to_blocks[request_id]
        # Later columns first, so that vLLM's LRU evicts a shared prompt's tail before its head.
        released = []
        for column in reversed(layout.freed_columns(first_kept, compacted)):
            if column < len(blocks) and not blocks[column].is_null:
                released.append(blocks[column])
                blocks[column] = self._null_block
        if released:
            self.block_pool.free_blocks(released)
        if first_kept > self.plan.protected_blocks:
            self._compressed[request_id] = num_prompt_tokens

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        layout = self.layout(request_id)
        blocks = self.req_to_blocks[request_id]
        if layout is None or not layout.has_private(num_tokens) or len(blocks) >= layout.columns_needed(
                layout.rewrite_at):
            return super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens),
                                               num_tokens_main_model)
        # The step reaching the first compaction: the prompt's blocks up to it, the private ones, then the rest.
        new = super().allocate_new_blocks(request_id, layout.rewrite_at, num_tokens_main_model)
        private = self.block_pool.get_new_blocks(layout.private)
        blocks.extend(private)
        rest = super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens), num_tokens_main_model)
        return list(new) + private + list(rest)

    def _slots(self, request_id: str, num_tokens: int) -> int:
        """``num_tokens`` as vLLM's length-based allocation must count it: the private blocks' columns added."""
        layout = self.layout(request_id)
        if layout is None or not layout.has_private(num_tokens):
            return num_tokens
        return num_tokens + layout.private * self.block_size

    def _cache_compacted(self, request, num_tokens: int) -> None:
        """Hash a prompt compacted at its prefix (``EnginePlan.compacts_prefix``) under the plugin's own keys: once a
        step has computed ``P`` tokens, the prefix's kept blocks, and the full blocks after them as they are computed;
        never the blocks the compaction frees. Only what earlier steps wrote (``num_computed_tokens``): no block is
        hashed before the workers' compaction has written it."""
        prefix = self.plan.prefix
        computed = min(num_tokens, request.num_computed_tokens)
        if computed < prefix:
            return
        full = min(computed // self.block_size, len(request.block_hashes))
        cached = max(self.num_cached_block.get(request.request_id, 0), self.plan.prefix_dropped[self.tier])
        if cached >= full:
            return
        # Keys for the new blocks only (cache_full_blocks reads those from column `cached` on).
        keys = [None] * cached + compacted_prefix_keys(request.block_hashes, prefix // self.block_size, cached, full)
        self.block_pool.cache_full_blocks(RequestView(request, block_hashes=keys),
                                          self.req_to_blocks[request.request_id], cached, full, self.block_size,
                                          self.kv_cache_group_id)
        self.num_cached_block[request.request_id] = full

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids, block_pool, kv_cache_spec,
                               *args, **kwargs):
        plan = plan_of_spec(kv_cache_spec)
        prefix, block_size = plan.prefix, kv_cache_spec.block_size
        # Shorter lookups are of prompts no longer than the prefix (get_computed_blocks caps those at their own
        # first compaction's window): stock hashes.
        if not prefix or max_length < prefix:
            return super().find_longest_cache_hit(block_hashes, max_length, kv_cache_group_ids, block_pool,
                                                  kv_cache_spec, *args, **kwargs)
        p, d = prefix // block_size, plan.prefix_dropped[kv_cache_spec.tier]
        hits = tuple([block_pool.null_block] * d for _ in kv_cache_group_ids)
        keys = compacted_prefix_keys(block_hashes, p, d, min(max_length // block_size, len(block_hashes)))
        for column, key in enumerate(keys, start=d):
            cached = block_pool.get_cached_block(key, kv_cache_group_ids)
            if not cached:
                if column < p:  # the compacted prefix is a hit whole or not at all
                    return tuple([] for _ in kv_cache_group_ids), 0
                break
            for blocks, block in zip(hits, cached):
                blocks.append(block)
        return hits, len(hits[0]) * block_size

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        if self.plan.compacts_prefix(request.num_prompt_tokens):
            self._compacting[request.request_id] = request
            return self._cache_compacted(request, num_tokens)
        # Blocks are hashed as they are allocated: only those holding what a full prefill writes may be.
        super().cache_blocks(request, min(num_tokens, self.plan.shared_tokens(request.num_prompt_tokens)),
                             *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str):
        # Finished or preempted: a preempted request is compressed again after its recompute.
        request = self._compacting.pop(request_id, None)
        if request is not None:
            # What the last steps wrote, which no later step of this request will hash (one generated token).
            self._cache_compacted(request, request.num_computed_tokens)
        self._compressed.pop(request_id, None)
        self._prompt_tokens.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def compacted_prefix_keys(block_hashes, prefix_blocks: int, start: int, end: int) -> list[bytes]:
    """The prefix-cache keys of columns ``[start, end)`` of a prompt compacted at its first ``prefix_blocks`` blocks,
    from vLLM's chained ``block_hashes`` of its tokens. A column of the compacted prefix holds kept tokens chosen from
    the whole prefix: its key is the last prefix block's hash (every token of the prefix) and the column. A later
    full block was computed against the compacted prefix, not by a full prefill: its key is its own hash, salted."""
    last = block_hashes[prefix_blocks - 1]
    return [hashlib.sha256(b"ripplekv compacted prefix" + last + column.to_bytes(8, "little")).digest()
            if column < prefix_blocks else
            hashlib.sha256(b"ripplekv after a compacted prefix" + block_hashes[column]).digest()
            for column in range(start, end)]


class RequestView:
    """``request`` as a vLLM function reads it, with the given attributes in place of its own."""

    def __init__(self, request, **attributes):
        self._request = request
        self.__dict__.update(attributes)

    def __getattr__(self, name):
        return getattr(self._request, name)


def register_spec() -> None:
    """Register ``RippleKVSpec`` with its manager (idempotent). vLLM registers its own specs on first use only if
    the registry is empty, so that runs first."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(RippleKVSpec, RippleKVManager, uniform_type_base_spec=FullAttentionSpec)
