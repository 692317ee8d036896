"""Scheduler side: the manager of a tier's KV cache group, which frees a compressed request's first blocks.

vLLM picks each group's manager by spec type: ``RippleKVManager``, a ``FullAttentionManager`` whose
``remove_skipped_blocks`` (which vLLM calls before every allocation) lets go, once a request's prompt is computed,
of the whole blocks the worker's compaction emptied (``EnginePlan.dropped_blocks``) and, with prefix caching, of
the shared blocks whose kept tokens went to the request's own (``block_layout``), replacing them with the null
block as vLLM's sliding-window manager does. Block tables keep their length and only grow by appending, as vLLM's
workers expect; the private blocks' columns are counted in the length-based allocation.
"""

from __future__ import annotations

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ripplekv_ext.engines.vllm.kv_cache import RippleKVSpec, plan_of_spec

__all__ = ["RippleKVManager", "register_spec"]


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

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # Blocks are hashed as they are allocated: only those holding what a full prefill writes may be.
        super().cache_blocks(request, min(num_tokens, self.plan.shared_tokens(request.num_prompt_tokens)),
                             *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str):
        # Finished or preempted: a preempted request is compressed again after its recompute.
        self._compressed.pop(request_id, None)
        self._prompt_tokens.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def register_spec() -> None:
    """Register ``RippleKVSpec`` with its manager (idempotent). vLLM registers its own specs on first use only if
    the registry is empty, so that runs first."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(RippleKVSpec, RippleKVManager, uniform_type_base_spec=FullAttentionSpec)
